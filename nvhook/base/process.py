"""Child processes with a deadline: where nvhook forks, waits, kills and reaps.

Three steps run work in a forked child: the NVML query (`observe.host.nvml`: a wedged driver
must not hang the hook), the apply worker (`apply`: setns needs a single-threaded process) and
the optional ldconfig program (`apply.ldconfig`). Each needs the same care, kept here once:

- `fork_with_pipes(n)`: pipe(2) n times, then fork(2); if either fails, nothing is left open.
- `die_with_parent(parent)` (in the child): prctl(PR_SET_PDEATHSIG, SIGKILL), then exit if the
  parent died before that took effect. A runtime that kills the hook on its own timeout kills
  the hook's children with it.
- `deadline(s)`, then `read_until_eof` (poll(2) + read(2) until the writer closes its end) or
  `read_until_exit` (for a program whose descendants may keep the pipe open: until the process
  itself exits, watched through pidfd_open(2)); both give up at the deadline.
- `kill(pid, group=)`: kill(2) / killpg(2) with SIGKILL; a process already gone is fine.
- `reap(pid)`: waitpid(2), the exit code as os.waitstatus_to_exitcode gives it.

The caller keeps what differs: what runs in the child, and what the bytes it sends mean.
`records_within(work, s)` is the whole pattern for work that only looks at files (the operator
commands' checks of paths that may lie on a network mount). This
module is on the container-start path (the apply worker): it imports os and time only, and the
syscall layer (`sandbox`) only in a child that arms its parent-death signal.
"""

from __future__ import annotations

import os
import time

from .waiting import readable

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Callable

SIGKILL = 9  # the signal module is not worth its import on the start path
_CHUNK = 1 << 16
# Whether this process has forked (through fork_with_pipes): only then is there a child whose
# CPU time and peak memory the hook's summary must include (main._usage).
forked = False


def fork_with_pipes(n: int) -> tuple[int, list[tuple[int, int]]]:
    """(pid from fork(2), n (read, write) pipes), in both processes. Raises OSError (EMFILE,
    EAGAIN under a pids limit) with every pipe closed again."""
    pipes: list[tuple[int, int]] = []
    try:
        for _ in range(n):
            pipes.append(os.pipe())
        global forked
        forked = True
        return os.fork(), pipes
    except OSError:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        raise


def exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited (while it lives, its pid is its own:
    what was read from /proc/<pid> before this says False was that process's)."""
    import select

    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def die_with_parent(parent: int) -> None:
    """In a forked child: SIGKILL when `parent` (the hook) dies; exit now if it already has."""
    from .sandbox import SIGKILL as _SIGKILL
    from .sandbox import set_pdeathsig

    set_pdeathsig(_SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def deadline(seconds: float) -> float:
    """The monotonic time `seconds` from now, for read_until_eof/read_until_exit."""
    return time.monotonic() + seconds


def read_until_eof(fd: int, until: float, sink: Callable[[bytes], object]) -> bool:
    """Hand what `fd` delivers to `sink` until its writer closes it (True) or the deadline
    `until` passes (False: the caller kills the writer)."""
    while True:
        remaining = until - time.monotonic()
        if remaining <= 0 or not readable([fd], remaining):
            return False
        data = os.read(fd, _CHUNK)
        if not data:
            return True
        sink(data)


def read_until_exit(pid: int, fd: int, until: float, sink: Callable[[bytes], object],
                    drain_max: int = 1 << 20) -> int | None:
    """Hand what `fd` delivers to `sink` until the child `pid` exits; reap it and return its
    wait status, or None at the deadline `until` (not reaped: the caller kills it).

    A program's descendants can hold the pipe open after it exits, so its exit is watched
    (pidfd_open(2), or waitpid(WNOHANG) every 2 ms on kernels before 5.3) rather than EOF. What
    it wrote before exiting is still drained, at most `drain_max` bytes: a descendant that keeps
    writing cannot hold the caller."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1
    eof = False
    try:
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return None
            watch = ([] if eof else [fd]) + ([pidfd] if pidfd >= 0 else [])
            if not watch:  # output closed and no pidfd: poll the exit status
                wpid, status = os.waitpid(pid, os.WNOHANG)
                if wpid:
                    return status
                time.sleep(min(0.002, remaining))
                continue
            ready = readable(watch, remaining)
            if fd in ready:
                data = os.read(fd, _CHUNK)
                if data:
                    sink(data)
                else:
                    eof = True
            if pidfd in ready:
                _, status = os.waitpid(pid, 0)
                if not eof:
                    _drain(fd, sink, drain_max)
                return status
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _drain(fd: int, sink: Callable[[bytes], object], limit: int) -> None:
    os.set_blocking(fd, False)
    try:
        while limit > 0:
            data = os.read(fd, _CHUNK)
            if not data:
                return
            sink(data)
            limit -= len(data)
    except BlockingIOError:
        pass


def kill(pid: int, *, group: bool = False) -> None:
    """SIGKILL `pid` (and first its process group, when it made itself a group leader)."""
    if group:
        try:
            os.killpg(pid, SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.kill(pid, SIGKILL)
    except ProcessLookupError:
        pass


def reap(pid: int) -> int | None:
    """waitpid(2) for the child `pid`: its exit code (negative: the signal that killed it), or
    None when it was reaped already."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status)


def kill_and_reap(pid: int, *, group: bool = False) -> None:
    """Stop a child for good: SIGKILL, then waitpid so that no zombie is left."""
    kill(pid, group=group)
    reap(pid)


def records_within(work: Callable[[Callable[[bytes], None]], None], seconds: float) -> tuple[list[bytes], bool]:
    """Run `work(send)` in a forked child given `seconds`: the records it sent (`send(rec)`,
    no NUL in one) and whether it finished. A child still at work at the deadline is most
    likely waiting in the kernel on a file system whose server does not answer (a hard NFS
    mount), where no signal handler runs and a thread could not be stopped, and where even
    SIGKILL may take effect only once the wait ends: it is killed and not waited for. It holds
    nothing of the caller's open but its end of the pipe (stdin, stdout and stderr are
    /dev/null in it): a caller that reads our output to its end is not held by it."""
    parent = os.getpid()
    pid, [(r, w)] = fork_with_pipes(1)
    if pid == 0:
        code = 1
        try:
            os.close(r)
            _quiet_child(parent, w)
            work(lambda rec: _send(w, rec))
            code = 0
        except BaseException as e:  # said to the parent: a child that failed found nothing
            try:
                _send(w, FAILED + f"{type(e).__name__}: {e}".encode(errors="replace"))
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(w)
    got = bytearray()
    try:
        done = read_until_eof(r, deadline(seconds), got.extend)
    finally:
        os.close(r)
    records = bytes(got).split(b"\0")[:-1]
    if not done:
        kill(pid)
        return records, False
    status = reap(pid)
    if status or (records and records[-1].startswith(FAILED)):
        from .errors import HookError

        why = records[-1][len(FAILED):].decode(errors="replace") if records and records[-1].startswith(FAILED) \
            else f"exit status {status}"
        raise HookError(f"the look at the files, in a child process, failed ({why}): nothing was checked")
    return records, True


# The record a failed child's work ends with (no record `work` sends starts with a NUL-free
# 0xff byte and this word: records are paths and lines, which never do).
FAILED = b"\xffFAILED:"


def _send(w: int, rec: bytes) -> None:
    data = rec.replace(b"\0", b"?") + b"\0"
    while data:
        data = data[os.write(w, data):]


def _quiet_child(parent: int, keep: int) -> None:
    die_with_parent(parent)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        fds = [int(f) for f in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: the three above are the ones a caller reads
        fds = []
    for fd in fds:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
