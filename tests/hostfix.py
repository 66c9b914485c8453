"""Fixture hosts, containers and bundles for test_inventory, test_plan and test_cli.

The generated fixtures (tests/fixtures/rootfs, see conftest.fixtures_root) are copied once
per test session into a private directory (`fx`), so tests never see a fixture that is being
regenerated, and tests that modify a host work on their own copy (`copy_host`). Configs name
an inventory cache directory under tmp; only nvhook's parsed-config cache goes to the run's
NVHOOK_RUN_DIR (or the run's own /run/nvhook, tests/e2e/privaterun.py), one file per config path,
keyed by its identity, so tests sharing it is harmless.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))

import make_fixtures as mf  # noqa: E402

HOSTS = mf.HOSTS
CONTAINERS = ("container-debian", "container-rhel", "container-cuda113")

_SCRIPT = Path(sys.executable).with_name("nvhook")
NVHOOK = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "nvhook"]


@pytest.fixture(scope="session")
def fx(fixtures_root, tmp_path_factory) -> Path:
    """A private copy of every fixture host and two container rootfs."""
    dest = tmp_path_factory.mktemp("fx")
    with open(fixtures_root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # not while conftest regenerates them
        names = [*HOSTS, *CONTAINERS]
        subprocess.run(["cp", "-a", *(str(fixtures_root / n) for n in names), str(dest)], check=True)
    return dest


def copy_host(fx: Path, name: str, tmp_path: Path) -> Path:
    """A copy of a fixture host to modify (cp -a keeps device nodes, sockets and links)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", str(fx / name), str(tmp_path)], check=True)
    return tmp_path / name


def spec(name: str) -> mf.HostSpec:
    return HOSTS[name]


def private_dir(path: Path) -> Path:
    """A cache directory nvhook accepts: ours, mode 0700."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def config_dict(cache_dir: Path | str, *, nvml_timeout: float | None = None, **top) -> dict:
    """The effective config for in-process calls, without reading a file."""
    from nvhook.base import config

    cfg = json.loads(json.dumps(config.DEFAULTS))
    cfg["cache_dir"] = str(cache_dir)
    cfg["log_file"] = ""
    if nvml_timeout is not None:
        cfg["nvml"]["timeout"] = nvml_timeout
    cfg.update(top)
    return cfg


def write_config(path: Path, *, cache_dir: Path | str, log_file: str = "", nvml_timeout: float | None = None,
                 extra: str = "", **top) -> Path:
    """A hook.toml. Strings are written as JSON strings (valid TOML basic strings)."""
    lines = [f"cache_dir = {json.dumps(str(cache_dir))}", f"log_file = {json.dumps(log_file)}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    if nvml_timeout is not None:
        lines += ["[nvml]", f"timeout = {nvml_timeout}"]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


def scratch_config(d: Path) -> Path:
    """d/hook.toml with the defaults, its cache in d/cache and no log file."""
    return write_config(d / "hook.toml", cache_dir=private_dir(d / "cache"))


def bundle(path: Path, rootfs: Path | str, env=(), *, privileged: bool = False, mounts=()) -> Path:
    """An OCI bundle at `path` (config.json as runc spec writes it) for the rootfs."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = mf.oci_config(str(rootfs), ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *env])
    if privileged:
        cfg["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    cfg["mounts"].extend(mounts)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def state(bundle_dir: Path | str, *, pid: int | None = None, cid: str = "test") -> str:
    return json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": pid,
                       "bundle": str(bundle_dir), "annotations": {}})


def nvhook(*args: str, stdin: str | None = None, env: dict | None = None, timeout: float = 60,
           **kw) -> subprocess.CompletedProcess:
    """Run the installed console script; NVHOOK_CONFIG comes only from `env`."""
    e = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    e.update(env or {})
    return subprocess.run([*NVHOOK, *args], input=stdin if stdin is not None else "", capture_output=True,
                          text=True, env=e, timeout=timeout, **kw)


def config_check(path: Path, text: str, *args: str) -> subprocess.CompletedProcess:
    """`nvhook config check [args] PATH` of a hook.toml written with `text`."""
    path.write_text(text)
    return nvhook("config", "check", *args, str(path))


def in_fork(fn):
    """fn() in a forked child (for what changes namespaces, capabilities, ids or the working
    directory: never this test process); what it returned comes back as JSON, an exception
    as {"raised": "Type: message"}."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports through the pipe
        try:
            os.close(r)
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 - reported to the test
                out = {"raised": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def events(log_file: Path | str) -> list[dict]:
    """The JSON log lines nvhook wrote (each line must be a complete JSON object)."""
    p = Path(log_file)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines()]


def named(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


def assert_one_line_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """What a user sees when nvhook refuses: exactly one stderr line 'nvhook: ...' naming the
    problem, the given exit code, no traceback, nothing on stdout."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("nvhook: "), line
    for n in needles:
        assert n in line, (n, line)
    assert proc.stdout == ""
    return line


def tree_snapshot(root: Path) -> dict:
    """Everything observable about a tree without following links: to prove nothing changed."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            link = os.readlink(p) if os.path.islink(p) else None
            snap[os.path.relpath(p, root)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino, st.st_rdev, link)
    return snap


def lib_names(libraries: list[dict], kind: str = "library") -> set[str]:
    return {lib["name"] for lib in libraries if lib["kind"] == kind}


def remove_path(p: Path) -> None:
    if p.is_symlink() or p.is_file() or p.is_socket() or p.is_char_device():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p)


def assert_schema(p: dict) -> None:
    """Exactly the keys of the schema in nvhook/plan.py's docstring, at every level."""
    from nvhook.decide.plan import KINDS

    keys = {"container", "request", "driver", "gpus", "mounts", "symlinks", "devices_cgroup", "compat", "ldconfig"}
    keys |= {"app_profile"} if "app_profile" in p else set()
    assert set(p) == (keys | {"cgroup"} if p["devices_cgroup"] else keys)
    assert isinstance(p.get("app_profile", ""), str)
    if p["devices_cgroup"]:
        assert set(p["cgroup"]) == {"mode", "action"} and p["cgroup"]["mode"] in ("v1", "v2", "none")
    assert set(p["container"]) == {"id", "pid", "rootfs"}
    assert isinstance(p["container"]["id"], str) and os.path.isabs(p["container"]["rootfs"])
    assert p["container"]["pid"] is None or isinstance(p["container"]["pid"], int)
    assert set(p["request"]) == {"devices", "capabilities", "requirements"}
    assert all(isinstance(p["request"][k], list) for k in p["request"])
    assert set(p["driver"]) == {"version", "cuda"}
    for g in p["gpus"]:
        assert set(g) == {"index", "minor", "uuid", "bus_id", "model", "brand", "brand_source"}
    for m in p["mounts"]:
        base = {"kind", "source", "target", "options"}
        assert set(m) == (base | {"node"} if m["kind"] == "device" else base)
        assert m["kind"] in KINDS and isinstance(m["options"], list)
        if m["kind"] == "device":  # the host node as it is: number, permission bits, owner
            assert set(m["node"]) == {"major", "minor", "mode", "uid", "gid"}
            st = os.stat(m["source"])
            assert (m["node"]["major"], m["node"]["minor"]) == (os.major(st.st_rdev), os.minor(st.st_rdev))
            assert (m["node"]["mode"], m["node"]["uid"], m["node"]["gid"]) == \
                (st.st_mode & 0o7777, st.st_uid, st.st_gid)
    for s in p["symlinks"]:
        assert set(s) == {"path", "target"}
    for r in p["devices_cgroup"]:
        assert set(r) == {"type", "major", "minor", "access"}
        assert r["type"] == "c" and r["access"] == "rw"
        assert isinstance(r["major"], int) and isinstance(r["minor"], int)
    assert set(p["compat"]) == {"decision", "reason", "libraries"}
    assert p["compat"]["decision"] in ("host", "image", "none") and isinstance(p["compat"]["reason"], str)
    if p["ldconfig"] is not None:
        assert set(p["ldconfig"]) == {"binary", "directories"}


def processes() -> dict[int, list[str]]:
    """{pid: the fields of /proc/<pid>/stat after the command name} for every process."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    out[int(pid)] = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
    return out


def have_openat2() -> bool:
    """Whether this kernel has openat2 (5.6+): the tests of both path-resolution modes skip the
    openat2 one without it."""
    import errno

    from nvhook.base import sandbox

    try:
        os.close(sandbox.openat2(os.open("/", os.O_PATH), ".", os.O_PATH, 0, sandbox.RESOLVE_IN_ROOT))
    except OSError as e:
        return e.errno != errno.ENOSYS
    return True
