"""Issue 9 in real runc containers: hostile images, a racing second container sharing the
rootfs, hostile log paths, a state that points at nvhook's own mount namespace, and inputs
sized to make the hook spend seconds. Each test fails on the code before the fix (the notes
say how); the unit-level versions are in tests/test_security_units.py."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402  (tests/conftest.py puts tests/fixtures on sys.path)
import runcbox as rb  # noqa: E402
from waiting import cpu_seconds, wait_until  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.nvhook_skip_reason() is not None,
                                                   reason=rb.nvhook_skip_reason() or "")]

STARTED = "touch /started; echo STARTED"
CONTROL = {chr(c) for c in (*range(0x20), *range(0x7F, 0xA0))} - {"\n"}


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


def _failed(r: rb.HookRun, starts_with: str) -> str:
    assert r.proc.returncode != 0, r.stdout
    assert "STARTED" not in r.stdout
    last = r.events()[-1]
    assert last["event"] == "hook.failed", [e["event"] for e in r.events()]
    assert last["error"].startswith(starts_with), last["error"]
    assert r.hook_error_lines() == [f"nvhook: {last['error']}"], r.proc.stderr
    return last["error"]


# -- item 9: bounded work ---------------------------------------------------------------------

def test_400000_term_requirement_stops_the_container_at_once(tmp_path, gpu8):
    """Before: 8 s of parsing and checking (then a start with a 4 MB variable). Now one line,
    in milliseconds."""
    expr = " ".join(["cuda>=13.0"] * 399_999 + ["cuda>=12.0"])
    # CPU time of the whole start (runc and the hook it ran): other processes' load does not
    # stretch it as it does wall time, and the 8 s of parsing are CPU time
    with cpu_seconds(children=True) as took:
        r = rb.run_with_nvhook(tmp_path, host=gpu8, env={"NVIDIA_REQUIRE_CUDA": expr}, script=STARTED)
    _failed(r, "NVIDIA_REQUIRE_CUDA is 4399999 characters long; nvhook reads at most 16384")
    assert max(len(ln) for ln in r.log_file.read_text().splitlines()) < 4096  # nor logged it
    assert took.seconds < 4, f"the refused start took {took.seconds:.1f} s of CPU"


def test_huge_device_list_stops_the_container_at_once(tmp_path, gpu8):
    """Before: duplicates were removed in quadratic time (100,000 ids: minutes)."""
    ids = ",".join(str(i) for i in range(100_000))
    with cpu_seconds(children=True) as took:
        r = rb.run_with_nvhook(tmp_path, host=gpu8, env={"NVIDIA_VISIBLE_DEVICES": ids}, script=STARTED,
                               timeout=60)
    _failed(r, "NVIDIA_VISIBLE_DEVICES is 588889 characters long; nvhook reads at most 65536")
    assert max(len(ln) for ln in r.log_file.read_text().splitlines()) < 4096  # nothing logged the list
    assert took.seconds < 4, f"the refused start took {took.seconds:.1f} s of CPU"


# -- item 7: a state pid in nvhook's own mount namespace ----------------------------------------

def test_state_pid_in_nvhooks_own_mount_namespace_is_refused(tmp_path, gpu8):
    """A state whose pid is not in a container (here: a process beside nvhook) would have nvhook
    mount the driver into its own, the host's, mount namespace. It refuses in one line and
    mounts nothing. Run in a private mount namespace, so that the old code's mounts (the
    test fails on it) land nowhere that matters."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=tmp_path / "nvhook.jsonl",
                                    cache_dir=tmp_path / "cache")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(mf.oci_config(str(rootfs), rb.image_env("container-debian"))))
    script = ('sleep 60 & s=$!; '
              'printf \'{"ociVersion":"1.0.2","id":"ns-test","status":"created","pid":%d,"bundle":"%s"}\' "$s" "$1" '
              '| "$2" --config "$3" --root "$4" prestart; rc=$?; '
              'grep -c " $5" /proc/self/mountinfo; kill $s; exit $rc')
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(bundle),
                        str(rb.NVHOOK_BIN), str(config), str(gpu8), str(rootfs)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [f"nvhook: container process {_pid_in(r.stderr)} shares nvhook's own mount "
                                     f"namespace; refusing to mount into it (the OCI state's pid must be the "
                                     f"container's process)"], r.stderr
    assert r.stdout.split() == ["0"], r.stdout  # nothing mounted under the rootfs in that namespace


def _pid_in(stderr: str) -> str:
    return stderr.split("container process ", 1)[1].split(" ", 1)[0] if "container process " in stderr else "?"


# -- item 5: the log ------------------------------------------------------------------------

def _log_case(tmp_path: Path, gpu8: Path, log_file: Path) -> tuple[rb.HookRun, str]:
    """A start whose hook runc kills after HOOK_TIMEOUT_S: a hook that blocked on its log fails
    the start (the container does not run), however loaded the machine is."""
    err = tmp_path / "hook-stderr"
    r = rb.run_with_nvhook(tmp_path, host=gpu8, script=STARTED, stderr_to=err, log_file=log_file,
                           timeout=HOOK_TIMEOUT_S)
    return r, err.read_text() if err.exists() else ""


HOOK_TIMEOUT_S = 30


def test_log_path_planted_as_a_dangling_link_is_not_followed(tmp_path, gpu8):
    """Before: the link was followed and its target created (as root, anywhere)."""
    target = tmp_path / "somewhere" / "created-by-nvhook"
    target.parent.mkdir()
    link = tmp_path / "nvhook.log"
    os.symlink(target, link)
    r, err = _log_case(tmp_path, gpu8, link)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr
    assert not target.exists()
    assert f"nvhook: cannot open log file {link}: Too many levels of symbolic links; the hook's work was not " \
           f"affected" in err.splitlines(), err


def test_log_path_that_is_a_fifo_does_not_hang_the_start(tmp_path, gpu8):
    """Before: open() blocked until the runtime's hook timeout killed the hook."""
    fifo = tmp_path / "nvhook.log"
    os.mkfifo(fifo)
    r, err = _log_case(tmp_path, gpu8, fifo)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr  # not killed at the hook timeout
    assert f"nvhook: cannot open log file {fifo}: No such device or address; the hook's work was not affected" \
           in err.splitlines(), err


def test_log_locked_by_a_reader_costs_a_bounded_wait(tmp_path, gpu8):
    """Anyone who can open the log can flock it. Before: every start waited for the lock until
    the hook timeout. Now: a short wait, the events written anyway, stderr says so."""
    log = tmp_path / "nvhook.log"
    log.write_text("")
    log.chmod(0o644)
    holder = os.open(log, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        r, err = _log_case(tmp_path, gpu8, log)
    finally:
        os.close(holder)
    assert r.proc.returncode == 0 and "STARTED" in r.stdout, r.proc.stderr  # not killed at the hook timeout
    assert "stayed locked by another process for 200 ms; events written without the lock" in err, err
    evs = r.events()
    assert [e["event"] for e in evs][0] == "hook.start" and evs[-1]["event"] == "hook.done"


def test_first_event_is_written_before_the_work(tmp_path, gpu8):
    """A hook killed by the runtime's hook timeout still leaves which container it worked on:
    the start event (container id and pid) is written before the work. Here a configured
    program that never ends keeps nvhook busy until runc kills it (hook timeout 5 s). Before:
    the log had nothing of that start."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    for rel in ("sbin/ldconfig", "sbin/ldconfig.real"):
        (rootfs / rel).unlink(missing_ok=True)
    (rootfs / "sbin/ldconfig").write_text("#!/bin/sh\nexec sleep 1000\n")
    (rootfs / "sbin/ldconfig").chmod(0o755)
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=log, cache_dir=tmp_path / "cache",
                                    extra='[ldconfig]\npath = "/sbin/ldconfig"\ntimeout = 60\n')
    cfg = mf.oci_config(str(rootfs), rb.image_env("container-debian"))
    cfg["process"]["args"] = ["/bin/sh", "-c", STARTED]
    # runc kills the hook at this timeout: long enough for its start and first events on a loaded machine
    bundle = rb.nvhook_bundle(tmp_path / "bundle", cfg, ["--config", str(config), "--root", str(gpu8), "prestart"],
                              timeout=15)
    cid = f"nvhook-early-{uuid.uuid4().hex[:8]}"
    r = rb.runc_run(bundle, tmp_path / "state", timeout=60, cid=cid)
    assert r.returncode != 0 and "STARTED" not in r.stdout
    evs = rb.read_events(log)
    # written when the GPU work begins: the start and the request it read
    assert [e["event"] for e in evs] == ["hook.start", "request"], evs
    assert evs[0]["container"] == cid and isinstance(evs[0]["container_pid"], int) and evs[0]["container_pid"] > 0


# -- item 8: control characters from a program --------------------------------------------------

def test_program_output_reaches_no_terminal_with_control_characters(tmp_path, gpu8):
    """A configured image ldconfig that fails with escape sequences in its output (a title
    change, a screen clear, a carriage return over the line): nvhook's stderr (which podman
    prints as is) and its log carry none of them. Before: they were passed through."""
    evil = "\\033]0;owned\\007\\033[2J\\rall good"

    def prepare(root: Path) -> None:
        for rel in ("sbin/ldconfig", "sbin/ldconfig.real"):
            (root / rel).unlink(missing_ok=True)
        (root / "sbin/ldconfig").write_text(f"#!/bin/sh\nprintf '{evil}\\n' >&2\nexit 3\n")
        (root / "sbin/ldconfig").chmod(0o755)

    err_file = tmp_path / "hook-stderr"
    r = rb.run_with_nvhook(tmp_path, host=gpu8, prepare=prepare, script=STARTED, stderr_to=err_file,
                           config_extra='[ldconfig]\npath = "/sbin/ldconfig"\n')
    assert r.proc.returncode != 0
    raw = err_file.read_bytes().decode()
    assert raw.startswith("nvhook: ldconfig failed with exit code 3: "), raw
    assert not CONTROL & set(raw), repr(raw)
    error = r.events()[-1]["error"]
    assert "owned" in error and not CONTROL & set(error), repr(error)


# -- item 3: a second container sharing the rootfs races the device nodes -----------------------

RACER_C = r"""
#include <sys/stat.h>
#include <unistd.h>
#include <stdio.h>
/* argv[1]: the link's target; argv[2..]: names to swap. Whenever one is a character device
   (nvhook's mknod just made it), replace it by a link, as fast as possible. */
int main(int argc, char **argv) {
    struct stat st;
    unsigned long won = 0;
    for (;;) {
        for (int i = 2; i < argc; i++) {
            if (lstat(argv[i], &st) == 0 && S_ISCHR(st.st_mode)) {
                if (unlink(argv[i]) == 0 && symlink(argv[1], argv[i]) == 0) {
                    won++;
                    FILE *f = fopen("/racer-swaps.tmp", "w");  /* renamed: read whole or not at all */
                    if (f) { fprintf(f, "%lu\n", won); fclose(f); rename("/racer-swaps.tmp", "/racer-swaps"); }
                }
            }
        }
    }
}
"""

RACE_STARTS = int(os.environ.get("NVHOOK_RACE_STARTS", "40"))


def _wait_running(state: Path, cid: str, proc: subprocess.Popen) -> None:
    """Until runc says container `cid` runs (its process exec'ed); fails if `proc` (its runc
    run) ended first."""
    def running() -> bool:
        st = subprocess.run(["runc", "--root", str(state), "state", cid], capture_output=True, text=True)
        if st.returncode == 0 and json.loads(st.stdout)["status"] == "running":
            return True
        assert proc.poll() is None, f"the racer did not start: {proc.stderr.read() if proc.stderr else ''!r}"
        return False

    wait_until(running, f"racer container {cid} running")


def _no_dev_tmpfs(cfg: dict) -> dict:
    """Both containers use the rootfs's own /dev: what they share is the image's directory."""
    cfg["mounts"] = [m for m in cfg["mounts"] if not m["destination"].startswith("/dev")]
    return cfg


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the racer")
def test_racing_container_sharing_the_rootfs_never_gets_a_host_file_chmodded(tmp_path, gpu8):
    """A second container on the same rootfs swaps every device node nvhook creates for a link
    to a host file, in a tight loop. Before the fix, nvhook's chmod after mknod followed the
    link and the host file became 0666 within a few starts; now the mode comes from mknod and
    nothing is done by name afterwards, over RACE_STARTS starts."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    racer = rootfs / "racer"
    src = tmp_path / "racer.c"
    src.write_text(RACER_C)
    subprocess.run(["gcc", "-O2", "-static", "-o", str(racer), str(src)], check=True, capture_output=True, timeout=120)
    victim = tmp_path / "host-secret"
    victim.write_text("host file\n")
    victim.chmod(0o600)
    names = [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]

    racer_bundle = tmp_path / "racer-bundle"
    racer_bundle.mkdir()
    rcfg = _no_dev_tmpfs(mf.oci_config(str(rootfs), ["PATH=/bin"]))
    rcfg["process"]["args"] = ["/racer", str(victim), *names]
    (racer_bundle / "config.json").write_text(json.dumps(rcfg))
    state = tmp_path / "runc-state"
    racer_id = f"nvhook-racer-{uuid.uuid4().hex[:8]}"
    racer_proc = subprocess.Popen(["runc", "--root", str(state), "run", "--bundle", str(racer_bundle), racer_id],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # The racer must be running before the first start: with a start now ~50 ms, all of
        # them could otherwise be over before runc has it going (and the test prove nothing).
        _wait_running(state, racer_id, racer_proc)
        config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=tmp_path / "nvhook.jsonl",
                                        cache_dir=tmp_path / "cache")
        env = rb.image_env("container-debian", {"NVIDIA_VISIBLE_DEVICES": "all"})
        cfg = _no_dev_tmpfs(mf.oci_config(str(rootfs), env))
        cfg["process"]["args"] = ["/bin/sh", "-c", "true"]
        bundle = rb.nvhook_bundle(tmp_path / "bundle", cfg, ["--config", str(config), "--root", str(gpu8), "prestart"])
        modes = set()
        for _ in range(RACE_STARTS):
            for n in names:
                try:
                    os.unlink(rootfs / n.lstrip("/"))
                except FileNotFoundError:
                    pass
            rb.runc_run(bundle, state, timeout=60)
            modes.add(victim.stat().st_mode & 0o7777)
            if modes != {0o600}:
                break
        swaps = (rootfs / "racer-swaps").read_text().strip() if (rootfs / "racer-swaps").exists() else "0"
    finally:
        subprocess.run(["runc", "--root", str(state), "kill", racer_id, "KILL"], capture_output=True, timeout=30)
        racer_proc.wait(timeout=30)
        subprocess.run(["runc", "--root", str(state), "delete", "-f", racer_id], capture_output=True, timeout=30)
    assert int(swaps) > 0, "the racer never swapped a node: the test proves nothing"
    assert modes == {0o600}, f"a host file's mode changed to {sorted(oct(m) for m in modes)} ({swaps} swaps)"
    assert victim.read_text() == "host file\n"


# -- item 3: a racing container swaps a compat library for a FIFO ---------------------------------

SWAPPER_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
/* argv[1]: a compat library's name, argv[2]: a FIFO beside it. A child blocks opening the FIFO
   for writing: any open for reading (by anyone, whatever its name by then) releases it, and it
   leaves /racer-opened. The parent swaps the two names as fast as it can. */
int main(int argc, char **argv) {
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(argv[2], O_WRONLY);
        if (fd >= 0) { FILE *f = fopen("/racer-opened", "w"); if (f) fclose(f); }
        return 0;
    }
    usleep(200000);
    unsigned long n = 0;
    for (;;) {
        if (renameat2(AT_FDCWD, argv[1], AT_FDCWD, argv[2], RENAME_EXCHANGE) == 0 && (++n & 0xffff) == 1) {
            FILE *f = fopen("/racer-swaps", "w"); if (f) { fprintf(f, "%lu\n", n); fclose(f); }
        }
    }
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the racer")
def test_racing_container_never_gets_a_fifo_opened_by_the_compat_scan(tmp_path, gpu8):
    """A second container on the same rootfs swaps a compat libcuda (newer than the host's
    driver, so nvhook reads its ELF note) with a FIFO, nonstop. Before the fix, nvhook lstat()ed
    the name and then opened it by path: host root opened the FIFO (a device node the same way)
    within a few starts. Now it is opened O_PATH once, checked, and read through that fd."""
    rootfs = mf.build_container("container-debian", tmp_path / "images")
    src = tmp_path / "swapper.c"
    src.write_text(SWAPPER_C)
    subprocess.run(["gcc", "-O2", "-static", "-o", str(rootfs / "swapper"), str(src)], check=True,
                   capture_output=True, timeout=120)
    compat = rootfs / "usr/local/cuda/compat"
    compat.mkdir(parents=True)
    lib = compat / "libcuda.so.999.1.1"
    lib.write_bytes(b"\x7fELF" + b"\0" * 60)
    os.mkfifo(compat / ".spare")

    racer_bundle = tmp_path / "racer-bundle"
    racer_bundle.mkdir()
    rcfg = mf.oci_config(str(rootfs), ["PATH=/bin"])
    rcfg["process"]["args"] = ["/swapper", "/usr/local/cuda/compat/libcuda.so.999.1.1", "/usr/local/cuda/compat/.spare"]
    (racer_bundle / "config.json").write_text(json.dumps(rcfg))
    state = tmp_path / "runc-state"
    racer_id = f"nvhook-swapper-{uuid.uuid4().hex[:8]}"
    racer_proc = subprocess.Popen(["runc", "--root", str(state), "run", "--bundle", str(racer_bundle), racer_id],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    opened = rootfs / "racer-opened"
    try:
        _wait_running(state, racer_id, racer_proc)
        config = rb.write_nvhook_config(tmp_path / "nvhook.toml", log_file=tmp_path / "nvhook.jsonl",
                                        cache_dir=tmp_path / "cache")
        cfg = mf.oci_config(str(rootfs), rb.image_env("container-debian"))
        cfg["process"]["args"] = ["/bin/sh", "-c", "true"]
        bundle = rb.nvhook_bundle(tmp_path / "bundle", cfg, ["--config", str(config), "--root", str(gpu8), "prestart"])
        starts = 0
        for _ in range(RACE_STARTS):
            rb.runc_run(bundle, state, timeout=60)
            starts += 1
            if opened.exists():
                break
        scanned = sum(1 for e in rb.read_events(tmp_path / "nvhook.jsonl") if e["event"] == "image.observed"
                      or e["event"] == "compat.decision")
    finally:
        subprocess.run(["runc", "--root", str(state), "kill", racer_id, "KILL"], capture_output=True, timeout=30)
        racer_proc.wait(timeout=30)
        subprocess.run(["runc", "--root", str(state), "delete", "-f", racer_id], capture_output=True, timeout=30)
    assert scanned > 0, "nvhook never looked at the image's compat libraries: the test proves nothing"
    assert (rootfs / "racer-swaps").exists(), "the racer never ran"
    assert not opened.exists(), f"nvhook opened the FIFO swapped in for a compat library (start {starts})"


# -- item 6: IPC binds ------------------------------------------------------------------------

def test_ipc_directory_is_read_only_and_the_socket_stays_writable(tmp_path, gpu8):
    """The MPS pipe directory is a host directory: the container gets it read-only (before: a
    container could create files in the host's /tmp/nvidia-mps). The persistenced socket stays
    bound read-write (clients connect to it)."""
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(gpu8), str(host)], check=True)
    script = ("touch /tmp/nvidia-mps/planted 2>/dev/null && echo MPS-WRITABLE; "
              "grep -E ' /(tmp/nvidia-mps|run/nvidia-persistenced/socket) ' /proc/mounts | cut -d' ' -f2,4")
    r = rb.run_with_nvhook(tmp_path / "run", host=host, script=script,
                           env={"NVIDIA_DRIVER_CAPABILITIES": "compute,utility"})
    assert r.proc.returncode == 0, r.proc.stderr
    opts = {ln.split()[0]: ln.split()[1].split(",") for ln in r.stdout.splitlines() if ln.startswith("/")}
    assert "ro" in opts["/tmp/nvidia-mps"], r.stdout
    assert "rw" in opts["/run/nvidia-persistenced/socket"], r.stdout
    assert "MPS-WRITABLE" not in r.stdout
    assert not (host / "tmp/nvidia-mps/planted").exists()
