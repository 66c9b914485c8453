"""Resident mode: nvhookd serving real runc containers, and the hook's fallbacks.

Each test starts its own nvhookd (the installed .venv/bin/nvhookd) on a socket in tmp_path, with
`--root` a fixture host and the same config the hook is given, then starts runc containers whose
prestart hook is the installed nvhook. What is asserted is what users see: the container's own
view (the same as the in-process hook's, compared line for line), runc's error line, nvhook's
JSON log (who served the start, which fallback and why), and how long a fallback took.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from waiting import PATIENCE_S, wait_until  # noqa: E402

from nvhook import __version__  # noqa: E402
from nvhook.base import residentwire  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

NVHOOKD = Path(sys.executable).with_name("nvhookd")
L = "/usr/lib/x86_64-linux-gnu"
GPU8 = mf.HOSTS["host-gpu8"]

# What a GPU container sees of its driver (a subset of test_e2e_runc.USER_VIEW that is the same
# from one start to the next: no times, no pids).
VIEW = f"""
echo STARTED
ls -l {L} | grep -o 'lib[a-z0-9_.-]*so[0-9.]*.*' | sort
/sbin/ldconfig -p | grep -E 'libcuda|libnvidia-ml' | sort
/usr/bin/cuda-probe
for d in /dev/nvidia*; do stat -c '%n %F %t:%T %a %u:%g' $d; done
echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"
echo "GPUS:$(ls /proc/driver/nvidia/gpus)"
grep ModifyDeviceFiles /proc/driver/nvidia/params
echo "SMI:$(nvidia-smi)"
echo "TOUCH:$(touch {L}/libcuda.so.1 2>&1)"
"""


class Daemon:
    """An nvhookd of this checkout on a private socket; stopped (SIGTERM, then SIGKILL) at the end."""

    # `timeout`: how long the hook waits for nvhookd's `ready`. A spare answers in milliseconds on
    # an idle machine, but a loaded one may hold it off the CPU for longer than the product's 2 s:
    # tests of nvhookd serving give it plenty; tests of the timeout itself set their own.
    def __init__(self, tmp: Path, host: Path, config_extra: str = "", sockdir: Path | None = None,
                 timeout: float = 20.0):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        if sockdir is None:
            sockdir = tmp / "run"
            sockdir.mkdir(mode=0o700)
        self.sockdir = sockdir
        self.socket = self.sockdir / "nvhookd.sock"
        self.extra = f'[daemon]\nsocket = "{self.socket}"\ntimeout = {timeout}\n' + config_extra
        self.log = tmp / "nvhookd.jsonl"
        self.config = rb.write_nvhook_config(tmp / "nvhook.toml", log_file=tmp / "nvhook.jsonl",
                                             cache_dir=tmp / "cache", extra=self.extra)
        self.host = host
        self.proc: subprocess.Popen | None = None

    def start(self, *extra_cmd: str, prefix: tuple = (), wait: bool = True, stderr=subprocess.PIPE) -> Daemon:
        # a new daemon.start event: a daemon started again after a kill finds the first one's in
        # the log already, and would be asked before it listens (its pid does not tell them apart:
        # a daemon in a pid namespace of its own logs its pid there)
        before = len(self.events("daemon.start"))
        self.proc = subprocess.Popen([*prefix, str(NVHOOKD), "--config", str(self.config), "--root", str(self.host),
                                      "--log-file", str(self.log), *extra_cmd],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                                     start_new_session=True)
        if wait:
            wait_until(lambda: self._started(before), "a new daemon.start event from nvhookd")
        return self

    def _started(self, before: int) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise AssertionError(f"nvhookd exited {self.proc.returncode}: {err}")
        return len(self.events("daemon.start")) > before

    def events(self, name: str | None = None) -> list[dict]:
        evs = rb.read_events(self.log)
        return evs if name is None else [e for e in evs if e["event"] == name]

    def children(self) -> list[int]:
        assert self.proc is not None
        return _children(self.proc.pid)

    def busy_children(self) -> list[int]:
        """Children serving a connection: unlike the spares, they no longer hold the listening
        socket (the only socket the daemon itself holds)."""
        assert self.proc is not None
        listener = _sockets(self.proc.pid)
        out = []
        for pid in self.children():
            try:
                zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                if not zombie and not _sockets(pid) & listener:
                    out.append(pid)
            except OSError:
                pass  # exited meanwhile
        return out


    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def run(self, tmp: Path, **kw) -> rb.HookRun:
        """A container with nvhook as its hook, given the daemon's config (and so its socket),
        cached as every start after a config's first finds it (bin/nvhook's client alone)."""
        kw.setdefault("host", self.host)
        kw.setdefault("config_cached", True)
        return rb.run_with_nvhook(tmp, config_extra=self.extra, cache_dir=self.tmp / "cache", **kw)


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []  # exited meanwhile


def _sockets(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


@pytest.fixture
def daemon_factory(tmp_path):
    made: list[Daemon] = []

    def make(host: Path, config_extra: str = "", sub: str = "d", sockdir: Path | None = None,
             timeout: float = 20.0) -> Daemon:
        d = Daemon(tmp_path / sub, host, config_extra, sockdir, timeout)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


@pytest.fixture(params=["first-start", "cached-config"])
def cached(request) -> bool:
    """The hook's two ways to nvhookd: the first start with a config file (nvhook.start.hook reads and
    caches it, then asks nvhookd) and every later one (bin/nvhook's client, from the cache)."""
    return bool(request.param == "cached-config")


def hook_events(r: rb.HookRun, name: str) -> list[dict]:
    return r.events(name)


def assert_served_by_daemon(r: rb.HookRun) -> dict:
    evs = r.events()
    assert evs and evs[0]["event"] == "hook.start", [e["event"] for e in evs]
    assert {e.get("served_by") for e in evs} == {"nvhookd"}, "every event of the run comes from nvhookd's child"
    assert len({e["nvhook_pid"] for e in evs}) == 1
    assert not r.events("daemon.fallback")
    (done,) = r.events("hook.done")
    assert done["result"] == "ok"
    return done


# -- same results as the in-process hook --------------------------------------------------------------

CASES = {
    "gpu0-compute-utility": {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
    "gpu8-all": {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"},
    "mig-by-uuid": {"NVIDIA_VISIBLE_DEVICES": GPU8.gpus[0].migs[0].uuid,
                    "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_resident_container_sees_what_the_in_process_hook_gives(tmp_path, fixtures_root, daemon_factory, case):
    host = fixtures_root / "host-gpu8"
    d = daemon_factory(host).start()
    served = d.run(tmp_path / "resident", env=CASES[case], script=VIEW)
    assert served.proc.returncode == 0, served.proc.stderr
    in_process = rb.run_with_nvhook(tmp_path / "inproc", host=host, env=CASES[case], script=VIEW,
                                    config_extra='[daemon]\nmode = "off"\n')
    assert in_process.proc.returncode == 0, in_process.proc.stderr
    assert "STARTED" in served.stdout and "cuDriverGetVersion: 12020" in served.stdout
    assert f"{L}/libcuda.so.{GPU8.driver}" in served.stdout and "Read-only file system" in served.stdout
    assert "No such device" in served.stdout  # OPEN0: the cgroup let it through, no driver behind it
    assert served.stdout == in_process.stdout
    done = assert_served_by_daemon(served)
    (ref,) = in_process.events("hook.done")
    assert done["mounted"] == ref["mounted"] and done["compat"] == ref["compat"]
    assert not in_process.events("daemon.fallback") and "served_by" not in ref
    assert done["client_pid"] > 0 and done["nvhook_pid"] != done["client_pid"]


def test_resident_errors_are_the_hooks_own_line(tmp_path, fixtures_root, daemon_factory):
    d = daemon_factory(fixtures_root / "host-gpu8").start()
    r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "9"}, script="echo STARTED")
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    lines = r.hook_error_lines()
    assert len(lines) == 1 and lines[0].startswith("nvhook: unknown device '9' in NVIDIA_VISIBLE_DEVICES"), lines
    (failed,) = r.events("hook.failed")
    assert failed["served_by"] == "nvhookd"
    # a container that asks for nothing is answered by nvhookd too: the client reads no bundle
    r = d.run(tmp_path / "c2", env={"NVIDIA_VISIBLE_DEVICES": None}, script="echo STARTED")
    assert r.proc.returncode == 0 and "STARTED" in r.stdout
    done = assert_served_by_daemon(r)
    assert done["reason"].startswith("not a GPU container") and done["mounted"] == []



def test_driver_change_is_noticed_by_the_warm_daemon(tmp_path, fixtures_root, daemon_factory):
    """The daemon holds the parsed inventory; each request re-checks it against the host."""
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu1"), str(host)], check=True)
    d = daemon_factory(host)
    d.run(tmp_path / "warm", env={"NVIDIA_VISIBLE_DEVICES": "0"})  # builds the cache (daemon not started yet)
    d.start()
    assert d.events("daemon.start")[0]["inventory_warm"] is True
    r = d.run(tmp_path / "c1", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert not r.events("inventory.built")
    lib = next((host / L.lstrip("/")).glob("libcuda.so.*.*"))
    os.utime(lib, ns=(time.time_ns(), time.time_ns()))  # an upgrade rewrites the files
    r = d.run(tmp_path / "c2", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    (built,) = r.events("inventory.built")
    assert built["served_by"] == "nvhookd"
    r = d.run(tmp_path / "c3", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0 and not r.events("inventory.built")


# -- fallbacks ------------------------------------------------------------------------------------------

def fallback(r: rb.HookRun) -> dict:
    (fb,) = r.events("daemon.fallback")
    starts = r.events("hook.start")
    assert len(starts) == 1 and "served_by" not in starts[0], "the in-process hook ran, once"
    (done,) = r.events("hook.done")
    assert done["result"] == "ok" and "served_by" not in done
    return fb


def start_on_gpu1(tmp: Path, fixtures_root: Path, cached: bool, config_extra: str,
                  gpu: str | None = "0") -> rb.HookRun:
    """`echo STARTED` in a container that asks for `gpu` of host-gpu1, its hook's config ending
    in `config_extra` (the [daemon] table under test)."""
    return rb.run_with_nvhook(tmp, host=fixtures_root / "host-gpu1", env={"NVIDIA_VISIBLE_DEVICES": gpu},
                              script="echo STARTED", config_extra=config_extra, config_cached=cached)


def test_no_socket_runs_in_process_with_a_debug_event(tmp_path, fixtures_root, cached):
    extra = f'log_level = "debug"\n[daemon]\nsocket = "{tmp_path}/none/nvhookd.sock"\n'
    r = start_on_gpu1(tmp_path, fixtures_root, cached, extra)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "absent" and fb["level"] == "debug"
    assert fb["reason"] == "nvhookd not used: its socket does not exist; running in-process"


def test_killed_daemon_leaves_a_socket_nobody_listens_on(tmp_path, fixtures_root, daemon_factory, cached):
    # A connect timeout far above anything a refused connect takes, even on a loaded machine: a
    # client that waited for it (retrying a dead socket) instead of falling back at once fails.
    d = daemon_factory(fixtures_root / "host-gpu1", timeout=30.0).start()
    # daemon.start is logged before the spares are forked: wait for them, they are what is killed
    spares = wait_until(d.children, "nvhookd's spare children (waiting for connections)")
    os.kill(d.proc.pid, signal.SIGKILL)  # the daemon alone: its spares notice and exit
    d.proc.wait(PATIENCE_S)
    wait_until(lambda: not any(os.path.exists(f"/proc/{p}") for p in spares),
               "the spares to exit after the daemon was killed", show=lambda: [p for p in spares if os.path.exists(f"/proc/{p}")])
    assert d.socket.exists()
    r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"}, script="echo STARTED", config_cached=cached)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "not-running" and fb["level"] == "warning"
    assert fb["reason"].endswith("nobody listens on its socket; running in-process"), fb["reason"]
    assert fb["waited_ms"] < 15_000, f"fell back after {fb['waited_ms']} ms: the client waited on a dead socket"
    # a new daemon replaces the stale socket and serves again
    d.start()
    r = d.run(tmp_path / "c2", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert_served_by_daemon(r)


class FakeDaemon:
    """A unix socket server in this (root) test process: `answer(conn, request)` decides."""

    def __init__(self, path: Path, answer):
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.answer = answer
        self.conns: list[socket.socket] = []
        self.requests: list[dict] = []
        self.handled = 0  # connections answer() is done with
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            try:
                req, fds = residentwire.recv(conn, time.monotonic() + 30, time.monotonic, want_fds=True)
                for fd in fds:
                    os.close(fd)
                self.requests.append(req)
                self.answer(conn, req)
            except (OSError, residentwire.ResidentWireError):
                pass
            self.handled += 1

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_hung_daemon_falls_back_within_the_bound(tmp_path, fixtures_root, cached):
    sock = tmp_path / "run" / "nvhookd.sock"
    fake = FakeDaemon(sock, lambda conn, req: None)  # accepts, reads, never answers
    try:
        # a bound long enough that the load of a busy machine is small beside it, so that waiting
        # for it once (the bound) and twice (connect, then again for ready) are told apart
        extra = f'[daemon]\nsocket = "{sock}"\ntimeout = 4\n'
        t = time.monotonic()
        r = start_on_gpu1(tmp_path / "c", fixtures_root, cached, extra)
        took = time.monotonic() - t
    finally:
        fake.close()
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "no-answer" and fb["level"] == "warning"
    assert "no ready within 4 s" in fb["reason"]
    assert 4000 <= fb["waited_ms"] < 7500, f"fell back after {fb['waited_ms']} ms, not at the 4 s bound"
    assert took < 4 + 60
    assert len(fake.requests) == 1 and fake.requests[0]["nvhook"] == __version__


def test_daemon_of_another_version_is_not_used(tmp_path, fixtures_root, cached):
    def old(conn, req):
        residentwire.send(conn, {"ready": True, "v": residentwire.PROTOCOL, "nvhook": "0.0.1"})
        try:  # a client that sends go here would be a bug: record it
            req2, _ = residentwire.recv(conn, time.monotonic() + 2, time.monotonic)
            fake.requests.append(req2)
        except residentwire.ResidentWireError:
            pass

    sock = tmp_path / "run" / "nvhookd.sock"
    fake = FakeDaemon(sock, old)
    try:
        r = start_on_gpu1(tmp_path / "c", fixtures_root, cached, f'[daemon]\nsocket = "{sock}"\ntimeout = 20\n')
        # the fake has read what the client sent after `ready` (nothing: it read end of file)
        wait_until(lambda: fake.handled, "the fake daemon to be done with the connection")
    finally:
        fake.close()
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "version" and fb["daemon_version"] == "0.0.1"
    assert f"nvhookd 0.0.1 (protocol {residentwire.PROTOCOL}) does not match this hook, nvhook {__version__}" in fb["reason"]
    assert "restart nvhookd" in fb["reason"]
    assert [q.get("go") for q in fake.requests] == [None], "no go sent to a daemon of another version"


def test_real_daemon_refuses_a_client_of_another_version(tmp_path, fixtures_root, daemon_factory):
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    s = residentwire.connect(str(d.socket), 5)
    residentwire.send(s, {"v": residentwire.PROTOCOL, "nvhook": "9.9.9", "opts": {}, "state": "{}"})
    answer, _ = residentwire.recv(s, time.monotonic() + 30, time.monotonic)
    s.close()
    assert answer["refused"] == (f"client nvhook 9.9.9 (protocol {residentwire.PROTOCOL}) does not match nvhookd "
                                 f"{__version__} (protocol {residentwire.PROTOCOL})")
    assert answer["nvhook"] == __version__


def test_daemon_dying_after_go_fails_the_start_and_is_not_retried(tmp_path, fixtures_root, cached):
    """A fake that says ready, takes go, then drops the connection: the client must not run
    the hook again in-process (the daemon may have applied part of the plan)."""
    def dies(conn, req):
        residentwire.send(conn, {"ready": True, "v": residentwire.PROTOCOL, "nvhook": __version__})
        go, _ = residentwire.recv(conn, time.monotonic() + 30, time.monotonic)
        fake.requests.append(go)
        conn.close()

    sock = tmp_path / "run" / "nvhookd.sock"
    fake = FakeDaemon(sock, dies)
    try:
        r = start_on_gpu1(tmp_path / "c", fixtures_root, cached, f'[daemon]\nsocket = "{sock}"\ntimeout = 20\n')
    finally:
        fake.close()
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    (line,) = r.hook_error_lines()
    assert line.startswith("nvhook: nvhookd failed while serving this container (connection closed); "
                           "not retried in-process"), line
    assert [q.get("go") for q in fake.requests[1:]] == [True]
    assert not r.events("hook.start") and not r.events("daemon.fallback")
    assert len(r.events("hook.failed")) == 1
    assert os.listdir(r.rootfs / L.lstrip("/")) == [], "nothing was mounted by an in-process retry"


def test_daemon_dying_after_go_still_starts_a_container_that_asks_for_no_gpu(tmp_path, fixtures_root, cached):
    """Every start goes to nvhookd, a container that asks for no GPU included (the client
    reads no bundle). For such a container nvhookd applies nothing, so when it dies after
    `go` the hook answers in-process: a container that asked for no GPU always starts."""
    def dies(conn, req):
        residentwire.send(conn, {"ready": True, "v": residentwire.PROTOCOL, "nvhook": __version__})
        residentwire.recv(conn, time.monotonic() + 30, time.monotonic)
        conn.close()

    sock = tmp_path / "run" / "nvhookd.sock"
    fake = FakeDaemon(sock, dies)
    try:
        r = start_on_gpu1(tmp_path / "c", fixtures_root, cached,
                          f'[daemon]\nmode = "required"\nsocket = "{sock}"\ntimeout = 20\n', gpu=None)
    finally:
        fake.close()
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    assert len(fake.requests) == 1
    fb = fallback(r)
    assert fb["cause"] == "failed" and fb["level"] == "warning"
    assert fb["reason"] == ("nvhookd failed while serving this container (connection closed); the container asks "
                            "for no GPU, so it runs in-process")


def test_real_daemon_killed_mid_request(tmp_path, fixtures_root, daemon_factory):
    """The request child is killed while NVML (slow, 4 s) is asked: the start fails with one
    line, the hook is not run again, and the daemon serves the next container."""
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(host)], check=True)
    conf = next(host.rglob("fake-nvml.conf"))
    conf.write_text(conf.read_text() + "delay 4000\n")
    d = daemon_factory(host, config_extra="[nvml]\ntimeout = 10.0\n").start()
    mig = GPU8.gpus[0].migs[0].uuid
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": mig},
                                                                   script="echo STARTED")))
    t.start()
    # The request child runs the hook only once it has sent `ready`, and the hook forks the NVML
    # query (which sleeps in nvmlInit here): from then on the client gets `ready`, commits, and a
    # dead child is a failed start.
    (child,) = wait_until(d.busy_children, "a request child in nvhookd")
    wait_until(lambda: _children(child), "the request child's NVML query (a child of its own)")
    os.kill(child, signal.SIGKILL)
    t.join(60)
    r = out["r"]
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    (line,) = r.hook_error_lines()
    assert line.startswith("nvhook: nvhookd failed while serving this container (connection "), line
    assert line.endswith("; not retried in-process, since it may have applied part of the driver (see nvhookd's log)")
    assert not r.events("daemon.fallback") and not r.events("hook.done")
    assert all(e.get("served_by") != "nvhookd" for e in r.events("hook.failed"))  # the client's own line
    wait_until(lambda: d.events("daemon.child_failed"), "nvhookd's daemon.child_failed (logged when it reaps the child)")
    (failed,) = d.events("daemon.child_failed")
    assert failed["status"] == -signal.SIGKILL and failed["child_pid"] == child
    conf.write_text(conf.read_text().replace("delay 4000\n", ""))
    r = d.run(tmp_path / "c2", env={"NVIDIA_VISIBLE_DEVICES": "0"}, script="echo STARTED")
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    assert_served_by_daemon(r)


def test_spares_are_replaced_after_the_start_in_flight(tmp_path, fixtures_root, daemon_factory):
    """While a start is in flight nvhookd keeps one spare ready (a second start is not made to
    wait) but forks no more, so that its forks do not take CPU from the start the runtime
    waits for; the second spare comes once the request child has exited."""
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(host)], check=True)
    conf = next(host.rglob("fake-nvml.conf"))
    conf.write_text(conf.read_text() + "delay 5000\n")
    d = daemon_factory(host, config_extra="[nvml]\ntimeout = 20.0\n").start()
    wait_until(lambda: len(d.children()) >= 2, "nvhookd's two spares", show=d.children)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", d.run(
        tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": GPU8.gpus[0].migs[0].uuid})))
    t.start()
    (child,) = wait_until(d.busy_children, "a request child in nvhookd")
    # in flight for the next 5 s: the child's NVML query sleeps in nvmlInit
    wait_until(lambda: _children(child), "the request child's NVML query (a child of its own)")
    time.sleep(0.5)  # time for nvhookd to fork spares it should not
    busy = d.busy_children()
    assert busy == [child] and len(d.children()) == 2, "one spare ready besides the busy child, no more"
    assert _children(child), "the start was no longer in flight when the spares were counted"
    t.join(60)
    assert out["r"].proc.returncode == 0, out["r"].proc.stderr
    wait_until(lambda: len(d.children()) >= 2 and not d.busy_children(), "two spares again after the start",
               show=lambda: (d.children(), d.busy_children()))


def test_mode_required_without_daemon_fails_with_one_line(tmp_path, fixtures_root, cached):
    sock = tmp_path / "none" / "nvhookd.sock"
    extra = f'[daemon]\nmode = "required"\nsocket = "{sock}"\n'
    r = start_on_gpu1(tmp_path / "gpu", fixtures_root, cached, extra)
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert r.hook_error_lines() == [f"nvhook: nvhookd is required ([daemon] mode) but its socket does not exist "
                                    f"(socket {sock})"]
    (failed,) = r.events("hook.failed")
    assert failed["error"].startswith("nvhookd is required") and not r.events("hook.start")
    # a container that asks for no GPU still starts, in-process, with the warning
    r = start_on_gpu1(tmp_path / "nogpu", fixtures_root, cached, extra, gpu=None)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "absent" and fb["level"] == "warning"
    assert fb["reason"] == (f"nvhookd is required ([daemon] mode) but its socket does not exist (socket {sock}); "
                            f"the container asks for no GPU, so it runs in-process")


NOBODY_SERVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(8)
print("LISTENING", flush=True)
conns = []
while True:
    conns.append(s.accept()[0])
"""


def test_a_socket_served_by_another_user_is_not_used(tmp_path, fixtures_root, cached):
    """Whoever serves the socket gets the container's descriptors and decides its exit code:
    the client checks that it is root (SO_PEERCRED) before it sends anything."""
    import shutil
    import tempfile

    sockdir = Path(tempfile.mkdtemp(prefix="nvhookd-test-", dir="/tmp"))  # outside pytest's 0700 tree
    os.chown(sockdir, 65534, 65534)
    sock = sockdir / "nvhookd.sock"
    server = subprocess.Popen([*NOBODY, sys.executable, "-c", NOBODY_SERVER, str(sock)], stdout=subprocess.PIPE,
                              text=True, env={"PATH": "/usr/bin:/bin"})
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "LISTENING"
        r = start_on_gpu1(tmp_path, fixtures_root, cached, f'[daemon]\nsocket = "{sock}"\ntimeout = 20\n')
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(sockdir)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "not-root" and fb["level"] == "warning"
    assert fb["reason"] == "nvhookd not used: its socket is served by uid 65534, not root; running in-process"


def _hook_bundle(tmp: Path, devices: str | None, hook_args: list[str], stderr_to: Path) -> Path:
    rootfs = mf.build_container("container-debian", tmp / "images")
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", {"NVIDIA_VISIBLE_DEVICES": devices}))
    oci["process"]["args"] = ["/bin/true"]
    return rb.nvhook_bundle(tmp / "bundle", oci, hook_args, stderr_to=stderr_to)


def test_a_broken_config_is_reported_while_nvhookd_runs(tmp_path, fixtures_root, daemon_factory):
    """The client uses only a config's cache entry, so a config broken after it was cached
    (a new inode, size or mtime: no entry) is read by nvhook.start.hook and reported as without
    nvhookd, in one line; a container that asks for no GPU still starts, with a warning."""
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    config = tmp_path / "hook.toml"
    good = f'cache_dir = "{d.tmp / "cache"}"\n{d.extra}'
    config.write_text(good)
    args = ["--config", str(config), "--log-file", str(tmp_path / "hook.jsonl"), "--root", str(d.host), "prestart"]
    errs = tmp_path / "stderr"
    gpu = _hook_bundle(tmp_path / "gpu", "0", args, errs)
    nogpu = _hook_bundle(tmp_path / "nogpu", None, args, errs)
    for n in range(2):  # the second start is the client's alone (the first cached the config)
        proc = rb.runc_run(gpu, tmp_path / f"s{n}")
        assert proc.returncode == 0, proc.stderr
        assert rb.read_events(tmp_path / "hook.jsonl")[-1]["served_by"] == "nvhookd"
    config.write_text(good + "log_level = [\n")
    errs.write_text("")
    proc = rb.runc_run(gpu, tmp_path / "s2")
    assert proc.returncode != 0
    (line,) = errs.read_text().splitlines()
    assert line.startswith(f"nvhook: config {config} is not valid TOML"), line
    (failed,) = rb.read_events(tmp_path / "hook.jsonl")[-1:]
    assert failed["event"] == "hook.failed" and "served_by" not in failed
    errs.write_text("")
    proc = rb.runc_run(nogpu, tmp_path / "s3")
    assert proc.returncode == 0, proc.stderr
    assert errs.read_text().startswith(f"nvhook: warning: config {config} is not valid TOML")
    assert "(the container asks for no GPU, so it starts)" in errs.read_text()


def test_an_empty_root_option_is_served_as_the_configs_root(tmp_path, fixtures_root, daemon_factory):
    """`--root=` means the config's root to the in-process hook (pipeline.root_from); the client
    forwarded the empty value, which nvhookd refuses as malformed: a warning on every start, and
    with [daemon] mode "required" a GPU container that failed to start."""
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    config = tmp_path / "hook.toml"
    config.write_text(f'cache_dir = "{d.tmp / "cache"}"\nroot = "{d.host}"\n{d.extra}mode = "required"\n')
    args = ["--config", str(config), "--log-file", str(tmp_path / "hook.jsonl"), "--root=", "prestart"]
    errs = tmp_path / "stderr"
    gpu = _hook_bundle(tmp_path / "gpu", "0", args, errs)
    for n in range(2):  # the second start is the client's alone (the first cached the config)
        proc = rb.runc_run(gpu, tmp_path / f"s{n}")
        assert proc.returncode == 0, errs.read_text()
        last = rb.read_events(tmp_path / "hook.jsonl")[-1]
        assert last["event"] == "hook.done" and last["served_by"] == "nvhookd", last
    assert not d.events("daemon.refused")


# -- security -------------------------------------------------------------------------------------------

NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
CLIENT = """
import sys, time
from nvhook.base import residentwire
try:
    s = residentwire.connect(sys.argv[1], 5)
except OSError as e:
    print("CONNECT", type(e).__name__); raise SystemExit
try:
    residentwire.send(s, {"v": residentwire.PROTOCOL, "nvhook": sys.argv[2], "opts": {}, "state": "{}"})
except OSError:
    pass  # refused before the request was read
try:
    print("ANSWER", residentwire.recv(s, time.monotonic() + 30, time.monotonic)[0])
except residentwire.ResidentWireError as e:
    print("CLOSED", e)
"""


def test_socket_is_root_only_and_a_non_root_peer_is_refused(tmp_path, fixtures_root, daemon_factory):
    import tempfile

    sockdir = Path(tempfile.mkdtemp(prefix="nvhookd-test-", dir="/tmp"))  # outside pytest's 0700 tree
    try:
        _root_only_and_peer_check(daemon_factory(fixtures_root / "host-gpu1", sockdir=sockdir).start())
    finally:
        import shutil

        shutil.rmtree(sockdir)


def _root_only_and_peer_check(d: Daemon) -> None:
    assert stat.S_IMODE(os.stat(d.sockdir).st_mode) == 0o700
    st = os.lstat(d.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    as_nobody = NOBODY + [sys.executable, "-c", CLIENT, str(d.socket), __version__]
    env = {"PYTHONPATH": str(rb.REPO), "PATH": "/usr/bin:/bin"}
    os.chmod(d.sockdir, 0o755)  # the directory lets nobody reach the socket; its mode does not
    out = subprocess.run(as_nobody, capture_output=True, text=True, timeout=30, env=env)
    assert out.stdout.strip() == "CONNECT PermissionError", out
    os.chmod(d.socket, 0o666)  # and with the socket opened up too, SO_PEERCRED still refuses
    out = subprocess.run(as_nobody, capture_output=True, text=True, timeout=30, env=env)
    assert out.stdout.startswith("ANSWER {'refused': 'peer uid 65534 is not root'"), out
    (ev,) = d.events("daemon.refused")
    assert ev["peer_uid"] == 65534 and ev["level"] == "warning"
    # the child that refused exits; nothing else was started
    wait_until(lambda: not d.busy_children(), "the refusing child to exit", show=d.busy_children)


def test_daemon_refuses_an_insecure_socket_directory(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o777)
    os.chmod(run, 0o777)
    cfg = rb.write_nvhook_config(tmp_path / "c.toml", log_file=tmp_path / "log", cache_dir=tmp_path / "cache")
    p = subprocess.run([str(NVHOOKD), "--config", str(cfg), "--socket", str(run / "s.sock")],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert p.stderr == (f"nvhookd: socket directory {run} must be owned by root and writable by root only "
                        f"(owner uid 0, mode 0777)\n")
    assert not (run / "s.sock").exists()


def test_a_second_daemon_does_not_take_over_a_busy_daemons_socket(tmp_path):
    """A listener whose backlog is full fails the second nvhookd's probe with EAGAIN (a timeout
    where connect waits). That used to count as a stale socket, unlinked and replaced under the
    live daemon; it is refused now and the socket stays."""
    import socket

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "s.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(0)
    queued = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    queued.connect(str(path))  # fills the backlog of 0: the next connect() waits
    cfg = rb.write_nvhook_config(tmp_path / "c.toml", log_file=tmp_path / "log", cache_dir=tmp_path / "cache")
    try:
        ino = os.stat(path).st_ino
        try:
            p = subprocess.run([str(NVHOOKD), "--config", str(cfg), "--socket", str(path)],
                               capture_output=True, text=True, timeout=PATIENCE_S)
        except subprocess.TimeoutExpired:
            pytest.fail("nvhookd replaced the busy daemon's socket and served on it")
        assert p.returncode == 1
        assert p.stderr == f"nvhookd: another nvhookd listens on {path}, its backlog full; not replacing it\n"
        assert os.stat(path).st_ino == ino
    finally:
        queued.close()
        live.close()


def test_a_second_daemon_does_not_take_over_the_socket(tmp_path, fixtures_root, daemon_factory):
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    p = subprocess.run([str(NVHOOKD), "--config", str(d.config), "--log-file", str(tmp_path / "second.jsonl")],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and p.stderr == f"nvhookd: another nvhookd already listens on {d.socket}\n"
    r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert_served_by_daemon(r)
    # a file that is not a socket is never replaced
    d.stop()
    assert not d.socket.exists(), "a stopped nvhookd removes the socket it created"
    assert d.events("daemon.stop")
    d.socket.write_text("not a socket")
    p = subprocess.run([str(NVHOOKD), "--config", str(d.config), "--log-file", str(tmp_path / "third.jsonl")],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and p.stderr == f"nvhookd: {d.socket} exists and is not a socket; not replacing it\n"
    assert d.socket.read_text() == "not a socket"


def test_malformed_requests_get_one_line_and_the_daemon_goes_on(tmp_path, fixtures_root, daemon_factory):
    d = daemon_factory(fixtures_root / "host-gpu1").start()

    def raw(data: bytes, fds: tuple = ()) -> dict:
        s = residentwire.connect(str(d.socket), 5)
        if fds:
            s.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(f.to_bytes(4, sys.byteorder)
                                                                                for f in fds))])
        else:
            s.sendall(data)
        try:
            return residentwire.recv(s, time.monotonic() + 10, time.monotonic)[0]
        finally:
            s.close()

    def msg(obj: dict) -> bytes:
        return residentwire.encode(obj)

    ok = {"v": residentwire.PROTOCOL, "nvhook": __version__, "opts": {}, "state": "{}"}
    assert raw(b"\x00\x00\x00\x05hello")["refused"].startswith("malformed request: message is not JSON")
    assert raw((1 << 30).to_bytes(4, "big"))["refused"] == (
        f"malformed request: message of {1 << 30} bytes is over the limit of {residentwire.MAX_MESSAGE}")
    assert raw(msg(dict(ok, opts={"root": 5})))["refused"] == "malformed request: option root has a bad value"
    assert raw(msg(dict(ok, opts={"evil": "x"})))["refused"] == "malformed request: unknown option 'evil'"
    assert raw(msg(dict(ok, opts={"stage": "poststop"})))["refused"] == "malformed request: unknown stage"
    assert raw(msg(ok))["refused"] == "malformed request: 0 descriptors, expected 4"
    with open("/dev/null", "rb") as f:
        fds = (f.fileno(),) * 4
        assert raw(msg(ok), fds)["refused"].startswith("the client runs in another mnt namespace")
    mine = [os.open(f"/proc/self/ns/{n}", os.O_RDONLY) for n in ("mnt", "pid", "cgroup")]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        other = os.pidfd_open(os.getpid())  # names this process, not the state's
        state = json.dumps({"ociVersion": "1.0.2", "id": "x", "pid": sleeper.pid, "bundle": "/nonexistent"})
        answer = raw(msg(dict(ok, state=state)), (other, *mine))
        assert answer["refused"] == (f"the container process {sleeper.pid} is not the process the client named "
                                     f"(pid {os.getpid()} in nvhookd's pid namespace)")
        relative = json.dumps({"id": "x", "pid": sleeper.pid, "bundle": "bundle"})  # the daemon's cwd is not runc's
        answer = raw(msg(dict(ok, state=relative)), (other, *mine))
        assert answer["refused"] == "the OCI state has no pid or no absolute bundle path"
    finally:
        sleeper.kill()
        sleeper.wait()
        for fd in (*mine, other):
            os.close(fd)
    refused = d.events("daemon.refused")
    assert len(refused) == 9 and all(e["level"] == "warning" for e in refused)
    r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert_served_by_daemon(r)


def _mounts_of(pid: int, rootfs: Path) -> list[str]:
    return [ln.split()[4] for ln in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(str(rootfs))]


def _gpu0_bundle_and_target(tmp_path: Path):
    """The image rootfs and a bundle asking for GPU 0, a real process in its own mount namespace to stand for its
    container, and this process's mnt/pid/cgroup namespace fds (what the client sends)."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", {"NVIDIA_VISIBLE_DEVICES": "0"}))
    (bundle / "config.json").write_text(json.dumps(oci))
    target = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"])
    mine = [os.open(f"/proc/self/ns/{n}", os.O_RDONLY) for n in ("mnt", "pid", "cgroup")]
    return rootfs, bundle, target, mine


def _wait_in_own_namespace(target: subprocess.Popen) -> None:
    """Until unshare has exec'ed sleep, in its new mount namespace."""
    def there() -> bool:
        try:
            return Path(f"/proc/{target.pid}/cmdline").read_bytes().startswith(b"sleep\0")
        except OSError:
            return False
    wait_until(there, "the target process (unshare, then sleep, in a mount namespace of its own)")


@pytest.mark.parametrize("client", ["leaves-before-go", "sends-go"])
def test_nothing_is_applied_without_go(tmp_path, fixtures_root, daemon_factory, client):
    """A client that got `ready` but leaves without `go` (what one past its timeout does, as it
    falls back in-process) gets nothing applied: the target is a real process in its own mount
    namespace, whose mount table shows what nvhookd did; with `go`, the driver is there."""
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    rootfs, bundle, target, mine = _gpu0_bundle_and_target(tmp_path)
    try:
        _wait_in_own_namespace(target)
        pidfd = os.pidfd_open(target.pid)
        state = json.dumps({"ociVersion": "1.0.2", "id": "nogo", "pid": target.pid, "bundle": str(bundle)})
        s = residentwire.connect(str(d.socket), 5)
        opts = {"config": str(d.config), "root": str(d.host)}
        residentwire.send(s, {"v": residentwire.PROTOCOL, "nvhook": __version__, "opts": opts, "state": state}, [pidfd, *mine])
        answer, _ = residentwire.recv(s, time.monotonic() + 30, time.monotonic)
        assert answer["ready"] is True
        if client == "sends-go":
            residentwire.send(s, {"go": True})
            result, _ = residentwire.recv(s, time.monotonic() + 30, time.monotonic)
            assert result == {"code": 0, "stderr": ""}
            assert f"{rootfs}{L}/libcuda.so.{mf.HOSTS['host-gpu1'].driver}" in _mounts_of(target.pid, rootfs)
            return
        s.close()
        wait_until(lambda: d.events("daemon.abandoned"), "nvhookd's daemon.abandoned event")
        (ev,) = d.events("daemon.abandoned")
        assert "nothing was applied" in ev["reason"]
        assert _mounts_of(target.pid, rootfs) == []
        evs = rb.read_events(d.tmp / "nvhook.jsonl")
        assert [e["event"] for e in evs if e["event"].startswith(("apply", "mount", "hook.done", "hook.failed"))] == []
        assert any(e["event"] == "plan" for e in evs)  # it had decided, while waiting for go
    finally:
        target.kill()
        target.wait()
        for fd in mine:
            os.close(fd)


UNSHARED_CLIENT = """
import ctypes, json, os, sys, time
from nvhook import __version__
from nvhook.base import residentwire
mine = [os.open(f"/proc/self/ns/{n}", os.O_RDONLY) for n in ("mnt", "pid", "cgroup")]  # the host's
assert ctypes.CDLL(None, use_errno=True).unshare(0x00020000) == 0  # CLONE_NEWNS: now elsewhere
s = residentwire.connect(sys.argv[1], 5)
state = json.dumps({"id": "x", "pid": os.getpid(), "bundle": "/nonexistent"})
residentwire.send(s, {"v": residentwire.PROTOCOL, "nvhook": __version__, "opts": {}, "state": state},
          [os.pidfd_open(os.getpid()), *mine])
print(json.dumps(residentwire.recv(s, time.monotonic() + 30, time.monotonic)[0]))
"""


def test_a_client_in_another_mount_namespace_is_refused_whatever_fds_it_sends(tmp_path, fixtures_root,
                                                                              daemon_factory):
    """Root in another mount namespace that reaches the socket (a container given the host's
    /run) and sends namespace descriptors it opened in the host's: nvhookd checks the connected
    process itself (SO_PEERCRED), so this is refused before anything is observed."""
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    p = subprocess.run([sys.executable, "-c", UNSHARED_CLIENT, str(d.socket)], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert answer.get("refused") == ("the client runs in another mnt namespace than nvhookd (run nvhookd in the "
                                     "host's namespaces, like the container runtime)"), answer


def test_no_host_node_is_made_without_go(tmp_path, fixtures_root, daemon_factory):
    """devices.create_missing_nodes changes the host while deciding. For a client that got
    `ready` but left without `go` (it falls back and runs the hook itself), nvhookd made the
    host's nvidia-uvm nodes anyway, before the gate; now the first node waits for `go`."""
    host = tmp_path / "hosts" / "host-gpu1"
    host.parent.mkdir()
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu1"), str(host.parent)], check=True)
    for name in ("nvidia-uvm", "nvidia-uvm-tools"):
        (host / "dev" / name).unlink()
    d = daemon_factory(host, config_extra="[devices]\ncreate_missing_nodes = true\n").start()
    rootfs, bundle, target, mine = _gpu0_bundle_and_target(tmp_path)
    try:
        _wait_in_own_namespace(target)
        state = json.dumps({"ociVersion": "1.0.2", "id": "nogo", "pid": target.pid, "bundle": str(bundle)})
        s = residentwire.connect(str(d.socket), 5)
        opts = {"config": str(d.config), "root": str(d.host)}
        residentwire.send(s, {"v": residentwire.PROTOCOL, "nvhook": __version__, "opts": opts, "state": state},
                  [os.pidfd_open(target.pid), *mine])
        assert residentwire.recv(s, time.monotonic() + 30, time.monotonic)[0]["ready"] is True
        s.close()
        wait_until(lambda: d.events("daemon.abandoned"), "nvhookd's daemon.abandoned event")
        assert not (host / "dev/nvidia-uvm").exists() and not (host / "dev/nvidia-uvm-tools").exists()
        # with go, the same request makes them
        r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"})
        assert r.proc.returncode == 0, r.proc.stderr
        assert_served_by_daemon(r)
        assert stat.S_ISCHR(os.lstat(host / "dev/nvidia-uvm").st_mode)
    finally:
        target.kill()
        target.wait()
        for fd in mine:
            os.close(fd)


def test_daemon_in_another_pid_namespace_is_not_used(tmp_path, fixtures_root, daemon_factory, cached):
    d = daemon_factory(fixtures_root / "host-gpu1").start(prefix=("unshare", "--pid", "--fork"))
    r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"}, script="echo STARTED", config_cached=cached)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    fb = fallback(r)
    assert fb["cause"] == "refused"
    assert "the client runs in another pid namespace than nvhookd" in fb["reason"]


# -- the shipped systemd units --------------------------------------------------------------------------

UNITS = rb.REPO / "packaging" / "systemd"


def test_systemd_units_verify(tmp_path):
    import shutil

    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    # verify needs ExecStart's binary to exist: point the copies at this checkout's nvhookd
    for name in ("nvhookd.socket", "nvhookd.service"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/nvhookd", str(NVHOOKD))
        (tmp_path / name).write_text(text)
    units = [str(tmp_path / "nvhookd.socket"), str(tmp_path / "nvhookd.service")]
    p = subprocess.run(["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "nvhookd" in ln]
    assert p.returncode == 0 and not problems, p.stdout + p.stderr
    socket_unit = (UNITS / "nvhookd.socket").read_text()
    assert "ListenStream=/run/nvhook/nvhookd.sock" in socket_unit and "SocketMode=0600" in socket_unit
    service = (UNITS / "nvhookd.service").read_text()
    for forbidden in ("PrivateTmp", "ProtectSystem", "PrivatePIDs", "PrivateMounts", "PrivateDevices"):
        assert forbidden not in service.split("#")[0]


def test_systemd_socket_activation(tmp_path, fixtures_root):
    """nvhookd takes the listening socket systemd passes (LISTEN_FDS): systemd-socket-activate
    plays systemd's part."""
    import shutil

    if not shutil.which("systemd-socket-activate"):
        pytest.skip("systemd-socket-activate is not installed")
    # the first start waits for nvhookd's own start (imports, warm-up): a loaded CI VM needs more than 1 s
    d = Daemon(tmp_path / "d", fixtures_root / "host-gpu1", timeout=10.0)
    try:
        # it starts nvhookd on the first connection, as systemd does
        d.start(prefix=("systemd-socket-activate", "-l", str(d.socket)), wait=False)
        wait_until(d.socket.exists, "systemd-socket-activate's socket")
        assert not d.events("daemon.start")
        r = d.run(tmp_path / "c", env={"NVIDIA_VISIBLE_DEVICES": "0"})
        assert r.proc.returncode == 0, r.proc.stderr
        assert d.events("daemon.start")[0]["socket"] == f"systemd:{d.socket}"
        assert_served_by_daemon(r)
    finally:
        d.stop()


# -- the client's own cost ------------------------------------------------------------------------------

# What a start nvhookd serves imports of nvhook: the client, the config's cache entry, the wire.
CLIENT_MODULES = {"nvhook", "nvhook.entry", "nvhook.start", "nvhook.start.client", "nvhook.base", "nvhook.base.config", "nvhook.base.errors",
                  "nvhook.base.jsonfast", "nvhook.base.residentwire",
                  "nvhook.base.modbundle"}  # the launcher's finder, which serves the others


@pytest.mark.parametrize("devices", ["0", None], ids=["gpu", "no-gpu"])
def test_client_imports_only_the_client(tmp_path, fixtures_root, daemon_factory, devices):
    """Python's import log of the hook served by nvhookd, through runc: of nvhook only the
    client, the config and the wire (not nvhook.start.hook, the log, observe, decide or apply: the
    request and the bundle are the daemon's to read, a container that asks for no GPU
    included); nothing test_e2e_runc.NOT_ON_START_PATH lists, not even `socket` (it imports
    enum)."""
    from test_e2e_runc import NOT_ON_START_PATH

    d = daemon_factory(fixtures_root / "host-gpu1").start()
    errs = tmp_path / "stderr"
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=tmp_path / "nvhook.jsonl",
                                    cache_dir=d.tmp / "cache", extra=d.extra)
    oci = mf.oci_config(str(rootfs), rb.image_env("container-debian", {"NVIDIA_VISIBLE_DEVICES": devices}))
    oci["process"]["args"] = ["/bin/true"]
    bundle = rb.nvhook_bundle(tmp_path / "bundle", oci, ["--config", str(config), "--root", str(d.host), "prestart"],
                              stderr_to=errs)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["hooks"]["prestart"][0]["env"] = ["PATH=/usr/bin:/bin", "PYTHONPROFILEIMPORTTIME=1",
                                          f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    for n in range(2):  # the first start reads the config file and caches it (nvhook.start.hook)
        errs.write_text("")
        proc = rb.runc_run(bundle, tmp_path / f"state{n}")
        assert proc.returncode == 0, proc.stderr
        imported = {ln.split("|")[-1].strip() for ln in errs.read_text().splitlines()
                    if ln.startswith("import time:")}
        assert "nvhook.start.client" in imported  # the log is real
        (done,) = rb.read_events(tmp_path / "nvhook.jsonl")[-1:]
        assert done["event"] == "hook.done" and done["served_by"] == "nvhookd"
        assert done["result"] == "ok" and (done["mounted"] != []) == (devices is not None)
    assert {m for m in imported if m.split(".")[0] == "nvhook"} == CLIENT_MODULES
    assert {m for m in imported if m.split(".")[0] in NOT_ON_START_PATH | {"socket", "selectors"}} == set()


def test_client_level_names_are_the_logs():
    """nvhook/start/client.py parses --log-level without importing base.log."""
    from nvhook.base.log import LEVELS
    from nvhook.start import client

    assert client.LEVEL_NAMES == tuple(LEVELS)


def test_a_request_imports_nothing_in_nvhookd(tmp_path, fixtures_root, daemon_factory):
    """nvhookd imports every module a start runs before it forks its spares (and they their
    apply workers): Python's import log of the daemon and all its children shows no import
    while it serves GPU, MIG (NVML facts cached), no-GPU and failing containers."""
    host = fixtures_root / "host-gpu8"
    d = daemon_factory(host)
    mig = GPU8.gpus[0].migs[0].uuid
    cases = [({"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "all"}, 0),
             ({"NVIDIA_VISIBLE_DEVICES": mig}, 0), ({"NVIDIA_VISIBLE_DEVICES": None}, 0),
             ({"NVIDIA_VISIBLE_DEVICES": "9"}, 1)]
    for k, (env, _) in enumerate(cases[:2]):  # in-process (no daemon yet): the inventory and NVML facts cached
        assert d.run(tmp_path / f"warm{k}", env=env).proc.returncode == 0
    err = tmp_path / "nvhookd.stderr"
    with open(err, "wb") as f:
        d.start(prefix=(sys.executable, "-X", "importtime"), stderr=f)
    warmed = err.stat().st_size
    assert "nvhook.observe.host.inventory" in err.read_text()  # the log is real
    for k, (env, code) in enumerate(cases):
        r = d.run(tmp_path / f"c{k}", env=env)
        assert (r.proc.returncode != 0) == bool(code), r.proc.stderr
        assert {e.get("served_by") for e in r.events()} == {"nvhookd"}
    # once idle the daemon reaps its children and refreshes (imports, if anything, happen there)
    wait_until(lambda: len(d.children()) >= 2 and not d.busy_children(), "nvhookd idle again, with two spares",
               show=lambda: (d.children(), d.busy_children()))
    assert err.read_bytes()[warmed:].decode() == ""


def test_upgraded_code_makes_the_daemon_execute_itself_again(tmp_path, fixtures_root, daemon_factory):
    """A package upgrade under a running nvhookd (here: a source file's mtime changes) must not
    leave containers served by the old code: the daemon finishes what is in flight and
    re-executes itself on the same socket."""
    import nvhook.base.residentwire as w

    d = daemon_factory(fixtures_root / "host-gpu1").start()
    r = d.run(tmp_path / "c1", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    first = assert_served_by_daemon(r)
    src = Path(w.__file__)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        wait_until(lambda: len(d.events("daemon.start")) >= 2, "a second daemon.start (nvhookd re-executed)",
                   show=lambda: [e["event"] for e in d.events()])
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    (reexec,) = d.events("daemon.reexec")
    # the daemon names the file as its own import saw it (a strict editable install reaches
    # the source through a link in build/): the same file
    assert len(reexec["changed"]) == 1 and os.path.samefile(reexec["changed"][0], src)
    again = d.events("daemon.start")[1]
    assert again["pid"] == d.proc.pid and again["socket"] == f"reexec:{d.socket}"
    r = d.run(tmp_path / "c2", env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    assert assert_served_by_daemon(r)["nvhook_pid"] != first["nvhook_pid"]


def test_mode_off_never_uses_a_running_daemon(tmp_path, fixtures_root, daemon_factory, cached):
    d = daemon_factory(fixtures_root / "host-gpu1").start()
    r = rb.run_with_nvhook(tmp_path / "c", host=d.host, env={"NVIDIA_VISIBLE_DEVICES": "0"},
                           config_extra=d.extra.replace("[daemon]\n", '[daemon]\nmode = "off"\n'), config_cached=cached)
    assert r.proc.returncode == 0, r.proc.stderr
    (done,) = r.events("hook.done")
    assert "served_by" not in done and not r.events("daemon.fallback")


@pytest.mark.parametrize("text, message", [
    ('[daemon]\nmode = "sometimes"\n', "daemon.mode must be one of auto, off, required, not 'sometimes'"),
    ('[daemon]\nsocket = "run/nvhookd.sock"\n', "daemon.socket must be an absolute path, not 'run/nvhookd.sock'"),
    ('[daemon]\ntimeout = 0\n', "daemon.timeout must be between 0 and 600 seconds, not 0"),
    ('[daemon]\nport = 1\n', "unknown key 'daemon.port'; did you mean 'daemon.socket'?"),
])
def test_daemon_config_errors_are_one_line(tmp_path, text, message):
    from nvhook.base import config
    from nvhook.base.errors import HookError

    path = tmp_path / "hook.toml"
    path.write_text(f'cache_dir = ""\n{text}')
    with pytest.raises(HookError) as e:
        config.load(str(path), explicit=True)
    assert e.value.message == f"config {path}: {message}"


def test_wrong_root_in_nvhookds_child_stops_only_gpu_containers(tmp_path, fixtures_root, daemon_factory):
    """nvhookd serves the start (its request child runs the hook with the client's options):
    a root that is not a directory refuses a GPU container with one line, and a container that
    asks for no GPU still starts, with the warning logged by nvhookd's child (issue 23)."""
    d = daemon_factory(fixtures_root / "host-gpu8").start()
    wrong = Path("/wrong-root-for-nvhook-tests")
    r = d.run(tmp_path / "plain", host=wrong, env={"NVIDIA_VISIBLE_DEVICES": "void"}, script="echo STARTED")
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    (warned,) = r.events("root.unusable")
    assert warned["served_by"] == "nvhookd" and f"host root {wrong} isn't a directory" in warned["error"]
    assert warned["key"] == "--root"
    r = d.run(tmp_path / "gpu", host=wrong, env={"NVIDIA_VISIBLE_DEVICES": "0"}, script="echo STARTED")
    assert r.proc.returncode != 0 and "STARTED" not in r.stdout
    assert r.hook_error_lines() == [f"nvhook: host root {wrong} isn't a directory"]
    (failed,) = r.events("hook.failed")
    assert failed["served_by"] == "nvhookd"
