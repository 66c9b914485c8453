"""Tiny containers for the apply tests: a busybox rootfs, a fake host driver tree, an OCI
bundle whose prestart hook is tests/e2e/apply_hook.py, and `runc run` bounded in time and
always cleaned up. Standard library only; nothing here is specific to one test.

For the end-to-end tests (tests/test_e2e_*.py): `run_with_nvhook` starts a private copy of a
fixture image (tests/fixtures/make_fixtures.py) with the installed nvhook as its prestart or
createRuntime hook and returns a `HookRun` (runc's result, the rootfs, the parsed JSON log);
`tree_snapshot` / `host_mounts_under` check that the host was left alone; `Podman` runs
`podman run --rm --rootfs` with all of podman's state in private directories and a hooks dir
made by `podman_hooks_dir` from the shipped oci-hooks.d/nvhook.json.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
HOOK = HERE / "apply_hook.py"
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "stat", "touch", "readlink", "test", "echo", "sleep", "grep", "true", "env", "tr",
           "mkdir", "mknod", "chroot", "pwd")

DRIVER = "535.261.03"
LIBDIR = "/usr/lib/x86_64-linux-gnu"
BUS_IDS = ("0000:07:00.0", "0000:08:00.0")


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "runc tests need root"
    if not shutil.which("runc"):
        return "runc is not installed"
    if not os.path.exists(BUSYBOX):
        return "busybox (static) is not installed"
    return None


# -- file trees ----------------------------------------------------------------------------

def make_rootfs(path: Path, applets: tuple = APPLETS) -> Path:
    """A minimal rootfs: /bin/busybox and applet links, the usual top-level dirs."""
    for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "usr/bin", "usr/lib", "sbin", "run"):
        (path / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, path / "bin/busybox")
    for a in applets:
        os.symlink("busybox", path / "bin" / a)
    return path


def build_elf_library(path: Path, soname: str) -> Path:
    """A real (if useless) ELF shared object with the given SONAME, so ldconfig indexes it."""
    src = path.with_suffix(".c")
    src.write_text("int nvhook_test_symbol(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-nostdlib", f"-Wl,-soname,{soname}", "-o", str(path), str(src)],
                   check=True, capture_output=True, timeout=60)
    src.unlink()
    return path


def make_host(path: Path, *, elf: bool = False) -> Path:
    """A fake host root with one driver library, a binary, a GPU device node and the procfs
    files of two GPUs."""
    lib = path / LIBDIR.lstrip("/")
    lib.mkdir(parents=True)
    if elf:
        build_elf_library(lib / f"libcuda.so.{DRIVER}", "libcuda.so.1")
    else:
        (lib / f"libcuda.so.{DRIVER}").write_bytes(b"\x7fELF fake libcuda\n")
    (lib / f"libnvidia-ml.so.{DRIVER}").write_text("FAKE-NVML\n")
    (path / "usr/bin").mkdir(parents=True)
    smi = path / "usr/bin/nvidia-smi"
    smi.write_text("#!/bin/sh\necho fake nvidia-smi\n")
    smi.chmod(0o755)
    (path / "dev").mkdir()
    os.mknod(path / "dev/nvidia0", 0o666 | 0o020000, os.makedev(195, 0))
    proc = path / "proc/driver/nvidia"
    proc.mkdir(parents=True)
    (proc / "version").write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {DRIVER}  Tue Jan 1 00:00:00 UTC 2025\n"
                                  "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    (proc / "params").write_text("ResmanDebugLevel: 4294967295\nModifyDeviceFiles: 1\n")
    (proc / "registry").write_text("Binary: \"\"\nModifyDeviceFiles: 1\nRmGpuComputeExecTimeout: 0\n")
    for minor, bus in enumerate(BUS_IDS):
        g = proc / "gpus" / bus
        g.mkdir(parents=True)
        (g / "information").write_text(f"Model: \t\t NVIDIA Test GPU\nIRQ:   \t\t 42\nGPU UUID: \t GPU-{minor:08d}-0000-0000-0000-000000000000\n"
                                       f"Bus Location: \t {bus}\nDevice Minor: \t {minor}\nGPU Excluded:\t No\n")
    return path


def plan_for(host: Path, *, bus: str = BUS_IDS[0], ldconfig: dict | None = None) -> dict:
    """The plan nvhook's planner would make for GPU `bus` with compute,utility on `host`."""
    sys.path.insert(0, str(REPO))
    from nvhook.decide.plan import mount

    h = str(host)
    p = f"{h}/proc/driver/nvidia"
    return {
        "container": {"id": "test", "pid": None, "rootfs": "/nonexistent"},
        "request": {"devices": ["0"], "capabilities": ["compute", "utility"], "requirements": []},
        "driver": {"version": DRIVER, "cuda": "12.2"},
        "gpus": [],
        "mounts": [
            mount("library", f"{h}{LIBDIR}/libcuda.so.{DRIVER}", f"{LIBDIR}/libcuda.so.{DRIVER}"),
            mount("library", f"{h}{LIBDIR}/libnvidia-ml.so.{DRIVER}", f"{LIBDIR}/libnvidia-ml.so.{DRIVER}"),
            mount("binary", f"{h}/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
            mount("device", f"{h}/dev/nvidia0", "/dev/nvidia0"),
            mount("tmpfs", "tmpfs", "/proc/driver/nvidia"),
            mount("procfs", f"{p}/params", "/proc/driver/nvidia/params", ("copy",)),
            mount("procfs", f"{p}/version", "/proc/driver/nvidia/version", ("copy",)),
            mount("procfs", f"{p}/registry", "/proc/driver/nvidia/registry", ("copy", "set:ModifyDeviceFiles=0")),
            mount("procfs", f"{p}/gpus/{bus}", f"/proc/driver/nvidia/gpus/{bus}"),
        ],
        "symlinks": [
            {"path": f"{LIBDIR}/libcuda.so.1", "target": f"libcuda.so.{DRIVER}"},
            {"path": f"{LIBDIR}/libcuda.so", "target": "libcuda.so.1"},
        ],
        "devices_cgroup": [{"type": "c", "major": 195, "minor": 0, "access": "rw"}],
        "compat": {"decision": "host", "reason": "test", "libraries": []},
        "ldconfig": ldconfig,
    }


# -- bundles and runc ----------------------------------------------------------------------

class Bundle:
    """An OCI bundle in `path` (config.json from `runc spec`, adjusted) running `args` in
    `rootfs` with apply_hook.py as its prestart hook."""

    def __init__(self, path: Path, rootfs: Path, plan: dict, args: list[str], *,
                 ldconfig_timeout: float | None = None):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self.plan_file = path / "plan.json"
        self.log_file = path / "events.jsonl"
        self.cgroup_file = path / "devices.list"
        self.result_file = path / "result.json"
        self.plan_file.write_text(json.dumps(plan))
        subprocess.run(["runc", "spec", "--bundle", str(path)], check=True, capture_output=True, timeout=30)
        cfg = json.loads((path / "config.json").read_text())
        proc = cfg["process"]
        proc.pop("rlimits", None)  # the sandbox refuses raised rlimits
        proc["terminal"] = False
        proc["args"] = args
        cfg["root"] = {"path": str(rootfs), "readonly": False}
        hook_args = [sys.executable, str(HOOK), str(self.plan_file), "--log", str(self.log_file),
                     "--cgroup-out", str(self.cgroup_file), "--result-out", str(self.result_file)]
        if ldconfig_timeout is not None:
            hook_args += ["--ldconfig-timeout", str(ldconfig_timeout)]
        cfg["hooks"] = {"prestart": [{"path": sys.executable, "args": hook_args,
                                      "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LD_LIBRARY_PATH=/hook-env-leak"], "timeout": 60}]}
        (path / "config.json").write_text(json.dumps(cfg, indent=1))

    def events(self) -> list[dict]:
        if not self.log_file.exists():
            return []
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line]


def host_cgroup_mode() -> str:
    """"v2" where /sys/fs/cgroup is the unified hierarchy, else "v1" (legacy or hybrid)."""
    return "v2" if _fstype("/sys/fs/cgroup") == "cgroup2" else "v1"


def _fstype(path: str) -> str | None:
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            if pre.split(" ")[4] == path:
                found = post.split(" ")[0]  # the last one listed is on top
    return found


# runc (and the hook it starts) in a private mount namespace whose /sys/fs/cgroup is the cgroup2
# hierarchy: runc then works in v2 mode (it tests statfs("/sys/fs/cgroup")) and filters
# devices with its BPF program, on a host that boots hybrid. "$@" is the runc command line.
_IN_CGROUP2 = ('mount -t cgroup2 none /sys/fs/cgroup || { echo "nvhook-test: cannot mount cgroup2" >&2; exit 125; }; '
               'exec "$@"')


def in_cgroup2(cmd: list[str]) -> list[str]:
    """`cmd` run where /sys/fs/cgroup is cgroup2: as is on a v2 host, else in a private mount
    namespace that mounts it there."""
    if host_cgroup_mode() == "v2":
        return cmd
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _IN_CGROUP2, "sh", *cmd]


def runc_run(bundle: Bundle | Path, state_root: Path, timeout: float = 60, *,
             cid: str | None = None, cgroup2: bool = False) -> subprocess.CompletedProcess:
    """`runc run` the bundle (a Bundle or a bundle directory) in the foreground, as container
    `cid` (a fresh unique id by default); the container is deleted whatever happens. With
    `cgroup2`, runc runs in cgroup v2 mode (`in_cgroup2`), its delete too."""
    cid = cid or f"nvhook-test-{uuid.uuid4().hex[:12]}"
    path = bundle.path if isinstance(bundle, Bundle) else bundle
    base = ["runc", "--root", str(state_root)]
    wrap = in_cgroup2 if cgroup2 else list
    try:
        return subprocess.run(wrap(base + ["run", "--bundle", str(path), cid]), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=timeout)
    finally:
        subprocess.run(wrap(base + ["delete", "-f", cid]), capture_output=True, timeout=30)


# -- the real hook ---------------------------------------------------------------------------

# The installed console script beside the interpreter running the tests (.venv/bin/nvhook).
NVHOOK_BIN = Path(sys.executable).with_name("nvhook")


def nvhook_bundle(path: Path, config: dict, hook_args: list[str], *, timeout: int = 60,
                  stderr_to: Path | None = None, stage: str = "prestart", hook_script: list[str] | None = None) -> Path:
    """Write `path`/config.json: the OCI `config` (e.g. make_fixtures.oci_config(...)) with the
    installed nvhook as its `stage` hook (prestart by default, or createRuntime; args[0]
    "nvhook", then `hook_args`); returns `path`.

    runc shows a hook's stderr only when the hook fails; `stderr_to` runs the same hook through
    /bin/sh with its stderr appended to that file, so a test can read what a successful hook
    said (nvhook still gets runc's state on stdin and exits with its own status). `hook_script`
    ([file, its own arguments...]) runs that Python file, then nvhook's arguments, instead of
    the console script."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(config))
    if hook_script is not None:  # a Python wrapper around nvhook's main (tests/e2e/*_hook.py)
        hook = {"path": sys.executable, "args": [sys.executable, *map(str, hook_script), *hook_args]}
    elif stderr_to is None:
        hook = {"path": str(NVHOOK_BIN), "args": ["nvhook", *hook_args]}
    else:
        quoted = " ".join(shlex.quote(a) for a in [str(NVHOOK_BIN), *hook_args])
        hook = {"path": "/bin/sh", "args": ["sh", "-c", f"exec {quoted} 2>>{shlex.quote(str(stderr_to))}"]}
    hook["timeout"] = timeout
    cfg["hooks"] = {stage: [hook]}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def hook_stderr_lines(runc_stderr: str) -> list[str]:
    """The stderr lines of a failed hook as runc reports them. runc 1.1 logs
    `msg="... error running hook: exit status 1, stdout: , stderr: nvhook: <line>\\n"`: the hook's
    newlines escaped as backslash-n and its quotes as backslash-quote inside the quoted msg."""
    out = []
    for line in runc_stderr.splitlines():
        _, sep, rest = line.partition(", stderr: ")
        if not sep:
            continue
        if rest.endswith('"'):
            rest = rest[:-1]  # the closing quote of msg="..."
        rest = rest.replace('\\"', '"')
        out.extend(part for part in rest.split("\\n") if part)
    return out


def host_mount_points() -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            out.append(line.split(" ")[4].replace("\\040", " "))
    return out


# -- whole containers with the real hook: fixture images, fixture hosts ---------------------

FIXTURES_DIR = REPO / "tests" / "fixtures"


def _make_fixtures():
    if str(FIXTURES_DIR) not in sys.path:
        sys.path.insert(0, str(FIXTURES_DIR))
    import make_fixtures

    return make_fixtures


def nvhook_skip_reason() -> str | None:
    """Why tests that run the installed nvhook in real runc containers cannot run here."""
    if os.geteuid() != 0:
        return "real containers need root"
    if not shutil.which("runc"):
        return "runc is not installed"
    if not NVHOOK_BIN.exists():
        return f"nvhook is not installed at {NVHOOK_BIN} (pip install -e .)"
    return None


def write_nvhook_config(path: Path, *, log_file: Path, cache_dir: Path, root: Path | None = None,
                        extra: str = "") -> Path:
    """An nvhook TOML config with a private log file and inventory cache (and host root)."""
    lines = [f"log_file = {json.dumps(str(log_file))}", f"cache_dir = {json.dumps(str(cache_dir))}"]
    if root is not None:
        lines.insert(0, f"root = {json.dumps(str(root))}")
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def read_events(log_file: Path) -> list[dict]:
    """Every line of an nvhook JSON log, parsed (a line that does not parse fails the test)."""
    if not log_file.exists():
        return []
    out = []
    for n, line in enumerate(log_file.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except ValueError as e:
            raise AssertionError(f"{log_file}:{n} is not JSON ({e}): {line[:200]!r}") from None
    return out


def image_env(container: str, env: dict | None = None) -> list[str]:
    """process.env of a fixture image's bundle (PATH, NVIDIA_VISIBLE_DEVICES=0,
    NVIDIA_DRIVER_CAPABILITIES=compute,utility, the image's own), with `env` merged over it
    (a None value removes the variable)."""
    mf = _make_fixtures()
    merged: dict = {}
    for item in (*mf.BUNDLE_ENV, *mf.CONTAINERS[container].env):
        k, _, v = item.partition("=")
        merged[k] = v
    for k, v in (env or {}).items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    return [f"{k}={v}" for k, v in merged.items()]


class HookRun:
    """One container started by `run_with_nvhook`: runc's result, the rootfs, nvhook's log."""

    def __init__(self, proc: subprocess.CompletedProcess, rootfs: Path, bundle: Path, log_file: Path):
        self.proc = proc
        self.rootfs = rootfs
        self.bundle = bundle
        self.log_file = log_file

    @property
    def stdout(self) -> str:
        return self.proc.stdout

    def events(self, name: str | None = None) -> list[dict]:
        evs = read_events(self.log_file)
        return evs if name is None else [e for e in evs if e["event"] == name]

    def event(self, name: str) -> dict:
        evs = self.events(name)
        assert len(evs) == 1, f"expected one {name} event, got {len(evs)}: {[e['event'] for e in self.events()]}"
        return evs[0]

    def hook_error_lines(self) -> list[str]:
        return hook_stderr_lines(self.proc.stderr)


def run_with_nvhook(tmp: Path, *, container: str = "container-debian", host: Path | None,
                    env: dict | None = None, args: list[str] | tuple = ("/bin/sh", "-c", "true"),
                    script: str | None = None, stage: str = "prestart", config_extra: str = "",
                    prepare=None, timeout: float = 60, cgroup2: bool = False, cid: str | None = None,
                    hook_script: list[str] | None = None, hooks_before: list[dict] | None = None,
                    stderr_to: Path | None = None, log_file: Path | None = None,
                    cache_dir: Path | None = None, config_cached: bool = False,
                    mounts: list[dict] | None = None) -> HookRun:
    """Start a private copy of fixture image `container` (built in `tmp`/images) with runc, the
    installed nvhook as its `stage` hook (`--root host`, a config with a log and cache in `tmp`),
    running `script` with /bin/sh (or `args`); `cache_dir` (default `tmp`/cache) is the
    config's cache_dir. `prepare(rootfs)` may alter the image first; `hooks_before` are OCI
    hooks that run before nvhook in the same stage; `stderr_to` gets nvhook's raw stderr (see
    nvhook_bundle); `log_file` replaces the log in `tmp`; `config_cached`: the config is parsed
    and cached (in NVHOOK_RUN_DIR, which the hook inherits) before the start, as any start
    after a config's first finds it. The
    container is bounded by `timeout` and deleted whatever happens."""
    mf = _make_fixtures()
    tmp.mkdir(parents=True, exist_ok=True)
    rootfs = mf.build_container(container, tmp / "images")
    if prepare is not None:
        prepare(rootfs)
    log_file = log_file or tmp / "nvhook.jsonl"
    config = write_nvhook_config(tmp / "nvhook.toml", log_file=log_file, cache_dir=cache_dir or tmp / "cache",
                                 extra=config_extra)
    if config_cached:
        from nvhook.base import config as config_mod

        config_mod.load(str(config), explicit=True)
    oci = mf.oci_config(str(rootfs), image_env(container, env))
    oci["process"]["args"] = ["/bin/sh", "-c", script] if script is not None else list(args)
    oci["mounts"] = [*oci["mounts"], *(mounts or [])]  # `mounts`: the spec's own, e.g. a volume
    hook_args = ["--config", str(config)] + (["--root", str(host)] if host is not None else []) + [stage]
    bundle = nvhook_bundle(tmp / "bundle", oci, hook_args, timeout=int(timeout), stage=stage,
                           hook_script=hook_script, stderr_to=stderr_to)
    if hooks_before:  # OCI hooks run in order: these before nvhook
        cfg = json.loads((bundle / "config.json").read_text())
        cfg["hooks"][stage] = [*hooks_before, *cfg["hooks"][stage]]
        (bundle / "config.json").write_text(json.dumps(cfg, indent=1))
    proc = runc_run(bundle, tmp / "runc-state", timeout=timeout, cgroup2=cgroup2, cid=cid)
    return HookRun(proc, rootfs, bundle, log_file)


def tree_snapshot(path: Path) -> dict:
    """{relative path: (mode, size, mtime_ns)} of everything under `path` (links not followed),
    `path` itself included as "."."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [".", *dirnames, *filenames]:
            p = os.path.join(dirpath, name) if name != "." else dirpath
            st = os.lstat(p)
            snap[os.path.relpath(p, path)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return snap


def host_mounts_under(*paths: Path | str) -> list[str]:
    """Mount points in the host's mount namespace at or under any of `paths`."""
    out = []
    for m in host_mount_points():
        for p in paths:
            p = str(p).rstrip("/")
            if m == p or m.startswith(p + "/"):
                out.append(m)
    return out


def strays(marker: str) -> list[str]:
    """Pids of the `sleep <marker>` processes still alive: what a test's fake program started,
    told apart from other runs' by its unique `marker`."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes() == f"sleep\0{marker}\0".encode():
                    out.append(pid)
            except OSError:
                pass
    return out


# -- podman with a hooks dir -----------------------------------------------------------------

SHIPPED_HOOK_JSON = REPO / "oci-hooks.d" / "nvhook.json"


def podman_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "podman tests need root"
    if not shutil.which("podman"):
        return "podman is not installed"
    if not shutil.which("runc"):
        return "runc is not installed (podman runs with --runtime runc)"
    if not NVHOOK_BIN.exists():
        return f"nvhook is not installed at {NVHOOK_BIN} (pip install -e .)"
    return None


def podman_hooks_dir(path: Path, config_file: Path) -> Path:
    """A copy of the shipped oci-hooks.d/nvhook.json in `path`, with only its hook path changed
    to the installed nvhook and NVHOOK_CONFIG pointing at `config_file`."""
    path.mkdir(parents=True, exist_ok=True)
    spec = json.loads(SHIPPED_HOOK_JSON.read_text())
    spec["hook"]["path"] = str(NVHOOK_BIN)
    env = [e for e in spec["hook"].get("env", []) if not e.startswith("NVHOOK_CONFIG=")]
    spec["hook"]["env"] = env + [f"NVHOOK_CONFIG={config_file}"] + \
        [f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}"] * ("NVHOOK_RUN_DIR" in os.environ)
    (path / "nvhook.json").write_text(json.dumps(spec, indent=2))
    return path


class Podman:
    """podman with all its state in private directories (storage, libpod tmp dir and runc's
    state under `state`; the run root, which podman wants shorter than 50 characters, in a
    fresh /tmp/nvhook-pm-* that `close()` removes), no events, no network, rlimits this sandbox
    accepts, and `hooks_dir`."""

    def __init__(self, state: Path, hooks_dir: Path):
        import tempfile

        self.state = state
        self.runroot = Path(tempfile.mkdtemp(prefix="nvhook-pm-"))
        self.base = ["podman", "--root", str(state / "storage"), "--runroot", str(self.runroot),
                     "--tmpdir", str(state / "libpod"), "--runtime", "runc",
                     "--runtime-flag", f"root={state / 'runc'}", "--cgroup-manager", "cgroupfs",
                     "--events-backend", "none", "--hooks-dir", str(hooks_dir)]

    def run(self, rootfs: Path, args: list[str], env: dict | None = None,
            timeout: float = 90) -> subprocess.CompletedProcess:
        """`podman run --rm --rootfs` bounded by `timeout`; the container is removed whatever
        happens."""
        name = f"nvhook-test-{uuid.uuid4().hex[:12]}"
        cmd = [*self.base, "run", "--rm", "--name", name, "--network", "none",
               "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += ["--rootfs", str(rootfs), *args]
        try:
            return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  errors="replace", timeout=timeout)
        finally:
            subprocess.run([*self.base, "rm", "--force", "--ignore", "--time", "0", name],
                           capture_output=True, timeout=60)

    def leftovers(self) -> list[str]:
        """Containers podman still knows about in this state dir."""
        proc = subprocess.run([*self.base, "ps", "--all", "--format", "{{.Names}}"],
                              capture_output=True, text=True, timeout=60)
        return [n for n in proc.stdout.split() if n]

    def close(self) -> None:
        shutil.rmtree(self.runroot, ignore_errors=True)


# Where a mount made by a hook could land on the host if it escaped the container: the plan's
# targets at their host paths (a CVE-2024-0132-like escape). Together with the test's own tmp
# dir (rootfs, bundles: a mount that propagated) that is what `leaked_mounts` looks at; other
# mounts appearing meanwhile belong to whatever else runs on the machine (other test sessions,
# podman storage).
ESCAPE_TARGETS = ("/usr/", "/lib/", "/lib64/", "/lib32/", "/bin/", "/sbin/", "/etc/", "/dev/nvidia",
                  "/proc/driver", "/run/nvidia", "/tmp/nvidia-mps", "/var/run/nvidia")


def mount_table() -> set[tuple[str, str, str]]:
    """The host's mounts: (mount point, root of the mount in its filesystem, "fstype source
    options") each, from /proc/self/mountinfo."""
    out = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields = pre.split(" ")
            out.add((fields[4].replace("\\040", " "), fields[3].replace("\\040", " "),
                     " ".join([fields[5], post.strip()])))
    return out


def leaked_mounts(before: set, *mine: Path | str) -> list:
    """Mounts that appeared since `before` (a mount_table()) at or under one of `mine` (the
    test's tmp dir, a fixture host it bind-mounts from) or of a mount of one of them, or at an
    ESCAPE_TARGETS path. Never the whole table: other mounts come and go on a shared machine."""
    def under(path: str) -> bool:
        return any(path == m or path.startswith(m + "/") for m in roots)

    roots = [str(m).rstrip("/") for m in mine]
    return sorted(e for e in mount_table() - before
                  if under(e[0]) or under(e[1]) or e[0].startswith(ESCAPE_TARGETS))
