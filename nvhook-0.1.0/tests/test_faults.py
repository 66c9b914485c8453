"""Faults, through the real nvhook hook: each one gives the user a clear one-line error (runc
shows the hook's stderr) or a logged fallback, and leaves nothing on the host (no new mount in
the host's mount table, no change to the host root, no file outside the container's rootfs,
no process left behind).

Containers are real `runc run`s with the installed console script as the prestart hook
(tests/e2e/runcbox.py). Where a fault has to hit at a precise moment the test drives nvhook
itself:
  - "container process gone": hook mode run directly, its OCI state naming a pid that exited;
  - "library vanished between plan and mount": the plan nvhook made (`--dry-run --format json`)
    is applied by tests/e2e/apply_hook.py (nvhook.apply.apply_plan in a runc prestart hook)
    after the library was deleted;
  - what the hook prints when it succeeds (runc drops a successful hook's stderr): the hook
    runs through `sh -c 'exec nvhook ... 2>>FILE'` under runc (runcbox.nvhook_bundle stderr_to).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostfix import mf, spec, tree_snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402
from waiting import wait_until  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")]

DRIVER = "535.261.03"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
PATH_ENV = mf.BUNDLE_ENV[0]
CAPS = "NVIDIA_DRIVER_CAPABILITIES=compute,utility"
NVML_TIMEOUT = 1  # the bound on a hanging NVML or ldconfig, in the tests of that bound
LDCONFIG_TIMEOUT = 1
# Their bound everywhere else: NVML answering "driver not loaded" or a working ldconfig can take
# over a second on a loaded machine, and then the test would see a timeout instead.
ANSWER_S = 30
# What a hang "bounded by a 1 s timeout" may take in all, the start around it included, on a
# loaded machine; the hangs themselves last for good (a test of a bound that does not hold
# fails, or runs into runc_run's own 60 s timeout).
SLACK_S = 20
PROBE = "echo DEV $(ls /dev); echo GPUS $(ls /proc/driver/nvidia/gpus); cuda-probe"


class Env:
    """One test's world: private copies of fixtures, a config, bundles, runc runs, and the
    before/after checks that nothing outside the container's rootfs changed."""

    def __init__(self, fixtures_root: Path, tmp: Path):
        self.fixtures_root = fixtures_root
        self.tmp = tmp
        self.fx = tmp / "fx"
        self.fx.mkdir()
        self.cache = tmp / "cache"
        self.cache.mkdir(mode=0o700)
        self.log = tmp / "nvhook.log"
        self.state_root = tmp / "runc-state"
        self.hosts: list[Path] = []
        self.conf: Path | None = None
        self.log_path: Path | None = None
        self.ignored: set[Path] = set()  # files a test's own helpers write (not nvhook)
        self._before: dict | None = None

    # -- building ---------------------------------------------------------------------------

    def copy(self, name: str, as_name: str | None = None) -> Path:
        """A private copy of a generated fixture (cp -a keeps device nodes, sockets, links)."""
        p = self.fx / (as_name or name)
        with open(self.fixtures_root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # not while another session regenerates them
            subprocess.run(["cp", "-a", str(self.fixtures_root / name), str(p)], check=True, timeout=60)
        if name in mf.HOSTS:
            self.hosts.append(p)  # must stay as it is
        return p

    def config(self, *, log_file: Path | None = None, nvml_timeout: float = ANSWER_S,
               ldconfig_timeout: float = ANSWER_S, ldconfig_path: str = "builtin") -> Path:
        self.log_path = self.log if log_file is None else log_file
        self.conf = rb.write_nvhook_config(
            self.tmp / "hook.toml", log_file=self.log_path, cache_dir=self.cache,
            extra=f'log_level = "debug"\n[nvml]\ntimeout = {nvml_timeout}\n[ldconfig]\ntimeout = {ldconfig_timeout}\n'
                  f'path = "{ldconfig_path}"\n')
        return self.conf

    def bundle(self, name: str, rootfs: Path, host: Path, env: list[str], *, script: str = PROBE,
               readonly: bool = False, stderr_to: Path | None = None) -> Path:
        cfg = mf.oci_config(str(rootfs), [PATH_ENV, *env])
        cfg["process"]["args"] = ["sh", "-c", script]
        cfg["root"]["readonly"] = readonly
        conf = self.conf or self.config()
        return rb.nvhook_bundle(self.tmp / name, cfg, ["--config", str(conf), "--root", str(host)],
                                stderr_to=stderr_to)

    # -- running ----------------------------------------------------------------------------

    def run(self, bundle: Path, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
        if self._before is None:
            self.snapshot()
        t = time.monotonic()
        proc = rb.runc_run(bundle, self.state_root, timeout=timeout)
        return proc, time.monotonic() - t

    def hook(self, host: Path, state: dict, timeout: float = 60) -> subprocess.CompletedProcess:
        """nvhook hook mode run directly, `state` on stdin (as runc would pass it)."""
        if self._before is None:
            self.snapshot()
        env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
        return subprocess.run([str(rb.NVHOOK_BIN), "--config", str(self.conf or self.config()), "--root", str(host)],
                              input=json.dumps(state), capture_output=True, text=True, timeout=timeout, env=env)

    def events(self) -> list[dict]:
        return rb.read_events(self.log)  # every line must parse

    def named(self, name: str) -> list[dict]:
        return [e for e in self.events() if e["event"] == name]

    # -- nothing left behind ----------------------------------------------------------------

    def _outside(self) -> dict:
        """Everything in the test's tmp dir outside the container roots, which nvhook may not
        touch: all but its log and cache, runc's state dir, and what the test's own helpers
        write (`ignored`)."""
        skip = {self.log, self.cache, self.state_root, self.fx, *self.ignored}
        if self.log_path is not None:
            skip.add(self.log_path)
        snap = tree_snapshot(self.tmp)
        # a directory's size and times change with its entries, which are compared themselves
        return {k: (v[0], v[3]) if stat.S_ISDIR(v[0]) else v for k, v in snap.items()
                if not any((self.tmp / k).is_relative_to(p) for p in skip)}

    def snapshot(self) -> None:
        self._before = {"mounts": rb.mount_table(), "hosts": {h: tree_snapshot(h) for h in self.hosts},
                        "outside": self._outside(), "fx": sorted(p.name for p in self.fx.iterdir())}

    def assert_host_untouched(self, *, extra_proc_marks: tuple[str, ...] = ()) -> None:
        assert self._before is not None
        leaked = rb.leaked_mounts(self._before["mounts"], self.tmp)
        assert leaked == [], f"mounts appeared on the host: {leaked}"
        for h, snap in self._before["hosts"].items():
            assert tree_snapshot(h) == snap, f"the host root {h} changed"
        assert self._outside() == self._before["outside"], "files outside the rootfs changed"
        assert sorted(p.name for p in self.fx.iterdir()) == self._before["fx"]
        left = _processes_mentioning(str(self.tmp), *extra_proc_marks)
        assert left == [], f"processes left behind: {left}"

    def kill_leftovers(self, *marks: str) -> None:
        """SIGKILL what a failed test left running: processes naming this test's tmp dir (its
        nvhook processes) or one of `marks`, each by its pid."""
        for line in _processes_mentioning(str(self.tmp), *marks):
            try:
                os.kill(int(line.split(":", 1)[0]), 9)
            except ProcessLookupError:
                pass


def _processes_mentioning(*marks: str) -> list[str]:
    """Processes (other than us) whose command line contains one of `marks`."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmd and any(m in cmd for m in marks):
            out.append(f"{d}: {cmd}")
    return out


def _sleep_mark() -> str:
    """A command that hangs (for months) and names this test alone: the processes left behind
    are looked for (and killed) by it, and another test session may run this test meanwhile."""
    return f"sleep {random.randint(10**7, 10**8)}"


def _one_hook_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """runc failed because the hook failed, and the hook said exactly one line naming the problem."""
    assert proc.returncode != 0, proc.stdout
    lines = rb.hook_stderr_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("nvhook: "), line
    assert "Traceback" not in proc.stderr and "internal error" not in line, line
    for n in needles:
        assert n in line, (n, line)
    return line


def _run_past_hook_timeout(env: Env, bundle: Path, *marks: str) -> None:
    """runc run with a hook that outlives the runtime's 1 s hook timeout: runc must kill it and
    fail the start at once, not wait for what the hook left holding its stdout/stderr (which
    hangs for 30 s, nvhook's own timeout, or for good); then what the kill takes down goes."""
    try:
        proc, took = env.run(bundle, timeout=SLACK_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"runc run still ran {SLACK_S} s after starting a hook with a 1 s timeout; still running: "
                    f"{_processes_mentioning(str(env.tmp))}")
    assert proc.returncode != 0 and "hook ran past specified timeout" in proc.stderr, proc.stderr
    wait_until(lambda: not _processes_mentioning(str(env.tmp), *marks),
               "what the killed hook left (its apply child, NVML's or ldconfig's process) to exit",
               show=lambda: _processes_mentioning(str(env.tmp), *marks))


def _probe(proc: subprocess.CompletedProcess) -> dict:
    """The container's own view (PROBE script): DEV, GPUS and cuda-probe's lines."""
    out = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ") if line.startswith(("DEV ", "GPUS ")) else line.partition(": ")
        out[key] = value.strip()
    return out


@pytest.fixture
def env(fixtures_root, tmp_path) -> Env:
    return Env(fixtures_root, tmp_path)


# ============================================================================================
# NVML missing, failing, hanging
# ============================================================================================

NVML_MODES = ("missing", "fail", "hang")


def break_nvml(env: Env, host: Path, mode: str) -> None:
    """missing: the host has no libnvidia-ml file (its cache entry and soname link dangle);
    fail: nvmlInit returns NVML_ERROR_DRIVER_NOT_LOADED; hang: nvmlInit never returns (and the
    config bounds NVML by NVML_TIMEOUT)."""
    if mode == "hang":
        env.config(nvml_timeout=NVML_TIMEOUT)
    name = host.name
    lib = host / mf.nvml_lib_path(spec(name)).lstrip("/")
    conf = lib.parent / "fake-nvml.conf"
    if mode == "missing":
        lib.unlink()
        conf.unlink()
        return
    text = conf.read_text()
    assert "init ok" in text
    conf.write_text(text.replace("init ok", "init fail" if mode == "fail" else "init hang"))


def _nvml_warning(env: Env, mode: str) -> dict:
    (w,) = env.named("nvml.unavailable")
    assert w["level"] == "warning" and w["fallback"] == "procfs"
    expect = {"missing": "libnvidia-ml.so.1 not found on the host",
              "fail": "Driver Not Loaded",
              "hang": f"NVML did not answer within {NVML_TIMEOUT} s"}[mode]
    assert expect in w["error"], w
    return w


def _start_without_nvml(env: Env, mode: str, host_name: str, image: str, request: list[str]):
    """One container start on a copy of `host_name` whose NVML is broken as `mode` says; a
    hanging NVML costs the start its [nvml] timeout, no more. Returns (proc, seconds)."""
    host = env.copy(host_name)
    rootfs = env.copy(image)
    break_nvml(env, host, mode)
    proc, took = env.run(env.bundle("bundle", rootfs, host, request))
    if mode == "hang":
        assert took < NVML_TIMEOUT + SLACK_S, f"the start took {took:.2f} s with an NVML timeout of {NVML_TIMEOUT} s"
    return proc, took


@pytest.mark.parametrize("mode", NVML_MODES)
def test_nvml_fault_mig_request_fails_with_one_line(env, mode):
    mig = spec("host-gpu8").gpus[0].migs[0].uuid
    proc, _ = _start_without_nvml(env, mode, "host-gpu8", "container-debian", [f"NVIDIA_VISIBLE_DEVICES={mig}", CAPS])
    _one_hook_line(proc, "MIG devices were requested but NVML is unavailable", mig)
    _nvml_warning(env, mode)
    assert env.named("hook.failed")
    env.assert_host_untouched()


@pytest.mark.parametrize("mode", NVML_MODES)
def test_nvml_fault_compat_falls_back_to_procfs_guess(env, mode):
    # host driver 450 < the image's compat libcuda 465 (note lists branch 450): the decision
    # depends on the GPU's brand, which only NVML knows; without it, "Tesla T4" is guessed.
    proc, _ = _start_without_nvml(env, mode, "host-t4-450", "container-cuda113",
                                  ["NVIDIA_VISIBLE_DEVICES=0", CAPS, *mf.CONTAINERS["container-cuda113"].env])
    assert proc.returncode == 0, proc.stderr
    seen = _probe(proc)
    assert seen["label"] == "compat libcuda 465.19.01", proc.stdout
    _nvml_warning(env, mode)
    (d,) = env.named("compat.decision")
    assert d["decision"] == "image" and d["reason_code"] == "gpu-brand-guessed", d
    assert [g["brand_source"] for g in d["gpus"]] == ["procfs-guess"], d
    assert "guess" in d["reason"] and "NVML unavailable" in d["reason"], d
    env.assert_host_untouched()


@pytest.mark.parametrize("mode", NVML_MODES)
def test_nvml_fault_index_request_never_touches_nvml(env, mode):
    proc, took = _start_without_nvml(env, mode, "host-gpu8", "container-debian", ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    assert proc.returncode == 0, proc.stderr
    seen = _probe(proc)
    g0 = spec("host-gpu8").gpus[0]
    assert seen["GPUS"] == g0.bus_id and f"nvidia{g0.minor}" in seen["DEV"].split(), proc.stdout
    assert seen["label"] == f"libcuda {DRIVER}", proc.stdout
    evs = env.events()
    assert [e["event"] for e in evs if e["event"].startswith(("nvml.", "gpus.nvml"))] == []
    # never touched: no nvml.* event above (a probe that ran, hung, would have logged one), and
    # no wait as long as NVML's timeout
    (done,) = env.named("hook.done")
    assert took < NVML_TIMEOUT + SLACK_S, f"the start took {took:.2f} s"
    env.assert_host_untouched()


def test_nvml_hang_past_the_runtimes_hook_timeout_leaves_no_process(env):
    host = env.copy("host-gpu8")
    rootfs = env.copy("container-debian")
    break_nvml(env, host, "hang")
    conf = env.config(nvml_timeout=30)
    mig = spec("host-gpu8").gpus[0].migs[0].uuid
    cfg = mf.oci_config(str(rootfs), [PATH_ENV, f"NVIDIA_VISIBLE_DEVICES={mig}", CAPS])
    cfg["process"]["args"] = ["true"]
    b = rb.nvhook_bundle(env.tmp / "bundle", cfg, ["--config", str(conf), "--root", str(host)], timeout=1)
    try:
        _run_past_hook_timeout(env, b)
        env.assert_host_untouched()
    finally:
        env.kill_leftovers()  # never leave the orphan behind


# ============================================================================================
# the container process is gone before the hook runs
# ============================================================================================

@pytest.mark.parametrize("how", ["reaped", "zombie"])
def test_container_process_gone(env, how):
    """The container's process exited before the hook ran: reaped already, or (what a runtime
    that has not waited for it yet shows) a zombie. Exit 1, one line, nothing applied."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    gone = subprocess.Popen(["true"])
    try:
        if how == "reaped":
            gone.wait()
        else:
            wait_until(lambda: Path(f"/proc/{gone.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                       "the exited child to be a zombie")
        before = tree_snapshot(rootfs)
        proc = env.hook(host, {"ociVersion": "1.0.2", "id": "gone", "status": "creating", "pid": gone.pid,
                               "bundle": str(b), "annotations": {}})
    finally:
        gone.wait()
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [f"nvhook: container process {gone.pid} is gone"], proc.stderr
    (failed,) = env.named("hook.failed")
    assert failed["error"] == f"container process {gone.pid} is gone"
    assert tree_snapshot(rootfs) == before  # nothing applied
    env.assert_host_untouched()


# ============================================================================================
# ldconfig missing, failing, hanging
# ============================================================================================

def _replace_ldconfig(rootfs: Path, script: str | None) -> None:
    for rel in ("sbin/ldconfig", "sbin/ldconfig.real", "usr/sbin/ldconfig"):
        p = rootfs / rel
        if p.exists() or p.is_symlink():
            p.unlink()
    if script is not None:
        p = rootfs / "sbin/ldconfig"
        p.write_text(script)
        p.chmod(0o755)


def test_ldconfig_missing_is_a_warning(env):
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    _replace_ldconfig(rootfs, None)
    env.config(ldconfig_path="/sbin/ldconfig")  # the program option, set explicitly
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS],
                   script=f"ls {LIBDIR}; " + PROBE)
    proc, _ = env.run(b)
    assert proc.returncode == 0, proc.stderr
    assert f"libcuda.so.{DRIVER}" in proc.stdout.split()
    (w,) = env.named("ldconfig.missing")
    assert w["level"] == "warning" and "no ldconfig" in w["reason"], w
    (done,) = env.named("apply.done")
    assert done["ldconfig"] == "missing"
    env.assert_host_untouched()


def test_ldconfig_failing_stops_the_container(env):
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    _replace_ldconfig(rootfs, "#!/bin/sh\nexit 3\n")
    env.config(ldconfig_path="/sbin/ldconfig")  # the program option, set explicitly
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    proc, _ = env.run(b)
    _one_hook_line(proc, "ldconfig failed with exit code 3", "/sbin/ldconfig")
    assert proc.stdout == ""  # the container's process never ran
    (failed,) = env.named("hook.failed")
    assert "ldconfig failed with exit code 3" in failed["error"]
    env.assert_host_untouched()


def test_ldconfig_hanging_is_killed_after_its_timeout(env):
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    mark = _sleep_mark()  # what the hanging ldconfig runs; nothing may be left running it
    _replace_ldconfig(rootfs, f"#!/bin/sh\n{mark}\n")
    env.config(ldconfig_path="/sbin/ldconfig", ldconfig_timeout=LDCONFIG_TIMEOUT)  # the program option, explicitly
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    proc, took = env.run(b)
    _one_hook_line(proc, f"ldconfig did not finish within {LDCONFIG_TIMEOUT:g} s and was killed")
    assert took < LDCONFIG_TIMEOUT + SLACK_S, (f"runc run took {took:.2f} s with an ldconfig timeout of "
                                               f"{LDCONFIG_TIMEOUT} s")
    env.assert_host_untouched(extra_proc_marks=(mark,))


def test_ldconfig_hang_past_the_runtimes_hook_timeout_leaves_no_process(env):
    """The runtime's own hook timeout (1 s) is shorter than [ldconfig] timeout: runc kills the
    hook; the apply child and ldconfig (parent-death signals, ldconfig as pid 1 of its own PID
    namespace) must die with it, and runc must not wait on their pipes."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    mark = _sleep_mark()
    _replace_ldconfig(rootfs, f"#!/bin/sh\n{mark}\n")
    conf = env.config(ldconfig_timeout=30, ldconfig_path="/sbin/ldconfig")
    cfg = mf.oci_config(str(rootfs), [PATH_ENV, "NVIDIA_VISIBLE_DEVICES=0", CAPS])
    cfg["process"]["args"] = ["true"]
    b = rb.nvhook_bundle(env.tmp / "bundle", cfg, ["--config", str(conf), "--root", str(host)], timeout=1)
    try:
        _run_past_hook_timeout(env, b, mark)
        env.assert_host_untouched(extra_proc_marks=(mark,))
    finally:
        env.kill_leftovers(mark)


# ============================================================================================
# read-only rootfs
# ============================================================================================

def test_rootfs_readonly_in_config(env):
    """root.readonly = true: runc makes the root read-only only after pivot_root, i.e. after the
    prestart hook ran, so nvhook's placeholders are created and the container gets its driver;
    the container itself cannot write its root."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS], readonly=True,
                   script="touch /probe-write 2>/dev/null && echo ROOT-WRITABLE || echo ROOT-READONLY; " + PROBE)
    proc, _ = env.run(b)
    assert proc.returncode == 0, proc.stderr
    assert "ROOT-READONLY" in proc.stdout
    seen = _probe(proc)
    assert seen["label"] == f"libcuda {DRIVER}", proc.stdout
    assert env.named("hook.done")
    env.assert_host_untouched()


def _mount_ro_bind(src: Path, dst: Path) -> None:
    dst.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(dst)], check=True, timeout=30)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(dst)], check=True, timeout=30)


def test_rootfs_on_a_readonly_mount(env):
    """The rootfs directory is itself on a read-only mount (here a read-only bind): mount points
    for the driver's files cannot be created -> one line naming the first path and EROFS."""
    host = env.copy("host-gpu1")
    image = env.copy("container-debian")
    ro = env.tmp / "ro-rootfs"
    _mount_ro_bind(image, ro)
    try:
        b = env.bundle("bundle", ro, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
        env.snapshot()  # the ro bind is the test's own mount
        proc, _ = env.run(b)
        _one_hook_line(proc, "cannot create mount point", "Read-only file system")
        assert env.named("hook.failed")
        env.assert_host_untouched()
    finally:
        subprocess.run(["umount", str(ro)], check=True, timeout=30)


# ============================================================================================
# a directory where a file is expected
# ============================================================================================

def test_directory_where_a_library_goes(env):
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    target = f"{LIBDIR}/libcuda.so.{DRIVER}"
    (rootfs / target.lstrip("/")).mkdir()
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    proc, _ = env.run(b)
    _one_hook_line(proc, target, "the image has a directory there")
    env.assert_host_untouched()


# ============================================================================================
# a host library vanishing between discovery and mount
# ============================================================================================

OPENCL = f"libnvidia-opencl.so.{DRIVER}"


def test_library_gone_after_the_cache_was_warmed(env):
    """The inventory cache remembers the library; it is deleted on the host before the next
    start: the cache is invalid (its stat stamp differs), the rebuilt inventory reports the
    library missing, and the container starts without it."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    script = f"ls {LIBDIR}; " + PROBE
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS], script=script)
    proc, _ = env.run(b)
    assert proc.returncode == 0, proc.stderr
    assert OPENCL in proc.stdout.split()
    assert len(env.named("inventory.built")) == 1
    proc, _ = env.run(b)  # warm: from the cache
    assert proc.returncode == 0, proc.stderr
    assert len(env.named("inventory.cache_hit")) == 1
    env.log.unlink()

    (host / LIBDIR.lstrip("/") / OPENCL).unlink()
    fresh = env.copy("container-debian", "container-debian-2")  # a new container of the image
    b = env.bundle("bundle2", fresh, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS], script=script)
    env.snapshot()
    proc, _ = env.run(b)
    assert proc.returncode == 0, proc.stderr
    assert OPENCL not in proc.stdout.split()  # not mounted, no placeholder: it was never planned
    assert _probe(proc)["label"] == f"libcuda {DRIVER}"
    assert env.named("inventory.built") and not env.named("inventory.cache_hit")
    skipped = [e for e in env.events() if e["event"] in ("library.skipped", "library.missing")
               and str(e.get("library")).startswith("libnvidia-opencl")]
    assert skipped and all(e["level"] == "warning" for e in skipped), skipped
    (done,) = env.named("hook.done")
    assert not [m for m in done["mounted"] if "libnvidia-opencl" in m]
    env.assert_host_untouched()


def test_library_vanishes_between_plan_and_mount(env):
    """The race itself: the plan (made by nvhook for this container) names a library that is
    deleted before the apply step opens it -> "host library vanished: <path>", nothing mounted."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS])
    dry = subprocess.run([str(rb.NVHOOK_BIN), "--config", str(env.conf), "--root", str(host), "--dry-run",
                          "--bundle", str(b), "--format", "json"], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    victim = host / LIBDIR.lstrip("/") / OPENCL
    assert str(victim) in [m["source"] for m in plan["mounts"]]
    victim.unlink()
    before = tree_snapshot(rootfs)
    applier = rb.Bundle(env.tmp / "apply-bundle", rootfs, plan, ["sh", "-c", PROBE])
    env.ignored.update({applier.log_file, applier.result_file, applier.cgroup_file})
    env.snapshot()
    proc, _ = env.run(applier.path)
    _one_hook_line(proc, f"host library vanished: {victim}")
    assert tree_snapshot(rootfs) == before  # reported before any mount point was made
    env.assert_host_untouched()


# ============================================================================================
# the log cannot be written: the hook still does its job, and says so on stderr
# ============================================================================================

def _mount_tmpfs(path: Path, opts: str) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "nvhook-test", str(path)], check=True, timeout=30)


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", ["disk-full", "no-such-dir", "read-only-dir"])
def test_log_unwritable_hook_still_works(env, case):
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    mnt = env.tmp / "logfs"
    mounted = False
    try:
        if case == "disk-full":
            _mount_tmpfs(mnt, "size=16k")
            mounted = True
            _fill(mnt)
            log, reason = mnt / "nvhook.log", "cannot write log file"
            why = "No space left on device"
        elif case == "no-such-dir":
            log = env.tmp / "no" / "such" / "dir" / "nvhook.log"
            reason, why = "cannot open log file", "does not exist"
        else:
            _mount_tmpfs(mnt, "ro,size=16k")
            mounted = True
            log, reason, why = mnt / "nvhook.log", "cannot open log file", "Read-only file system"
        env.config(log_file=log)
        stderr = env.tmp / "hook-stderr.txt"
        b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS], stderr_to=stderr)
        proc, _ = env.run(b)
        assert proc.returncode == 0, proc.stderr
        seen = _probe(proc)
        g0 = spec("host-gpu1").gpus[0]
        assert seen["GPUS"] == g0.bus_id and f"nvidia{g0.minor}" in seen["DEV"].split()
        assert seen["label"] == f"libcuda {DRIVER}" and seen["cuDriverGetVersion"] == "12020", proc.stdout
        said = stderr.read_text().splitlines()
        assert said == [f"nvhook: {reason} {log}: {why}; the hook's work was not affected"], said
        if case == "disk-full":
            assert not log.exists() or log.stat().st_size == 0
        else:
            assert not log.exists()
        stderr.unlink()
        env.assert_host_untouched()
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_log_filling_up_mid_line_leaves_only_complete_lines(env):
    """The disk fills up in the middle of a line (a short write), then space comes back (log
    rotation, a cleanup): the next hook's events must still be complete JSON lines, and no line
    of the log may be a fragment."""
    host = env.copy("host-gpu1")
    rootfs = env.copy("container-debian")
    mnt = env.tmp / "logfs"
    _mount_tmpfs(mnt, "size=256k")
    try:
        log = mnt / "nvhook.log"
        seed = json.dumps({"event": "seed", "pad": ""})
        pad = 4096 - 12 - len(seed) - 1  # one page minus 12 bytes: the next line does not fit
        log.write_text(json.dumps({"event": "seed", "pad": "x" * pad}) + "\n")
        assert log.stat().st_size == 4096 - 12
        _fill(mnt)
        env.config(log_file=log)
        stderr = env.tmp / "hook-stderr.txt"
        b = env.bundle("bundle", rootfs, host, ["NVIDIA_VISIBLE_DEVICES=0", CAPS], stderr_to=stderr)
        proc, _ = env.run(b)
        assert proc.returncode == 0, proc.stderr
        said = stderr.read_text().splitlines()
        assert len(said) == 1 and said[0].startswith(f"nvhook: cannot write log file {log}: "), said
        (mnt / "filler").unlink()  # space again
        proc, _ = env.run(b)
        assert proc.returncode == 0, proc.stderr
        assert stderr.read_text().splitlines() == said  # the second hook wrote its log
        lines = log.read_bytes().split(b"\n")
        assert lines[-1] == b""
        evs = []
        for n, line in enumerate(lines[:-1]):
            try:
                evs.append(json.loads(line))
            except ValueError:
                pytest.fail(f"log line {n + 1} is not a complete JSON object: {line[:120]!r}")
        second = [e for e in evs if e.get("container") and e["event"] == "hook.done"]
        assert len(second) == 1
        mine = [e["event"] for e in evs if e.get("nvhook_pid") == second[0]["nvhook_pid"]]
        assert mine[0] == "hook.start" and mine[-1] == "hook.done", mine
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)
