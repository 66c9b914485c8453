"""Issue 9 at the level of the code that does the work: each test puts a link, a FIFO, a
foreign owner or a huge input exactly where an attacker would, at the worst moment (the
interleaving a racing second container would need to win), and checks that nvhook neither
follows, opens, trusts nor spends seconds on it. The real-container tests of the same classes
are in tests/test_e2e_security.py."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from waiting import cpu_seconds, wait_until

from nvhook.apply import mounts
from nvhook.apply.mounts import Mounter, Options, PlannedNode, Source
from nvhook.apply.paths import Root
from nvhook.base import config as config_mod
from nvhook.base.errors import HookError, clean
from nvhook.base.log import EventLog, stderr_line
from nvhook.decide import request as request_mod
from nvhook.decide import requirements
from nvhook.observe.host import cache as inv_cache
from nvhook.observe.host import elf

REPO = Path(__file__).resolve().parent.parent

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, chown, mounts)")


class _Log:
    level = 20

    def __init__(self):
        self.events: list[tuple] = []

    def __getattr__(self, level):
        return lambda name, **f: self.events.append((level, name, f))


def _root(path: Path) -> Root:
    return Root(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))


# -- item 3: device nodes -------------------------------------------------------------------

@needs_root
def test_device_node_gets_its_mode_without_a_chmod_that_follows_a_swapped_link(tmp_path, monkeypatch):
    """The window a second container sharing /dev needs: right after mknod, the new node is
    replaced by a link to a host file. Before the fix, chmod(name) followed it (the host file
    became 0666); now the mode comes from mknod itself (umask 0) and nothing is done by name
    except fchownat(AT_SYMLINK_NOFOLLOW)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    victim = tmp_path / "host-secret"
    victim.write_text("host file")
    victim.chmod(0o600)
    real_mknod = os.mknod

    def racing_mknod(name, mode, device, *, dir_fd):
        real_mknod(name, mode, device, dir_fd=dir_fd)
        os.unlink(name, dir_fd=dir_fd)  # the racer wins: a link to the host where the node was
        os.symlink(str(victim), name, dir_fd=dir_fd)

    monkeypatch.setattr(mounts.os, "mknod", racing_mknod)
    _make_node(rootfs, "/dev/nvidia0", PlannedNode(stat.S_IFCHR | 0o666, os.makedev(195, 0), 0, 0), 0o022)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert victim.stat().st_uid == 0


def _make_node(rootfs: Path, target: str, node: PlannedNode, umask: int) -> None:
    """The apply step's device-node operation for `target`, under the given umask."""
    old_umask = os.umask(umask)
    try:
        m = Mounter(_root(rootfs), _Log())
        m.device({"kind": "device", "target": target, "options": ["ro"]}, Options(["ro"], "x"),
                 Source(target, -1, node))
        m.finish()
    finally:
        os.umask(old_umask)


@needs_root
def test_device_node_mode_and_owner_exact_whatever_the_umask(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    _make_node(rootfs, "/dev/nvidiactl", PlannedNode(stat.S_IFCHR | 0o666, os.makedev(195, 255), 0, 44), 0o077)
    st = os.lstat(rootfs / "dev/nvidiactl")
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
    assert (st.st_rdev, st.st_uid, st.st_gid) == (os.makedev(195, 255), 0, 44)
    assert os.umask(0o022) == 0o022  # restored (the test's own was 0o022 before)


# -- item 3: copies into nvhook's own tmpfs -------------------------------------------------

_COPY_SCRIPT = r"""
import os, sys
from nvhook.apply.mounts import Mounter, Options, Source
from nvhook.apply.paths import Root
from nvhook.base.errors import HookError
rootfs, host_dir, src, mode = sys.argv[1:5]
class Log:
    level = 20
    def __getattr__(self, n):
        return lambda *a, **k: None
root = Root(os.open(rootfs, os.O_PATH | os.O_DIRECTORY))
m = Mounter(root, Log())
m.tmpfs({"kind": "tmpfs", "target": "/proc/driver/nvidia", "options": ["nosuid"]}, Options(["nosuid", "rw"], "t"))
tm = rootfs + "/proc/driver/nvidia"
if mode == "dir-link":  # what image code or a racer would plant once the tmpfs is there
    os.symlink(host_dir, tm + "/capabilities")
elif mode == "file-link":
    os.makedirs(tm + "/capabilities/gpu0/mig/gi1", exist_ok=True)
    os.symlink(host_dir + "/victim", tm + "/capabilities/gpu0/mig/gi1/access")
fd = os.open(src, os.O_RDONLY)
try:
    m.copy({"kind": "procfs", "target": "/proc/driver/nvidia/capabilities/gpu0/mig/gi1/access",
            "options": ["copy"]}, Options(["copy"], "c"), Source(src, fd, None))
    print("COPIED")
except HookError as e:
    print("REFUSED", e)
"""


@needs_root
@pytest.mark.parametrize("mode", ["dir-link", "file-link", "clean"])
def test_copy_into_own_tmpfs_never_follows_a_planted_link(tmp_path, mode):
    """A link planted in nvhook's /proc/driver/nvidia tmpfs (a directory on the way, or the
    file's own name) is never followed: before the fix the MIG capability copy created
    directories under the link's host target and wrote the file there. Runs in a private
    mount namespace (the tmpfs is real)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "proc/driver/nvidia").mkdir(parents=True)
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    (host_dir / "victim").write_text("host file\n")
    src = tmp_path / "access"
    src.write_text("DeviceFileMinor: 7\n")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _COPY_SCRIPT,
                        str(rootfs), str(host_dir), str(src), mode],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in host_dir.iterdir()) == ["victim"], r.stdout
    assert (host_dir / "victim").read_text() == "host file\n"
    if mode == "clean":
        assert r.stdout.startswith("COPIED"), r.stdout
    else:
        assert r.stdout.startswith("REFUSED cannot copy"), r.stdout


# -- item 3: compat candidates ----------------------------------------------------------------

def test_fifo_under_a_library_name_is_never_opened(tmp_path):
    """The ELF reader opens O_PATH, checks the type on that fd and only then reopens: a FIFO
    (or a device node) swapped in under a compat library's name is never opened. A writer
    blocked in open(O_WRONLY) on the FIFO would be released by any open for reading."""
    fifo = tmp_path / "libcuda.so.999.1.1"
    os.mkfifo(fifo)
    opened = threading.Event()
    tid: list[int] = []

    def writer():
        tid.append(threading.get_native_id())
        try:
            fd = os.open(fifo, os.O_WRONLY)  # blocks until someone opens it for reading
        except OSError:
            return
        opened.set()
        os.close(fd)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    # the writer is blocked in open(), waiting for a reader (the FIFO's wait in the kernel)
    wait_until(lambda: tid and _in_open(tid[0]), "the writer thread blocked opening the FIFO")
    with pytest.raises(ValueError, match="not a regular file"):
        elf.fwd_compat_note(str(fifo), follow_symlinks=False)
    # an open for reading releases the writer at once; it is given the time it may take to run
    time.sleep(0.2)
    assert not opened.is_set(), "nvhook opened the FIFO"
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # release the writer thread
    t.join(5)


def _in_open(tid: int) -> bool:
    """Thread `tid` of this process sleeps in open(): the FIFO's wait for a partner (wchan), or
    where the kernel hides symbols from wchan, the system call it is in (open or openat)."""
    task = Path(f"/proc/self/task/{tid}")
    if (task / "wchan").read_text() == "wait_for_partner":
        return True
    nr = (task / "syscall").read_text().split()[0]
    return nr in {"2", "257"} if os.uname().machine == "x86_64" else nr == "56"


def test_compat_scan_reads_the_file_it_checked(tmp_path):
    """find_compat_libs opens each candidate once (O_PATH) and reads the note through that fd:
    swapping the name for a FIFO after the check changes nothing that is read."""
    from nvhook.observe import image

    compat = tmp_path / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    lib = compat / "libcuda.so.999.1.1"
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)  # an ELF header that does not parse: note_error
    real_note = elf.fwd_compat_note
    seen = []

    def swapping_note(path, *, follow_symlinks=True, fd=None):
        os.unlink(path)
        os.mkfifo(path)  # the racer's swap, after nvhook checked the name
        seen.append(fd)
        return real_note(path, follow_symlinks=follow_symlinks, fd=fd)

    elf.fwd_compat_note = swapping_note
    try:
        libs = image.find_compat_libs(str(tmp_path), "535.1.1")
    finally:
        elf.fwd_compat_note = real_note
    assert seen and seen[0] is not None
    [entry] = libs
    assert entry["note_error"] is not None and "not a regular file" not in entry["note_error"]


# -- item 5: the log ------------------------------------------------------------------------

def _flush_within(log: EventLog, seconds: float) -> float:
    """log.flush() in a thread (a blocked open or flock must fail the test, not hang it);
    returns how long it took."""
    t = time.monotonic()
    th = threading.Thread(target=log.flush, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"writing the log blocked for more than {seconds} s"
    return time.monotonic() - t


def _one_event_log(path: str) -> EventLog:
    log = EventLog("info", path)
    log.info("hook.start", container="c1")
    return log


def test_log_symlink_is_not_followed_even_dangling(tmp_path):
    target = tmp_path / "elsewhere.log"
    link = tmp_path / "nvhook.log"
    os.symlink(target, link)
    log = _one_event_log(str(link))
    log.flush()
    assert not target.exists()
    assert log.write_error and log.write_error.startswith(f"cannot open log file {link}")


def test_log_fifo_never_hangs(tmp_path):
    fifo = tmp_path / "nvhook.log"
    os.mkfifo(fifo)
    log = _one_event_log(str(fifo))
    _flush_within(log, 2)
    assert "cannot open log file" in log.write_error

    # with a reader on it, the open succeeds and the type check refuses it
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        log = _one_event_log(str(fifo))
        _flush_within(log, 2)
        assert "not a regular file" in log.write_error
        try:
            data = os.read(r, 100)
        except BlockingIOError:
            data = b""
        assert data == b""  # nothing was written into the FIFO
    finally:
        os.close(r)


@needs_root
def test_log_owned_by_someone_else_is_refused(tmp_path):
    p = tmp_path / "nvhook.log"
    p.write_text("")
    os.chown(p, 1000, 1000)
    log = _one_event_log(str(p))
    log.flush()
    assert "owned by uid 1000, not root" in log.write_error
    assert p.read_text() == ""


def test_log_lock_held_by_a_reader_costs_at_most_the_timeout(tmp_path):
    p = tmp_path / "nvhook.log"
    p.write_text("")
    holder = os.open(p, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # any reader can do this
    try:
        log = _one_event_log(str(p))
        first = _flush_within(log, 2)
        log.info("hook.done")
        second = _flush_within(log, 2)
    finally:
        os.close(holder)
    assert first < 1 and second < 0.05, (first, second)  # the run's second flush does not wait again
    assert "stayed locked by another process" in log.write_error
    assert [ln.count('"event"') for ln in p.read_text().splitlines()] == [1, 1]  # both written, whole


def test_log_written_normally(tmp_path):
    p = tmp_path / "nvhook.log"
    log = _one_event_log(str(p))
    log.flush()
    assert log.write_error is None
    assert '"event":"hook.start"' in p.read_text()
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


# -- item 6: the inventory cache ------------------------------------------------------------

@needs_root
def test_cache_dir_checked_on_every_component(tmp_path):
    base = tmp_path / "a"
    d = base / "b" / "cache"
    d.mkdir(parents=True, mode=0o700)
    tmp_path.chmod(0o755)
    base.chmod(0o755)
    (base / "b").chmod(0o755)
    assert config_mod.cache_usable(str(d))
    (base / "b").chmod(0o777)  # anyone could rename cache/ away and put their own in its place
    assert not config_mod.cache_usable(str(d))
    (base / "b").chmod(0o1777)  # sticky: they cannot
    assert config_mod.cache_usable(str(d))
    (base / "b").chmod(0o755)
    os.chown(base, 1000, 1000)  # a user's directory on the way
    assert not config_mod.cache_usable(str(d))
    os.chown(base, 0, 0)
    link_dir = tmp_path / "links"
    link_dir.mkdir(mode=0o755)
    os.symlink(d, link_dir / "cache")
    assert config_mod.cache_usable(str(link_dir / "cache"))
    os.lchown(link_dir / "cache", 1000, 1000)  # a link someone else owns
    assert not config_mod.cache_usable(str(link_dir / "cache"))


def test_cached_inventory_with_a_source_outside_the_root_is_not_used():
    files = {g: [] for g in ("libraries", "binaries", "devices", "ipc", "firmware", "configs")}
    files["libraries"] = [{"source": "/host/root/usr/lib/libcuda.so.1"}]
    assert inv_cache._sources_in_root(files, "/host/root")
    for bad in ("/etc/shadow", "/host/rootx/lib", "/host/root/../../etc/shadow", "/host/root/usr/.."):
        files["libraries"] = [{"source": bad}]
        assert not inv_cache._sources_in_root(files, "/host/root"), bad


# -- item 8: control characters -------------------------------------------------------------

def test_messages_and_log_fields_carry_no_control_characters(tmp_path, capsys):
    evil = "ldconfig said \x1b]0;owned\x07\x1b[2J\rfine\x9b31m"
    e = HookError(f"ldconfig failed with exit code 3: {evil}")
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in e.message), e.message
    stderr_line(evil)
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err and err.endswith("\n")
    log = EventLog("info", str(tmp_path / "l"))
    ev = log.warning("symlink.replaced", previous=evil, count=3)
    assert ev["previous"] == clean(evil) and ev["count"] == 3
    # every field: the bound container id, list items, dict keys and values, other objects' text
    log.bind(container=evil)
    log.warning("x.y", paths=[evil, "ok"], detail={evil: (evil, 1)}, error=OSError(evil))
    (line,) = [json.loads(b) for b in log.lines() if b"x.y" in b]
    assert line["container"] == clean(evil) and line["paths"] == [clean(evil), "ok"]
    assert line["detail"] == {clean(evil): [clean(evil), 1]} and line["error"] == clean(evil)
    assert clean("plain ünïcode text") == "plain ünïcode text"


# -- item 9: bounded work ---------------------------------------------------------------------

CFG = config_mod.DEFAULTS


def test_huge_requirement_refused_in_milliseconds():
    expr = " ".join(["cuda>=13.0"] * 399_999 + ["cuda>=12.0"])  # 400,000 terms, the last one holds
    with cpu_seconds() as took:
        with pytest.raises(HookError, match=r"^NVIDIA_REQUIRE_CUDA is 4399999 characters long; nvhook reads at most"):
            requirements.parse(expr, "NVIDIA_REQUIRE_CUDA")
        many = ",".join(f"arch>=8.{i % 10}" for i in range(1500))  # under the character bound
        with pytest.raises(HookError, match="has more than 1024 terms"):
            requirements.parse(many[:16000], "NVIDIA_REQUIRE_GPU")
    assert took.seconds < 0.5, f"{took.seconds:.2f} s of CPU"


def test_worst_requirement_within_bounds_is_fast():
    expr = ",".join(f"arch>=8.{i}" for i in range(1024))[:requirements.MAX_CHARS]
    parsed = requirements.parse(expr)
    with cpu_seconds() as took:
        assert requirements.satisfied(parsed, {"cuda": "12.2", "driver": "535.1"},
                                      [{"cc": "9.0", "brand": "tesla"}] * 8)
    assert took.seconds < 0.2, f"{took.seconds:.2f} s of CPU"


def test_device_lists_bounded_and_deduplicated_in_linear_time():
    env = {"NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in range(100_000))}
    with cpu_seconds() as took:
        with pytest.raises(HookError, match="^NVIDIA_VISIBLE_DEVICES is 588889 characters long; nvhook reads at most"):
            request_mod.parse(env, privileged=False, mounts=[], config=CFG)
        env = {"NVIDIA_VISIBLE_DEVICES": ",".join(str(i) for i in range(2000))}
        with pytest.raises(HookError, match="^NVIDIA_VISIBLE_DEVICES lists more than 1024 entries"):
            request_mod.parse(env, privileged=False, mounts=[], config=CFG)
        env = {"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_REQUIRE_CUDA": "cuda>=1.0 " * 2000}  # refused before logged
        with pytest.raises(HookError, match="^NVIDIA_REQUIRE_CUDA is 19999 characters long"):
            request_mod.parse(env, privileged=False, mounts=[], config=CFG)
    assert took.seconds < 0.5, f"{took.seconds:.2f} s of CPU"
    env = {"NVIDIA_VISIBLE_DEVICES": "1,0,1,0,2"}
    assert request_mod.parse(env, privileged=False, mounts=[], config=CFG)["devices"] == ["1", "0", "2"]
    env = {"NVIDIA_VISIBLE_DEVICES": "0", **{f"NVIDIA_REQUIRE_{i}": "cuda>=1.0" for i in range(65)}}
    with pytest.raises(HookError, match="sets 65 NVIDIA_REQUIRE_"):
        request_mod.parse(env, privileged=False, mounts=[], config=CFG)


@needs_root
def test_refused_cache_dir_is_a_warning_naming_why(tmp_path, fixtures_root):
    """An operator whose cache_dir is refused pays the full scan on every start: the log says so
    and why."""
    from nvhook.observe.host import discover

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cache_dir = shared / "nvhook"
    cache_dir.mkdir(mode=0o700)
    log = EventLog("info")
    discover.observe(str(fixtures_root / "host-gpu1"), str(cache_dir), log)
    [ev] = [e for e in log.events if e["event"] == "inventory.cache_refused"]
    assert ev["level"] == "warning"
    assert ev["reason"] == f"{shared} (above the cache) is writable by group or others (mode 0777)"
    assert list(cache_dir.iterdir()) == []
