"""Rootless podman 5 on the node (5.8 on sid, 5.4 on trixie), runc and crun, as a real
unprivileged user with subordinate ids: the user exists only in the node's own /etc (its
overlay's; written for this module and put back byte for byte after it), podman's state is the
user's (storage under the node's /var/lib/containers, run dir /run/user/UID), and nvhook is the
one `nvhook node install` put in /opt/nvhook, run by the node's python3 as that user:

- CDI: the spec the install wrote (/etc/cdi/nvhook.json, its hook nvhook's), with
  `--userns=keep-id` and `--user 1000`; a `--no-hook` spec `nvhook cdi generate` writes;
- NVIDIA's spec (nvidia-ctk 1.18 and 1.20, built outside the repo by
  bench/build_reference_cdi.sh; skipped without NVHOOK_REFERENCE_CDI) pointed at the
  nvidia-cdi-hook the install put in /opt/nvhook/bin (its set-group-ID stage copies, mode 2711);
- hook mode: the hooks file `nvhook setup` writes, a CUDA image asking for every GPU, no
  `--device`: it starts, its device cgroup skipped with one `cgroups.skipped` warning;
- the hook's events in the user's own ~/.local/state/nvhook/hook.log (the node has no journal),
  none in root's log.

Each command runs under `unshare --mount` in the node, then as the user (setpriv): there the
namespace gets a /dev of its own with the fixture host's nvidia nodes (a rootless runtime binds
each node from its container path, /dev/nvidiaN; the node's /dev is the machine's, never
written) and, for crun (it refuses a hybrid hierarchy), cgroup2 on /sys/fs/cgroup. Opening a
node gives ENXIO ("No such device or address"): usable, no driver behind it. The fixture host
(the driver root) is a read-only mount in the node, as a node's driver root may be.
"""

from __future__ import annotations

import json
import shlex
import shutil

import cdihookbox
import pytest
import rootlessbox
from gpuprobe import CAPS, GPUS, LIBCUDA, SCRIPT, L, View, assert_gpus
from images import CUDA113, DEBIAN
from node import HOST_ROOT, NVHOOK, NVHOOK_LOG

NAME = "nvrl"
UID = 2000  # the node's first free ids (its root has system users only)
SUBID = 200000  # user's subordinate range: 200000-265535
HOME = f"/home/{NAME}"
USER_LOG = f"{HOME}/.local/state/nvhook/hook.log"
SETUP = "/run/nvhook-test/podman-rootless-setup"  # the hooks file, under a prefix: not the node's /etc
HOOKS_DIR = f"{SETUP}/etc/containers/oci/hooks.d"
# The `--no-hook` spec under a kind of its own beside the install's nvidia.com/gpu, in the other
# directory podman reads (podman 5.4 has no --cdi-spec-dir, and reads no cdi_spec_dirs from a
# containers.conf override)
NO_HOOK_SPEC = "/run/cdi/nvhook-no-hook.json"
NO_HOOK_KIND = "nohook.nvhook.test/gpu"
IMAGES = "/nvhook/rootless-images"
USER_FILES = ("passwd", "group", "subuid", "subgid")
RUNTIMES = ["runc", "crun"]
ENXIO = "No such device or address"
FIXTURE_WARNINGS = {"procfs.emulated"}  # the fixture host has no kernel module: said on every start
PROBE = SCRIPT + "echo ID:$(id -u)\n"
CDI_HOOK = "/opt/nvhook/bin/nvidia-cdi-hook"  # where `nvhook node install` put it


class Rootless:
    """The user's podman with `runtime` on node `n`: its own run dir (so its own pause process,
    whose namespaces later commands join) and storage."""

    def __init__(self, n, runtime: str):
        self.n = n
        self.runtime = runtime
        self.run_dir = f"/run/user/{UID}-{runtime}"
        self.state = state = f"/var/lib/containers/{NAME}-{runtime}"
        for d in (self.run_dir, state):
            n.run(["install", "-d", "-m", "0700", "-o", str(UID), "-g", str(UID), d])
        self.base = ["podman", "--root", f"{state}/storage", "--runroot", f"{self.run_dir}/containers",
                     "--tmpdir", f"{self.run_dir}/libpod", "--storage-driver", "overlay", "--runtime", runtime,
                     "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
        if runtime == "crun":  # its namespace's cgroup2 has no controller a user may write
            self.base += ["--runtime-flag", "cgroup-manager=disabled"]

    def command(self, argv: list[str], env: dict | None = None) -> list[str]:
        pre = [rootlessbox.dev_script(f"{HOST_ROOT}/dev", f"/run/nvhook-test/devns-{self.runtime}", None)]
        if self.runtime == "crun":
            pre.append("mount -t cgroup2 none /sys/fs/cgroup")
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": HOME, "USER": NAME, "LOGNAME": NAME,
               "XDG_RUNTIME_DIR": self.run_dir, "PODMAN_IGNORE_CGROUPSV1_WARNING": "1", **(env or {})}
        script = " && ".join(pre) + ' || { echo "nvhook-test: namespace setup failed" >&2; exit 125; }; exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                "setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups",
                "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]

    def podman(self, *args: str, timeout: float = 120, env: dict | None = None):
        return self.n.run(self.command([*self.base, *args], env), check=False, timeout=timeout)

    def run(self, image: str, script: str, *args: str, env: dict | None = None):
        envs = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
        return self.podman("run", "--rm", "--network", "none", *envs, *args, image, "sh", "-c", script)

    def close(self) -> None:
        """Kill its pause process (the user's containers are gone: each run is --rm), remove its state."""
        self.n.sh(f"for f in $(find {shlex.quote(self.run_dir)} -name pause.pid); do kill -KILL $(cat $f); done; true",
                  check=False)
        self.n.run(["rm", "-rf", self.run_dir, self.state], check=False)


@pytest.fixture(scope="module")
def user(engines_node, node_inputs):
    """The user in the node's /etc (the files as they were put back afterwards), the images
    handed in, the hooks file and the `--no-hook` spec."""
    n = engines_node
    before = {f: (n.path(f"/etc/{f}").read_bytes() if n.path(f"/etc/{f}").exists() else None) for f in USER_FILES}
    made = [n.path(HOME), n.dir / "share/rootless-images"]
    podmans: dict[str, Rootless] = {}
    try:
        for f, line in (("passwd", f"{NAME}:x:{UID}:{UID}::{HOME}:/bin/sh"), ("group", f"{NAME}:x:{UID}:"),
                        ("subuid", f"{NAME}:{SUBID}:65536"), ("subgid", f"{NAME}:{SUBID}:65536")):
            text = (before[f] or b"").decode()
            n.write(f"/etc/{f}", text + ("" if not text or text.endswith("\n") else "\n") + line + "\n")
        n.run(["install", "-d", "-m", "0700", "-o", str(UID), "-g", str(UID), HOME])
        share = n.dir / "share/rootless-images"
        share.mkdir(mode=0o755)
        (n.dir / "share").chmod(0o755)
        for ref in (DEBIAN, CUDA113):
            dst = share / node_inputs[ref].name
            shutil.copyfile(node_inputs[ref], dst)
            dst.chmod(0o644)
        n.run([NVHOOK, "setup", "--prefix", SETUP, "--hook-path", NVHOOK])
        n.run([NVHOOK, "--root", HOST_ROOT, "cdi", "generate", "--no-hook", "--output", "/run/nvhook-test/no-hook.json"])
        spec = json.loads(n.read("/run/nvhook-test/no-hook.json"))
        edits = [spec.get("containerEdits", {}), *(d.get("containerEdits", {}) for d in spec["devices"])]
        assert spec["kind"] == "nvidia.com/gpu" and not [h for e in edits for h in e.get("hooks", [])], spec
        n.write(NO_HOOK_SPEC, json.dumps({**spec, "kind": NO_HOOK_KIND}))
        n.run(["chmod", "-R", "a+rX", "/run/nvhook-test"])

        def podman(runtime: str) -> Rootless:
            if runtime not in podmans:
                p = podmans[runtime] = Rootless(n, runtime)
                for ref in (DEBIAN, CUDA113):
                    r = p.podman("load", "-q", "-i", f"{IMAGES}/{node_inputs[ref].name}", timeout=300)
                    assert r.returncode == 0, r.stdout + r.stderr
            return podmans[runtime]

        yield podman
    finally:
        for p in podmans.values():
            p.close()
        for f, data in before.items():
            if data is None:
                n.remove(f"/etc/{f}")
            else:
                n.write(f"/etc/{f}", data)
        n.remove(NO_HOOK_SPEC)
        for d in made:
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)


class Log:
    """The user's own hook log and root's, read before a run: `new()` gives what the run added."""

    def __init__(self, n):
        self.n = n
        self.user_at = self._size(USER_LOG)
        self.root_at = self._size(NVHOOK_LOG)

    def _size(self, p: str) -> int:
        f = self.n.path(p)
        return f.stat().st_size if f.exists() else 0

    def new(self) -> list[dict]:
        f = self.n.path(USER_LOG)
        text = f.read_bytes()[self.user_at:].decode() if f.exists() else ""
        # nothing of a rootless run reaches root's log: the user cannot write it
        assert self._size(NVHOOK_LOG) == self.root_at
        return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def warnings(evs: list[dict]) -> list[str]:
    return [e["event"] for e in evs if e["level"] in ("warning", "error") and e["event"] not in FIXTURE_WARNINGS]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("extra", [(), ("--userns=keep-id",), ("--user", "1000")], ids=["root", "keep-id", "user1000"])
def test_nvhook_spec(engines_node, user, runtime, extra):
    """The install's CDI spec: the node (ENXIO: usable), the host's libcuda loaded through the
    cache nvhook's CDI hook wrote, the driver read-only; the hook ran as the user and left its
    events in the user's own log (and the log is the user's)."""
    p = user(runtime)
    log = Log(engines_node)
    r = p.run(DEBIAN, PROBE, "--device", "nvidia.com/gpu=0", *extra, env={"NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert r.returncode == 0, r.stdout + r.stderr
    v = View(r.stdout)
    assert_gpus(v, [GPUS[0]])
    assert v.one("ID") == {"--userns=keep-id": str(UID), "--user": "1000"}.get(extra[0] if extra else "", "0")
    evs = log.new()
    assert [e["result"] for e in evs if e["event"] == "hook.done"] == ["ok"], evs
    assert warnings(evs) == [], evs
    for f in (engines_node.path(USER_LOG), engines_node.path(USER_LOG).parent):
        assert (f.stat().st_uid, f.stat().st_gid) == (UID, UID), f


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_no_hook_spec(engines_node, user, runtime):
    """`nvhook cdi generate --no-hook`: the nodes and the libraries at their SONAMEs, nothing run
    in the container, nothing logged."""
    p = user(runtime)
    log = Log(engines_node)
    r = p.run(DEBIAN, 'echo "OPEN0:$(head -c 1 /dev/nvidia0 2>&1)"; /usr/bin/cuda-probe', "--device", f"{NO_HOOK_KIND}=0")
    assert r.returncode == 0, r.stdout + r.stderr
    v = View(r.stdout)
    assert v.one("OPEN0") == f"head: /dev/nvidia0: {ENXIO}", r.stdout
    assert v.one("path") == f"{L}/libcuda.so.1", r.stdout
    assert log.new() == []


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_hook_mode_cuda_image_without_device_starts(engines_node, user, runtime):
    """The hooks file `nvhook setup` writes, a CUDA image asking for every GPU and no
    `--device`: the hook mounts the driver and binds the nodes it found, skips the device cgroup
    (the user namespace's root cannot write it) with one warning, and the container starts."""
    p = user(runtime)
    log = Log(engines_node)
    r = p.run(CUDA113, PROBE, "--hooks-dir", HOOKS_DIR,
              env={"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": CAPS})
    assert r.returncode == 0, r.stdout + r.stderr
    v = View(r.stdout)
    nodes = {d for d in v.devices if d[len("nvidia"):].isdigit()}
    assert nodes == {f"nvidia{g.minor}" for g in GPUS}, v.out
    for d in (*sorted(nodes), "nvidiactl"):
        assert v.opens[f"/dev/{d}"] == ENXIO, v.out
    assert v.probe.get("path") == f"{L}/{LIBCUDA}", v.out  # the host's libcuda, loaded
    evs = log.new()
    skipped = [e for e in evs if e["event"] == "cgroups.skipped"]
    assert len(skipped) == 1 and skipped[0]["level"] == "warning", evs
    assert f"host uid {UID}" in skipped[0]["message"] and "user namespace" in skipped[0]["message"], skipped
    assert warnings(evs) == ["cgroups.skipped"], evs
    assert [e["result"] for e in evs if e["event"] == "hook.done"] == ["ok"], evs


@pytest.fixture
def ref(tag):
    """NVIDIA's build for `tag`; skips, before the node is built, where it is missing (CI)."""
    built = cdihookbox.reference(tag)
    if built is None:
        pytest.skip(f"NVIDIA's nvidia-ctk {tag} is not built: run bench/build_reference_cdi.sh DIR TOOLKIT_GIT and set "
                    "NVHOOK_REFERENCE_CDI=DIR")
    return built


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("tag", ["v1.18.0", "v1.20.0"])
def test_nvidia_spec_with_nvhooks_cdi_hook(ref, engines_node, user, fixtures_root, tmp_path, runtime, tag):
    """NVIDIA's spec as nvidia-ctk writes it for the fixture host, its hook path nvhook's
    nvidia-cdi-hook (the install's set-group-ID stage copies, run by the user): the GPU asked for
    by NVIDIA's device name (its index) has its node (ENXIO: usable), the loader cache lists the host's
    libcuda and a CUDA program loads it; every hook entry of the spec ran, as the user (its
    events in the user's log). The spec's kind is changed, so that it sits beside the install's
    nvidia.com/gpu spec; nothing else but the host's path (1.20's generator reads a fake NVML
    without MIG, see cdihookbox.nvml_without_mig)."""
    n = engines_node
    assert n.path(CDI_HOOK).is_file(), "node install put no nvidia-cdi-hook on the node"
    host = fixtures_root / "host-gpu8"
    g = cdihookbox.nvidia_ctk_generate(ref, host, CDI_HOOK, env=cdihookbox.nvml_without_mig(host, tmp_path) if tag >= "v1.19" else None)
    assert g.returncode == 0, g.stderr
    text = g.stdout
    for machine_path in {str(host.resolve()), str(host)}:
        text = text.replace(machine_path, HOST_ROOT)
    spec = json.loads(text)
    spec["kind"] = kind = f"ctk{tag[1:].replace('.', '')}.nvidia.test/gpu"
    hooks = spec["containerEdits"].get("hooks", [])
    assert hooks and all(h["path"] == CDI_HOOK for h in hooks), hooks
    gpu = next(x for x in GPUS if x.mig_mode != "1")  # a MIG-enabled GPU's names are its instances'
    assert str(gpu.index) in {d["name"] for d in spec["devices"]}, spec["devices"]
    path = f"/run/cdi/{kind.split('/')[0]}.json"  # /var/run/cdi: a directory the user's podman reads
    n.write(path, json.dumps(spec))
    n.run(["chmod", "0644", path])
    try:
        p = user(runtime)
        log = Log(n)
        r = p.run(DEBIAN, PROBE, "--device", f"{kind}={gpu.index}")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        n.remove(path)
    v = View(r.stdout)
    assert {d for d in v.devices if d[len("nvidia"):].isdigit()} == {f"nvidia{gpu.minor}"}, v.out
    for d in (f"nvidia{gpu.minor}", "nvidiactl"):
        assert v.opens[f"/dev/{d}"] == ENXIO, v.out
    assert v.one("LDCONFIG") == f"libcuda.so.1 (libc6,x86-64) => {L}/libcuda.so.1", v.out
    assert v.probe.get("path") == f"{L}/{LIBCUDA}", v.out  # the host's libcuda, loaded
    evs = log.new()
    assert len([e for e in evs if e["event"] == "cdi_hook.done"]) == len(hooks), evs
    assert warnings(evs) == [], evs
