"""nvhook-runtime in front of real runc (and crun): what a GPU container sees, what happens to
config.json, and what the wrapper leaves alone.

Each container is a private copy of the Debian fixture image, run by the installed
.venv/bin/nvhook-runtime with `run --bundle B id` (as Docker/containerd call the runtime), a
config naming the 8-GPU fixture host as root, and runc's state in tmp; it is deleted whatever
happens. Opening a device node tells the device cgroup's answer without a GPU: ENXIO ("No such
device or address") = allowed, no driver behind it; EPERM = denied (tests/e2e/gpuview.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from gpuview import LIBCUDA, L, line  # noqa: E402
from gpuview import SCRIPT as USER_VIEW
from gpuview import assert_gpu0 as assert_gpu0_view

from nvhook.start import runtime  # noqa: E402

WRAPPER = Path(sys.executable).with_name("nvhook-runtime")

needs_runc = pytest.mark.skipif(rb.nvhook_skip_reason() is not None or not WRAPPER.exists(),
                                reason=rb.nvhook_skip_reason() or "nvhook-runtime is not installed")

class Box:
    """A bundle for the Debian fixture image on host-gpu8 and the commands to run it."""

    def __init__(self, tmp: Path, host: Path, env: dict | None, script: str, *, bundle_name: str = "bundle",
                 indent="\t", annotations: dict | None = None, hooks: dict | None = None, config_extra: str = ""):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.rootfs = mf.build_container("container-debian", tmp / "images")
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "nvhook.toml", log_file=self.log, cache_dir=tmp / "cache",
                                             root=host, extra=config_extra)
        oci = mf.oci_config(str(self.rootfs), rb.image_env("container-debian", env))
        oci["process"]["args"] = ["/bin/sh", "-c", script]
        if annotations:
            oci["annotations"] = annotations
        if hooks:
            oci["hooks"] = hooks
        self.bundle = tmp / bundle_name
        self.bundle.mkdir()
        text = json.dumps(oci, indent=indent) + "\n" if indent is not None else json.dumps(oci, separators=(",", ":"))
        (self.bundle / "config.json").write_text(text)
        self.original = (self.bundle / "config.json").read_bytes()
        self.state = tmp / "runc-state"

    def env(self, **extra) -> dict:
        e = {k: v for k, v in os.environ.items() if k not in ("NVHOOK_CONFIG", "NVHOOK_RUNTIME")}
        e["NVHOOK_CONFIG"] = str(self.config)
        e.update(extra)
        return e

    def run(self, *, args: list[str] | None = None, cwd: Path | None = None, runtime_env: dict | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        cid = f"nvhook-rt-{uuid.uuid4().hex[:10]}"
        argv = [str(WRAPPER), "--root", str(self.state), *(args or ["run", "--bundle", str(self.bundle)]), cid]
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                                  env=self.env(**(runtime_env or {})), cwd=cwd, timeout=timeout)
        finally:
            subprocess.run(["runc", "--root", str(self.state), "delete", "-f", cid], capture_output=True, timeout=30)

    def spec(self) -> dict:
        return json.loads((self.bundle / "config.json").read_text())

    def events(self, name: str | None = None) -> list[dict]:
        evs = rb.read_events(self.log)
        return evs if name is None else [e for e in evs if e["event"] == name]


def run_in_cgroup2(box: Box, front: str, runtime: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`front run` of the box's bundle in a private mount namespace with cgroup2 on
    /sys/fs/cgroup (checked mounted), the container deleted by `runtime` afterwards."""
    cid = f"nvhook-rt-{uuid.uuid4().hex[:10]}"
    inner = (f"mount -t cgroup2 none /sys/fs/cgroup && grep -q ' /sys/fs/cgroup cgroup2 ' /proc/mounts && "
             f"{front} --root {box.state} run --bundle {box.bundle} {cid}; rc=$?; "
             f"{runtime} --root {box.state} delete -f {cid} >/dev/null 2>&1; exit $rc")
    return subprocess.run(["unshare", "-m", "sh", "-c", inner], capture_output=True, text=True, env=env, timeout=90,
                          stdin=subprocess.DEVNULL)


def without_additions(spec: dict, original: dict) -> dict:
    """`spec` with every list entry the wrapper appended removed (and containers it created)."""
    out = json.loads(json.dumps(spec))
    out["mounts"] = out["mounts"][:len(original["mounts"])]
    lin, olin = out["linux"], original["linux"]
    for key in ("devices",):
        if key in olin:
            lin[key] = lin[key][:len(olin[key])]
        else:
            del lin[key]
    lin["resources"]["devices"] = lin["resources"]["devices"][:len(olin["resources"]["devices"])]
    if "hooks" not in original:
        del out["hooks"]
    return out


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


@needs_runc
def test_gpu_container_through_the_wrapper(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW)
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    spec = box.spec()
    original = json.loads(box.original)
    # nodes with the host's numbers, mode and owner; allow rules after the spec's deny-all
    host_node = os.stat(gpu8 / "dev/nvidia0")
    node = next(d for d in spec["linux"]["devices"] if d["path"] == "/dev/nvidia0")
    assert node == {"path": "/dev/nvidia0", "type": "c", "major": os.major(host_node.st_rdev),
                    "minor": os.minor(host_node.st_rdev), "fileMode": host_node.st_mode & 0o7777,
                    "uid": host_node.st_uid, "gid": host_node.st_gid}
    assert "/dev/nvidia1" not in {d["path"] for d in spec["linux"]["devices"]}
    rules = spec["linux"]["resources"]["devices"]
    assert rules[0] == {"allow": False, "access": "rwm"}
    assert {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"} in rules[1:]
    binds = {m["destination"]: m for m in spec["mounts"][len(original["mounts"]):]}
    assert binds[f"{L}/{LIBCUDA}"]["source"] == str(gpu8) + f"{L}/{LIBCUDA}"
    assert "ro" in binds[f"{L}/{LIBCUDA}"]["options"] and binds[f"{L}/{LIBCUDA}"]["type"] == "bind"
    # one hook, nvhook beside the wrapper (run by its venv's interpreter with -IS: the flags
    # pip dropped from its #! line), in-container only, an explicit environment
    py = str(WRAPPER.with_name("python"))
    assert open(WRAPPER.with_name("nvhook")).readline() == f"#!{py}\n"
    assert spec["hooks"] == {"prestart": [{"path": py,
                                           "args": [py, "-IS", str(WRAPPER.with_name("nvhook")), "--config",
                                                    str(box.config), "--in-container-only", "prestart"],
                                           "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                                                   # where the tests keep nvhook's config cache
                                                   f"NVHOOK_RUN_DIR={os.environ['NVHOOK_RUN_DIR']}"]}]}
    # every field it does not own kept: values, order, and the file's own formatting
    assert without_additions(spec, original) == original
    assert list(spec) == list(original) + ["hooks"]
    assert (json.dumps(without_additions(spec, original), indent="\t") + "\n").encode() == box.original
    # the hook did only the in-container part
    start = box.events("hook.start")[0]
    assert start["in_container_only"] is True
    done = box.events("hook.done")[0]
    assert not [t for t in done["mounted"] if t.startswith(("/dev/", L, "/usr/bin/"))], done["mounted"]
    assert box.events("apply.done")[0]["devices"] == 0
    edited = box.events("runtime.edited")[0]
    assert edited["devices"] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0"]


@needs_runc
def test_no_gpu_request_leaves_config_json_byte_identical(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": None}, "echo STARTED; ls /dev")
    st = os.stat(box.bundle / "config.json")
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert "STARTED" in p.stdout and "nvidia" not in p.stdout
    assert (box.bundle / "config.json").read_bytes() == box.original
    st2 = os.stat(box.bundle / "config.json")
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # not even rewritten
    assert not box.events("runtime.edited")


@needs_runc
def test_void_request_and_a_compact_spec(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "void"}, "echo STARTED", indent=None)
    p = box.run()
    assert p.returncode == 0 and "STARTED" in p.stdout, p.stderr
    assert (box.bundle / "config.json").read_bytes() == box.original
    assert box.events("runtime.unchanged")


@needs_runc
def test_compact_go_style_spec_stays_compact(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW, indent=None)
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    text = (box.bundle / "config.json").read_bytes()
    assert b"\n" not in text
    original = json.loads(box.original)
    kept = without_additions(json.loads(text), original)
    assert json.dumps(kept, separators=(",", ":")).encode() == box.original


@needs_runc
def test_bundle_directory_named_create(tmp_path, gpu8):
    """`--bundle create`: the directory is called "create"; also the bundle given as -b=create
    relative to the working directory."""
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW, bundle_name="create")
    p = box.run(args=["run", "--bundle", "create"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    box2 = Box(tmp_path / "two", gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW, bundle_name="create")
    p = box2.run(args=["run", "-b=create"], cwd=tmp_path / "two")
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)


@needs_runc
def test_unknown_device_one_line_nothing_written_nothing_started(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "9"}, "touch /started; echo STARTED")
    p = box.run()
    assert p.returncode == 1
    assert p.stderr.splitlines() == [p.stderr.strip()]
    assert p.stderr.startswith("nvhook-runtime: unknown device '9' in NVIDIA_VISIBLE_DEVICES"), p.stderr
    assert "STARTED" not in p.stdout and not (box.rootfs / "started").exists()
    assert (box.bundle / "config.json").read_bytes() == box.original
    assert sorted(os.listdir(box.bundle)) == ["config.json"]  # no temp file left
    assert box.events("runtime.failed")[0]["error"] == p.stderr.strip().split(": ", 1)[1]
    # containerd's shim reads a failed runtime's reason from --log (runc's JSON lines), not stderr
    for fmt in ("json", "text"):
        log = tmp_path / f"runc-log.{fmt}"
        p = box.run(args=["--log", str(log), "--log-format", fmt, "create", "--bundle", str(box.bundle)])
        assert p.returncode == 1
        entry = log.read_text().splitlines()[-1]
        if fmt == "json":
            e = json.loads(entry)
            assert (e["level"], e["msg"]) == ("error", p.stderr.strip())
        else:
            assert entry.endswith(f"level=error msg={json.dumps(p.stderr.strip())}")
    assert (box.bundle / "config.json").read_bytes() == box.original


@needs_runc
def test_dockers_gpus_hook_is_replaced_not_doubled(tmp_path, gpu8):
    """What `docker run --gpus` writes (a prestart hook named nvidia-container-runtime-hook)
    through the wrapper: one nvhook hook, in its place, and each library mounted once. Run on
    an already edited spec again, the wrapper adds nothing."""
    other = {"path": "/bin/true", "args": ["true"]}
    hooks = {"prestart": [other, {"path": "/usr/bin/nvidia-container-runtime-hook",
                                  "args": ["nvidia-container-runtime-hook", "prestart"]}]}
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW, hooks=hooks)
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    first = box.spec()
    assert first["hooks"]["prestart"][0] == other
    assert [h["args"][:3] for h in first["hooks"]["prestart"]] == [
        ["true"], [str(WRAPPER.with_name("python")), "-IS", str(WRAPPER.with_name("nvhook"))]]
    p = box.run()  # the same bundle again: the spec already carries everything
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    assert box.spec() == first


@needs_runc
def test_cdi_annotation_is_a_request(tmp_path, gpu8):
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": None}, USER_VIEW,
              annotations={"cdi.k8s.io/devices": "vendor.example/foo=1,nvidia.com/gpu=0"})
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    assert box.events("request")[0]["source"] == "cdi-annotations"


@pytest.mark.skipif(not shutil.which("crun"), reason="crun is not installed")
@needs_runc
def test_crun_as_the_real_runtime(tmp_path, gpu8):
    """crun chosen by the config. crun refuses this machine's hybrid cgroups and cannot raise
    RLIMIT_MEMLOCK for its device program in this sandbox, so it runs in a cgroup2 mount
    namespace with its cgroup manager off: the mounts, nodes and hook are what is checked."""
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW,
              config_extra='[runtime]\npath = "crun"\n')
    p = run_in_cgroup2(box, f"{WRAPPER} --cgroup-manager disabled", "crun", box.env())
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    assert box.events("runtime.edited")[0]["runtime"] == "crun"
    assert box.events("hook.done")[0]["result"] == "ok"


@needs_runc
def test_cgroup_v2_mode_nodes_give_enxio(tmp_path, gpu8):
    """runc in real cgroup v2 mode (cgroup2 on /sys/fs/cgroup in a private mount namespace):
    the device program runc builds from the spec's rules lets the container open its nodes.
    The same spec without nvhook's allow rules gives EPERM: the rules are what does it."""
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW)
    p = run_in_cgroup2(box, str(WRAPPER), "runc", box.env())
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    spec = box.spec()
    spec["linux"]["resources"]["devices"] = [r for r in spec["linux"]["resources"]["devices"] if not r["allow"]]
    spec["hooks"] = {}
    spec["process"]["args"] = ["/bin/sh", "-c", "echo \"OPEN0:$(head -c 1 /dev/nvidia0 2>&1)\""]
    (box.bundle / "config.json").write_text(json.dumps(spec))
    p = run_in_cgroup2(box, "runc", "runc")
    assert line(p.stdout, "OPEN0:") == "head: /dev/nvidia0: Operation not permitted"


@needs_runc
def test_pass_through_execs_the_runtime_unchanged(tmp_path):
    """state/list/delete of a container that does not exist: the wrapper's output and exit
    status are runc's own, byte for byte (but for the second in runc's own time= field: the two
    runs may straddle a second on a busy machine); a missing runtime is one line."""
    import re

    def unstamped(b: bytes) -> bytes:
        return re.sub(rb'^time="[^"]*" ', b'time="T" ', b, flags=re.M)

    state = tmp_path / "st"
    for args in (["state", "nope"], ["list"], ["delete", "nope"]):
        want = subprocess.run(["runc", "--root", str(state), *args], capture_output=True, timeout=30)
        got = subprocess.run([str(WRAPPER), "--root", str(state), *args], capture_output=True, timeout=30)
        assert (got.returncode, got.stdout, unstamped(got.stderr)) == \
            (want.returncode, want.stdout, unstamped(want.stderr)), args
    env = {**os.environ, "NVHOOK_RUNTIME": str(tmp_path / "no-such-runtime")}
    got = subprocess.run([str(WRAPPER), "state", "x"], capture_output=True, text=True, env=env, timeout=30)
    assert got.returncode == 127
    assert got.stderr == (f"nvhook-runtime: cannot run the OCI runtime '{tmp_path}/no-such-runtime': "
                          "it does not exist (not installed, or not in PATH)\n")


def test_pass_through_imports_nothing(tmp_path):
    """The wrapper's pass-through path loads no module of its own beyond nvhook.start.runtime (and
    the two packages above it, whose __init__ is a docstring)."""
    fake = tmp_path / "fake-runtime"
    fake.write_text("#!/bin/sh\necho \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "NVHOOK_RUNTIME": str(fake), "PYTHONVERBOSE": "1"}
    p = subprocess.run([str(WRAPPER), "--root", "/x", "kill", "id", "KILL"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert p.stdout == "--root /x kill id KILL\n"
    imported = [ln.split()[1].strip("'") for ln in p.stderr.splitlines() if ln.startswith("import ") and "#" in ln]
    ours = [m for m in imported if m.startswith("nvhook")]
    assert ours == ["nvhook", "nvhook.start", "nvhook.start.runtime"], ours
    assert not {"json", "_json", "tomllib", "tomli", "re", "click"} & set(imported)


@pytest.mark.parametrize("argv, command, bundle, cid", [
    (["create", "--bundle", "/b", "id"], "create", "/b", "id"),
    (["--root", "create", "create", "--bundle", "create", "c1"], "create", "create", "c1"),
    (["--log", "/l", "--log-format", "json", "--systemd-cgroup", "create", "-b", "/x", "--pid-file", "/p", "c"],
     "create", "/x", "c"),
    (["--root=/r", "run", "--detach", "--bundle=/y", "--console-socket", "/s", "c"], "run", "/y", "c"),
    (["create", "--pid-file", "--bundle", "c"], "create", None, "c"),  # a pid file named --bundle
    (["--debug", "start", "c"], "start", None, None),
    (["state"], "state", None, None),
])
def test_argv_scan(argv, command, bundle, cid):
    i = runtime.command_index(argv)
    assert argv[i] == command
    if command in ("create", "run"):
        b, c, _ = runtime.create_args(argv, i + 1)
        assert (b, c) == (bundle, cid)


def test_runtime_key_scan_agrees_with_toml(tmp_path):
    from nvhook.base import tomlread

    cases = ['[runtime]\npath = "crun"\n',
             '# c\n[ldconfig]\npath = "/sbin/ldconfig"\n[runtime]  # x\npath="/usr/bin/crun"\n',
             '[ldconfig]\npath = "/sbin/ldconfig"\n', 'root = "/"\n']
    for text in cases:
        f = tmp_path / "c.toml"
        f.write_text(text)
        want = tomlread.loads(text).get("runtime", {}).get("path")
        assert runtime.scan_runtime_key(str(f)) == want, text


@needs_runc
def test_swarm_resource_variable_is_a_request(tmp_path, gpu8):
    """request.swarm_resource: Docker swarm's DOCKER_RESOURCE_GPU names the GPU; the wrapper's
    cheap pre-check must not take the spec for one without a GPU request (issue 14)."""
    box = Box(tmp_path, gpu8, {"NVIDIA_VISIBLE_DEVICES": None, "DOCKER_RESOURCE_GPU": "0"}, USER_VIEW,
              config_extra='[request]\nswarm_resource = "DOCKER_RESOURCE_GPU"\n')
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert_gpu0_view(p.stdout)
    assert box.events("request")[0]["source"] == "DOCKER_RESOURCE_GPU"


@needs_runc
@pytest.mark.parametrize("args", [["--version"], ["-v"], ["--help"], ["--root", "/tmp/x", "--help"], ["help"]])
def test_version_and_help_name_nvhook_first(tmp_path, args):
    """`nvhook-runtime --version` / `--help`: a line naming nvhook and its version, then the
    real runtime's own output, byte for byte. Docker parses `--version` keeping the last line
    with "version" in it: runc's, so `docker info` still shows runc's version and commit."""
    import nvhook

    want = subprocess.run(["runc", *args], capture_output=True, timeout=30)
    got = subprocess.run([str(WRAPPER), *args], capture_output=True, timeout=30)
    assert got.returncode == want.returncode and got.stderr == want.stderr
    first, _, rest = got.stdout.partition(b"\n")
    if "--version" in args or "-v" in args:
        assert first.decode() == (f"nvhook-runtime version {nvhook.__version__} (nvhook's OCI runtime wrapper; "
                                  "the real runtime: runc)")
        assert rest == want.stdout
        last = [ln for ln in got.stdout.decode().splitlines() if "version" in ln][-1]
        assert last.startswith("runc version ")
    else:
        assert first.decode().startswith(f"nvhook-runtime {nvhook.__version__}: nvhook's OCI runtime wrapper.")
        assert rest == b"\n" + want.stdout


@needs_runc
@pytest.mark.parametrize("uid", [1000, 0])
def test_non_root_container_gets_the_group_of_a_0660_node(tmp_path, fixtures_root, uid):
    """A site that makes /dev/nvidia0 0660 root:video (gid 44): a container running as a user
    gets the group in process.user.additionalGids and opens the node (ENXIO: allowed, no driver
    behind it); without that group the same container gets EACCES. A root container needs no
    group and gets none."""
    host = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(host)], check=True)
    os.chmod(host / "dev/nvidia0", 0o660)
    os.chown(host / "dev/nvidia0", 0, 44)
    script = 'echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; echo "CTL:$(head -c 1 /dev/nvidiactl 2>&1)"; id'
    box = Box(tmp_path / "box", host, {"NVIDIA_VISIBLE_DEVICES": "0"}, script)
    oci = box.spec()
    oci["process"]["user"] = {"uid": uid, "gid": uid}
    (box.bundle / "config.json").write_text(json.dumps(oci, indent="\t") + "\n")
    p = box.run()
    assert p.returncode == 0, p.stderr
    assert line(p.stdout, "OPEN0:") == "head: /dev/nvidia0: No such device or address", p.stdout
    assert line(p.stdout, "CTL:") == "head: /dev/nvidiactl: No such device or address"
    user = box.spec()["process"]["user"]
    if uid == 0:
        assert "additionalGids" not in user
        return
    assert user["additionalGids"] == [44]
    assert "44" in p.stdout.split("groups=", 1)[1], p.stdout
    assert box.events("runtime.edited")[0]["additional_gids"] == [44]
    # the same container without the group: the node's mode is what refuses it
    spec = box.spec()
    spec["process"]["user"] = {"uid": uid, "gid": uid}
    spec["process"]["args"] = ["/bin/sh", "-c", script]
    (box.bundle / "config.json").write_text(json.dumps(spec))
    cid = f"nvhook-rt-{uuid.uuid4().hex[:10]}"
    try:
        p = subprocess.run(["runc", "--root", str(box.state), "run", "--bundle", str(box.bundle), cid],
                           capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=box.env())
    finally:
        subprocess.run(["runc", "--root", str(box.state), "delete", "-f", cid], capture_output=True, timeout=30)
    assert line(p.stdout, "OPEN0:") == "head: /dev/nvidia0: Permission denied", p.stdout + p.stderr


@needs_runc
def test_warnings_go_to_the_runtime_log_and_the_journal_never_stderr(tmp_path, gpu8):
    """A GPU container whose nvhook log cannot be written still gets its GPU; the wrapper's
    stderr (under a shim: the container's own log) stays empty; the runtime's --log file gets
    the warning in runc's text format; the run's events go to the journal instead of the lost
    log (a stand-in journal socket: the wrapper's main run with JOURNAL_SOCKET pointed at it)."""
    import socket

    (tmp_path / "a-file").write_text("")
    lost = tmp_path / "a-file" / "nvhook.jsonl"  # its directory is a file: cannot be created
    box = Box(tmp_path / "box", gpu8, {"NVIDIA_VISIBLE_DEVICES": "0"}, USER_VIEW)
    box.config.write_text(box.config.read_text().replace(str(box.log), str(lost)))
    journal = tmp_path / "journal.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(journal))
    runtime_log = tmp_path / "runtime.log"
    cid = f"nvhook-rt-{uuid.uuid4().hex[:10]}"
    code = ("import sys\nfrom nvhook.base import log\nlog.JOURNAL_SOCKET = sys.argv[1]\n"
            "sys.argv[0] = sys.argv[2]\nfrom nvhook.start.runtime import main\nsys.exit(main(sys.argv[3:]))\n")
    try:
        p = subprocess.run([sys.executable, "-c", code, str(journal), str(WRAPPER), "--root", str(box.state),
                            "--log", str(runtime_log), "--log-format", "text", "run", "--bundle", str(box.bundle),
                            cid], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=box.env(),
                           timeout=60)
    finally:
        subprocess.run(["runc", "--root", str(box.state), "delete", "-f", cid], capture_output=True, timeout=30)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert_gpu0_view(p.stdout)
    ours = [ln for ln in runtime_log.read_text().splitlines() if "nvhook-runtime: " in ln]
    assert len(ours) == 1 and " level=warning msg=" in ours[0], ours
    assert f"cannot open log file {lost}" in ours[0] and "the container's edits were not affected" in ours[0]
    server.setblocking(False)  # the wrapper has exited: what it sent is queued
    got = []
    try:
        while True:
            got.append(server.recv(1 << 20).decode())
    except BlockingIOError:
        pass
    server.close()
    events = [line.split("=", 1)[1] for entry in got for line in entry.splitlines()
              if line.startswith("NVHOOK_EVENT=")]
    assert "runtime.edited" in events and events[-1] == "log.unwritable", events
    assert not lost.exists()
