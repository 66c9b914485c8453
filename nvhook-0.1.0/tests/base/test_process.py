"""base.process, the one place nvhook forks, waits, kills and reaps: with real processes.

The callers' own fault tests (a hung NVML, a killed apply worker, an ldconfig past its timeout:
tests/test_faults.py, test_apply_units.py, test_apply_runc.py) cover what users see; these pin
the helper's contract that those rely on.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from nvhook.base import process


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def _fork(body) -> tuple[int, int]:
    """A child running body(w) with the write end of a pipe; (pid, read end)."""
    pid, ((r, w),) = process.fork_with_pipes(1)
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            body(w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def test_read_until_eof_collects_everything_and_reaps():
    def body(w):
        for i in range(50):
            os.write(w, b"x" * 4096 + str(i).encode())

    pid, r = _fork(body)
    got: list[bytes] = []
    assert process.read_until_eof(r, process.deadline(5), got.append) is True
    os.close(r)
    assert len(b"".join(got)) == 50 * 4096 + sum(len(str(i)) for i in range(50))
    assert process.reap(pid) == 0
    assert process.reap(pid) is None  # reaped once; a second waitpid finds no child


def test_read_until_eof_gives_up_at_the_deadline_and_kill_and_reap_stops_it():
    pid, r = _fork(lambda w: time.sleep(60))
    t = time.monotonic()
    assert process.read_until_eof(r, process.deadline(0.2), lambda d: None) is False
    took = time.monotonic() - t
    assert 0.15 < took < 30, f"gave up after {took:.1f} s, not at the 0.2 s deadline (the child sleeps 60 s)"
    process.kill_and_reap(pid)
    os.close(r)
    assert not os.path.exists(f"/proc/{pid}") or _state(pid) != "Z"


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_read_until_exit_does_not_wait_for_a_descendant_holding_the_pipe():
    """ldconfig's case: the program exits, something it started keeps the pipe open."""
    def body(w):
        gpid = os.fork()
        if gpid == 0:  # the descendant: holds w until the test kills it
            time.sleep(30)
            os._exit(0)
        os.write(w, f"started {gpid}\n".encode())
        os._exit(3)

    pid, r = _fork(body)
    out = bytearray()
    t = time.monotonic()
    status = process.read_until_exit(pid, r, process.deadline(10), out.extend)
    os.close(r)
    assert status is not None and os.waitstatus_to_exitcode(status) == 3
    assert time.monotonic() - t < 5
    word, gpid = bytes(out).decode().split()
    assert word == "started"
    process.kill(int(gpid))  # not our child (reparented): killed, reaped by init


def test_read_until_exit_returns_none_at_the_deadline_unreaped():
    pid, r = _fork(lambda w: time.sleep(60))
    assert process.read_until_exit(pid, r, process.deadline(0.2), lambda d: None) is None
    assert _state(pid) in ("S", "R")  # still the caller's to kill
    process.kill(pid)
    assert process.reap(pid) == -9
    os.close(r)


def test_kill_group_reaches_what_the_child_started():
    def body(w):
        os.setpgid(0, 0)
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        os.write(w, b"ready")
        time.sleep(60)

    pid, r = _fork(body)
    assert os.read(r, 5) == b"ready"
    process.kill_and_reap(pid, group=True)
    # the grandchild, in the killed group, closes its copy of the pipe when it dies
    assert process.read_until_eof(r, process.deadline(5), lambda d: None) is True
    os.close(r)


def test_kill_of_a_process_already_gone_is_quiet():
    pid, r = _fork(lambda w: None)
    assert process.read_until_eof(r, process.deadline(5), lambda d: None) is True
    os.close(r)
    assert process.reap(pid) == 0
    process.kill_and_reap(pid)  # nothing left to kill or reap: no exception


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to uid 65534 to fail fork(2) with RLIMIT_NPROC")
def test_a_failed_fork_leaves_no_pipe_open():
    """EAGAIN under a pids limit is what the hook meets in a crowded cgroup: here RLIMIT_NPROC
    in a child whose user already has more processes, so fork(2) itself fails."""
    code = (
        "import os, resource\n"
        "from nvhook.base import process\n"
        "before = set(os.listdir('/proc/self/fd'))\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))\n"
        "try:\n"
        "    process.fork_with_pipes(2)\n"
        "except OSError as e:\n"
        "    print('failed', e.errno)\n"
        "print(sorted(set(os.listdir('/proc/self/fd')) - before))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("failed ")
    assert lines[1] == "[]"


def test_pipe_failure_closes_the_pipes_made_so_far():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = _open_fds()
    free = [fd for fd in range(max(before) + 4) if fd not in before]
    # room for exactly one more pipe (the two lowest free numbers): the second of three fails
    resource.setrlimit(resource.RLIMIT_NOFILE, (free[2], hard))
    try:
        try:
            process.fork_with_pipes(3)
        except OSError as e:
            assert e.errno == 24  # EMFILE
        else:  # pragma: no cover
            raise AssertionError("fork_with_pipes(3) should have run out of fds")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert _open_fds() == before
