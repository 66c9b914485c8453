"""nvhookd's bound on a request child, with real runc containers: a request child that the
kernel holds (a FUSE mount in the image's library path whose server reads no request) must not
outlive every limit a client could wait for. Since nvhookd's request child applies the plan
itself (no apply worker whose parent killed it at the limit), only the apply step's SIGKILL
timer ended such a wait, and that timer is best effort: with no queued-signal slot left (a
container running as host root can use up root's) or a glibc without timer_create (before
2.34: RHEL 8), the child stayed for ever, one of nvhookd's 64 children gone for good."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import runcbox as rb  # noqa: E402
from test_inline_apply_e2e import STALLFS, _fuse_skip  # noqa: E402
from test_resident import Daemon  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

LIMITS = Path(rb.__file__).with_name("nvhookd_limits.py")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(_fuse_skip() is not None, reason=_fuse_skip() or "")
@pytest.mark.parametrize("where", ["applying", "observing"])
def test_a_request_child_the_kernel_holds_is_killed_past_every_limit(tmp_path, fixtures_root, where):
    """The daemon's bound (REQUEST_LIMIT_S, 6 s here) ends the child: its client gets the
    daemon's failure at once instead of waiting out its own limit, the daemon logs why, and no
    child is left behind. Before: the child was still there long after the container's start
    had failed. "applying": the FUSE mount is in a directory the image's ld.so.conf lists
    (nvhook's cache writer lists it), and no queued-signal slot is left for the apply step's
    SIGKILL timer; "observing": it is the image's CUDA compat directory, which the decision
    reads before anything is applied, where no timer runs at all."""
    servers: list[tuple[subprocess.Popen, Path]] = []
    repo = str(Path(__file__).resolve().parent.parent)

    def prepare(rootfs: Path) -> None:
        mnt = rootfs / ("hang" if where == "applying" else "usr/local/cuda/compat")
        mnt.mkdir(parents=True)
        if where == "applying":
            with open(rootfs / "etc/ld.so.conf", "a") as f:
                f.write("/hang\n")
        p = subprocess.Popen([sys.executable, "-c", STALLFS, str(mnt), repo], stdout=subprocess.PIPE, text=True)
        servers.append((p, mnt))
        assert p.stdout is not None and p.stdout.readline().strip() == "mounted"

    d = Daemon(tmp_path / "d", fixtures_root / "host-gpu8", "[ldconfig]\ntimeout = 1\n")
    try:
        d.start(prefix=(sys.executable, str(LIMITS), "--grace", "1", "--request-limit", "6",
                        *(["--no-sigpending"] if where == "applying" else [])))
        t = time.monotonic()
        r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"}, script="echo STARTED", prepare=prepare,
                  timeout=90)
        took = time.monotonic() - t
        assert r.proc.returncode != 0 and "STARTED" not in r.stdout
        # nvhookd's child took it, and never got further: the wait is in the kernel (applying:
        # the apply step's own limit, 1 + 1 s, passed with no effect)
        assert [e["event"] for e in r.events() if e.get("served_by")] == ["hook.start", "request"]
        # killed by nvhookd past its 6 s request limit: a minute leaves room for a loaded machine
        deadline = time.monotonic() + 60
        while d.busy_children() and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in d.busy_children() if _alive(pid)]
        assert left == [], f"request child(ren) {left} still held {time.monotonic() - t:.0f} s after the start"
        (killed,) = d.events("daemon.request_killed")
        assert killed["limit_s"] == 6 and "still running" in killed["message"]
        assert "nvhookd failed while serving this container" in r.proc.stderr, r.proc.stderr
        assert took < 30, took  # the client's own limit here: nvml 5 + ldconfig 1 + 45 s
    finally:
        d.stop()
        for p, mnt in servers:
            p.kill()  # its /dev/fuse closes: the connection is aborted, no waiter is left
            p.wait()
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
