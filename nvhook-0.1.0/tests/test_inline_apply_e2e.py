"""The hook's in-process apply step (nvhook.apply._apply_here) in real runc containers, as an
attacker would push it: what the hook does while it is in the container's mount namespace
(no import, no log written there), the time limit arriving as it returns, an I/O error half
way, and a FUSE mount in the image's library path whose server never answers.

The hook runs under tests/e2e/nsaudit_hook.py: bin/nvhook's start (the start-path bundle
first) under a Python audit hook that reports every import and path-based file operation made
while the process is outside its own mount namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

AUDIT = Path(rb.__file__).with_name("nsaudit_hook.py")
GPU0 = {"NVIDIA_VISIBLE_DEVICES": "0"}


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


def _audited(tmp_path: Path, host: Path, *opts: str, **kw) -> tuple[rb.HookRun, list[dict], dict]:
    report = tmp_path / "audit.jsonl"
    r = rb.run_with_nvhook(tmp_path, host=host, env=GPU0, script="echo STARTED",
                           hook_script=[AUDIT, report, *opts], **kw)
    records = [json.loads(ln) for ln in report.read_text().splitlines()] if report.exists() else []
    ends = [x for x in records if "exit" in x]
    assert len(ends) == 1, (records[-5:], r.proc.stderr)
    inside = [x for x in records if "event" in x]
    return r, inside, ends[0]


def _nothing_outside_the_plan(inside: list[dict], r: rb.HookRun) -> None:
    """Inside the container's namespace: no module imported (its code would be read from the
    container's view), and the log file never opened there."""
    assert [x for x in inside if x["event"] == "import"] == []
    assert [x for x in inside if x.get("arg") == str(r.log_file)] == []
    # sanity: the audit saw the apply step's own opens in there (the rootfs, by design)
    assert {"event": "open", "arg": str(r.rootfs)} in inside


def test_default_start_imports_nothing_in_the_containers_namespace(tmp_path, gpu8):
    r, inside, end = _audited(tmp_path, gpu8)
    assert r.proc.returncode == 0, r.proc.stderr
    assert "STARTED" in r.stdout and end == {"exit": 0, "home": True}
    _nothing_outside_the_plan(inside, r)
    assert r.events()[-1]["event"] == "hook.done"


def test_time_limit_reached_as_the_return_begins_does_not_keep_the_hook_in_the_container(tmp_path, gpu8):
    """Before: the alarm's handler raised as the return to nvhook's own namespace began, the
    setns back never ran, and the hook wrote its log by path in the container's view (and
    refused the container). The work was done: now the late alarm is ignored, the hook comes
    back and the container starts."""
    r, inside, end = _audited(tmp_path, gpu8, "--fail-in-container", "alarm")
    _nothing_outside_the_plan(inside, r)
    assert end == {"exit": 0, "home": True}, r.proc.stderr
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    assert r.events()[-1]["event"] == "hook.done"


@pytest.mark.parametrize("fail,line,event", [
    ("hook", "injected failure in the container's namespace", "hook.failed"),
    # as a forked apply worker reports it (before: "internal error: OSError: [Errno 5] ...", hook.crashed)
    ("oserror", "applying the plan failed: Input/output error", "hook.failed"),
    ("bug", "internal error: ValueError: injected bug in the container's namespace (details in the nvhook log)",
     "hook.crashed"),
])
def test_failure_in_the_containers_namespace_is_reported_from_home(tmp_path, gpu8, fail, line, event):
    r, inside, end = _audited(tmp_path, gpu8, "--fail-in-container", fail)
    _nothing_outside_the_plan(inside, r)
    assert end == {"exit": 1, "home": True}
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert r.hook_error_lines() == [f"nvhook: {line}"], r.proc.stderr
    assert r.events()[-1]["event"] == event


# -- a FUSE mount whose server stops reading ---------------------------------------------------

STALLFS = r"""
import os, struct, sys, time
sys.path.insert(0, sys.argv[2])
from nvhook.base import sandbox
fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
sandbox.mount("stallfs", sys.argv[1], "fuse", sandbox.MS_NOSUID | sandbox.MS_NODEV,
              f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other")
req = os.read(fd, 1 << 20)
length, opcode, unique = struct.unpack_from("<IIQ", req)
assert opcode == 26, opcode  # FUSE_INIT: answered; no later request is ever read
body = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 0, 0, 4096, 0, 0, 0, 0) + bytes(28)
os.write(fd, struct.pack("<IiQ", 16 + len(body), 0, unique) + body)
print("mounted", flush=True)
time.sleep(600)
"""


def _fuse_skip() -> str | None:
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        return "needs /dev/fuse and root"
    with open("/proc/filesystems") as f:
        return None if any(ln.split()[-1] == "fuse" for ln in f) else "no fuse in this kernel"


@pytest.mark.skipif(_fuse_skip() is not None, reason=_fuse_skip() or "")
def test_fuse_mount_that_never_answers_does_not_hang_the_start(tmp_path, gpu8):
    """The image lists /hang in its ld.so.conf and a FUSE file system is mounted there whose
    server (stuck elsewhere) reads no request: nvhook's cache writer waits in the kernel, where
    only a fatal signal ends the wait (the alarm's handler never runs). A forked worker's
    parent killed the worker at the limit; the hook's own process now ends by SIGKILL a little
    after it (grace 1 s here), instead of holding the container start until the runtime's
    hook timeout (runc has none by default; 40 s here)."""
    servers: list[tuple[subprocess.Popen, Path]] = []
    repo = str(Path(__file__).resolve().parent.parent)

    def prepare(rootfs: Path) -> None:
        (rootfs / "hang").mkdir()
        with open(rootfs / "etc/ld.so.conf", "a") as f:
            f.write("/hang\n")
        p = subprocess.Popen([sys.executable, "-c", STALLFS, str(rootfs / "hang"), repo], stdout=subprocess.PIPE,
                             text=True)
        servers.append((p, rootfs / "hang"))
        assert p.stdout is not None and p.stdout.readline().strip() == "mounted"

    t = time.monotonic()
    try:
        r = rb.run_with_nvhook(tmp_path, host=gpu8, env=GPU0, script="echo STARTED",
                               hook_script=[AUDIT, tmp_path / "audit.jsonl", "--grace", "1"],
                               config_extra="[ldconfig]\ntimeout = 1\n", prepare=prepare, timeout=40)
        took = time.monotonic() - t
    finally:
        for p, mnt in servers:
            p.kill()  # its /dev/fuse closes: the connection is aborted, no waiter is left
            p.wait()
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert "signal: killed" in r.proc.stderr, r.proc.stderr
    assert took < 30, f"{took:.1f} s"  # limit 2 s, SIGKILL at 3 s; runc's hook timeout is 40 s
    # written before the work, as always (once the request is known to need the driver)
    assert [e["event"] for e in r.events()] == ["hook.start", "request"]
