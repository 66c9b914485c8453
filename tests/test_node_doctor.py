"""`nvhook doctor --node --prefix DIR` on a fake node tree in tmp (never this machine's /etc):
a node set up as node install leaves it has no problem and exits 0; each fault an operator
meets (a broken config, a log the hook cannot write, NVIDIA's leftovers, a runtime registered
under another name, CRI-O's drop-in order, a stale or second CDI spec, NRI off, hook stages with
the wrong owner or modes) is one line naming it with its fix, and exit 5; `--format json` lists
the same. Then the same leftovers as one warning line from `setup`, `runtime configure` and
`cdi generate`, and `config check` on a log file that cannot be written.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hostfix import nvhook

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "rootfs"
DRIVER = "535.261.03"
LIB = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{DRIVER}"
RT = "/opt/nvhook/bin/nvhook-runtime"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the hook stages' owner and group need root to set")


def put(node: Path, path: str, text: str = "", mode: int = 0o644) -> Path:
    p = node / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.chmod(mode)
    return p


def spec(driver: str = DRIVER) -> str:
    lib = LIB.replace(DRIVER, driver)
    return json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                       "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
                       "containerEdits": {"mounts": [{"hostPath": lib, "containerPath": lib, "options": ["ro"]}],
                                          "hooks": [{"hookName": "createContainer", "path": "/opt/nvhook/bin/nvhook",
                                                     "args": ["nvhook", "--cdi", "compute,utility", "createContainer"]}]}})


def make_node(node: Path) -> Path:
    """A node as `nvhook node install` leaves it, with the three engines registered as `nvidia`."""
    put(node, "/etc/nvhook/hook.toml", 'root = "/"\nlog_file = "/var/log/nvhook.log"\n')
    (node / "var/log").mkdir(parents=True)
    shutil.copytree(FIXTURES / "host-gpu8" / "proc/driver/nvidia", node / "proc/driver/nvidia", symlinks=True)
    put(node, LIB, "ELF")
    put(node, "/dev/nvidia0")
    put(node, "/etc/cdi/nvhook.json", spec())
    for f in ("nvhook", "nvhook-runtime"):
        put(node, f"/opt/nvhook/bin/{f}", "#!/usr/bin/python3\n", 0o755)
    put(node, "/usr/bin/python3", "ELF", 0o755)
    put(node, "/etc/docker/daemon.json", json.dumps({"runtimes": {"nvidia": {"path": RT}}}, indent=2))
    put(node, "/etc/containerd/config.toml", 'version = 2\nimports = ["/etc/containerd/conf.d/99-nvhook.toml"]\n')
    put(node, "/etc/containerd/conf.d/99-nvhook.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        'runtime_type = "io.containerd.runc.v2"\n'
        f'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\nBinaryName = "{RT}"\n')
    put(node, "/etc/crio/crio.conf.d/99-nvhook.conf",
        f'[crio.runtime.runtimes.nvidia]\nruntime_path = "{RT}"\nruntime_type = "oci"\n')
    put(node, "/etc/containers/oci/hooks.d/nvhook.json",
        json.dumps({"version": "1.0.0", "hook": {"path": "/opt/nvhook/bin/nvhook", "args": ["nvhook", "prestart"]},
                    "when": {"always": True}, "stages": ["prestart"]}))
    put(node, "/etc/group", "root:x:0:\nnogroup:x:65534:\nnvhook-hook:x:997:\n")
    put(node, "/etc/gshadow", "root:*::\nnvhook-hook:!::\n")
    put(node, "/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n")
    if os.geteuid() == 0:
        for f in ("python3", "sh"):
            p = put(node, f"/opt/nvhook/libexec/{f}", "copy", 0o700)
            os.chown(p, 0, 997)
            p.chmod(0o2711)
    return node


def doctor(node: Path, *args: str):
    return nvhook("doctor", "--node", "--prefix", str(node), *args)


@pytest.fixture
def node(tmp_path) -> Path:
    return make_node(tmp_path / "node")


def test_a_node_as_install_leaves_it_has_no_problem(node):
    p = doctor(node)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"nvhook doctor --node under {node}: no problems found\n", "")
    j = doctor(node, "--format", "json")
    assert j.returncode == 0 and json.loads(j.stdout)["problems"] == []


def _log_symlink(n):
    (n / "var/log/nvhook.log").symlink_to("/etc/shadow")


def _log_foreign(n):
    os.chown(put(n, "/var/log/nvhook.log", "", 0o640), 1000, 1000)


def _nri(n, containerd: str, unit_socket: str = "/var/run/nri/nri.sock"):
    put(n, "/etc/systemd/system/nvhook-nri.service",
        f"[Service]\nExecStart=/opt/nvhook/bin/nvhook nri --socket {unit_socket}\n")
    (n / "etc/systemd/system/multi-user.target.wants").mkdir(parents=True, exist_ok=True)
    (n / "etc/systemd/system/multi-user.target.wants/nvhook-nri.service").symlink_to(
        "/etc/systemd/system/nvhook-nri.service")
    put(n, "/etc/containerd/config.toml", containerd)


FAULTS = {
    "config-not-toml": (lambda n: put(n, "/etc/nvhook/hook.toml", "[devices\n"),
                        "/etc/nvhook/hook.toml: config /etc/nvhook/hook.toml is not valid TOML",
                        "fix it, then `nvhook config check /etc/nvhook/hook.toml`"),
    "config-unknown-key": (lambda n: put(n, "/etc/nvhook/hook.toml", 'log_levl = "debug"\n'),
                           "unknown key 'log_levl'", "fix it, then `nvhook config check"),
    "log-symlink": (_log_symlink, "/var/log/nvhook.log: is a symbolic link (to /etc/shadow)", "remove the link"),
    "log-no-directory": (lambda n: put(n, "/etc/nvhook/hook.toml", 'log_file = "/var/log/nvhook/hook.log"\n'),
                         "its directory /var/log/nvhook does not exist", "mkdir -p /var/log/nvhook"),
    "log-not-roots": (_log_foreign, "is owned by uid 1000, not root", "chown root:root /var/log/nvhook.log"),
    "docker-other-name": (lambda n: put(n, "/etc/docker/daemon.json", json.dumps({"runtimes": {"nvhook": {"path": RT}}})),
                          "/etc/docker/daemon.json: nvhook-runtime is registered as nvhook, not 'nvidia'",
                          "`nvhook runtime configure --runtime docker` (registers 'nvidia'"),
    "docker-nvidias-beside": (lambda n: put(n, "/etc/docker/daemon.json", json.dumps(
        {"runtimes": {"nvidia": {"path": RT}, "nvidia-cdi": {"path": "/usr/bin/nvidia-container-runtime.cdi"}}})),
        "NVIDIA's runtime 'nvidia-cdi' (/usr/bin/nvidia-container-runtime.cdi) is still registered",
        "remove runtimes.nvidia-cdi from /etc/docker/daemon.json"),
    "containerd-dropin-broken": (lambda n: put(n, "/etc/containerd/conf.d/99-nvhook.toml", "[plugins\n"),
                                 "/etc/containerd/conf.d/99-nvhook.toml: is not valid TOML", "fix the file"),
    "crio-nvidia-sorts-after": (lambda n: put(n, "/etc/crio/crio.conf.d/99-nvidia.conf",
                                              '[crio.runtime.runtimes.nvidia]\n'
                                              'runtime_path = "/usr/bin/nvidia-container-runtime"\n'),
                                "/etc/crio/crio.conf.d/99-nvidia.conf: sorts after 99-nvhook.conf and sets the runtime "
                                "'nvidia' to /usr/bin/nvidia-container-runtime",
                                "remove /etc/crio/crio.conf.d/99-nvidia.conf (NVIDIA's drop-in)"),
    "nvidias-hooks-file": (lambda n: put(n, "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json", json.dumps(
        {"version": "1.0.0", "hook": {"path": "/usr/bin/nvidia-container-toolkit", "args": ["nvidia-container-toolkit",
                                                                                          "prestart"]}})),
        "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json: NVIDIA's OCI hook is still installed beside "
        "nvhook's /etc/containers/oci/hooks.d/nvhook.json", "remove /usr/share/containers/oci/hooks.d/oci-nvidia-hook"),
    "second-cdi-spec": (lambda n: put(n, "/etc/cdi/nvidia.yaml", "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n"),
                        "/etc/cdi/nvidia.yaml: declares nvidia.com/gpu as nvhook's /etc/cdi/nvhook.json does",
                        "remove /etc/cdi/nvidia.yaml"),
    "stale-cdi-spec": (lambda n: put(n, "/proc/driver/nvidia/version",
                                     "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar 5 2024\n"),
                       f"/etc/cdi/nvhook.json: is stale: made for driver {DRIVER}, the node has 550.54.15",
                       "nvhook cdi generate --output /etc/cdi/nvhook.json"),
    "cdi-spec-names-a-gone-file": (lambda n: (n / LIB.lstrip("/")).unlink(),
                                   f"/etc/cdi/nvhook.json: is stale: it names {LIB}, which the node no longer has",
                                   "nvhook cdi generate"),
    "nri-off": (lambda n: _nri(n, "version = 2\n"), "/etc/containerd/config.toml: containerd has NRI off",
                "nvhook runtime enable-nri --runtime containerd"),
    "nri-other-socket": (lambda n: _nri(n, 'version = 3\n[plugins."io.containerd.nri.v1.nri"]\n'
                                           'socket_path = "/run/nri/other.sock"\n'),
                         "containerd listens for NRI plugins on /run/nri/other.sock, the plugin connects to "
                         "/var/run/nri/nri.sock", "nvhook node install --nri again"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_one_line_with_its_fix(node, fault):
    make, says, fix = FAULTS[fault]
    if fault == "log-not-roots" and os.geteuid() != 0:
        pytest.skip("chown needs root")
    make(node)
    p = doctor(node)
    assert p.returncode == 5 and p.stderr == "", p.stderr
    lines = p.stdout.splitlines()
    assert lines[-1] == f"nvhook doctor --node under {node}: 1 problem", p.stdout
    (line,) = lines[:-1]
    assert says in line and f"; fix: {fix}" in line, line
    assert str(node) not in line  # the node's own paths, as an operator there types them
    (j,) = json.loads(doctor(node, "--format", "json").stdout)["problems"]
    assert line == f"{j['path']}: {j['problem']}; fix: {j['fix']}"


@as_root
@pytest.mark.parametrize("mode,owner,says", [
    (0o755, (0, 997), "is not set-group-ID (mode 755)"),
    (0o2711, (0, 0), "is set-group-ID root: anyone who runs it gets gid 0"),
    (0o2711, (1000, 997), "is owned by uid 1000, not root"),
    (0o2773, (0, 997), "is writable by others (mode 2773)"),
    (0o2711, (0, 65534), "is set-group-ID 65534 and executable by everyone"),
    (0o2711, (0, 42), "is set-group-ID gid 42, not nvhook-hook's (997)"),
])
def test_hook_stages_owner_and_modes(node, mode, owner, says):
    stage = node / "opt/nvhook/libexec/sh"
    os.chown(stage, *owner)
    stage.chmod(mode)
    p = doctor(node)
    assert p.returncode == 5, p.stdout
    (line,) = p.stdout.splitlines()[:-1]
    assert line.startswith(f"/opt/nvhook/libexec/sh: {says}") and "; fix: nvhook node install again" in line, line


@as_root
def test_a_hook_group_with_members(node):
    put(node, "/etc/group", "root:x:0:\nnvhook-hook:x:997:alice\n")
    p = doctor(node)
    assert p.returncode == 5
    assert p.stdout.splitlines()[0] == ("/etc/group: the group nvhook-hook it has members (alice): whoever is in it "
                                        "gets what the set-group-ID hook stages give; fix: take them out: gpasswd -d "
                                        "USER nvhook-hook")


def test_every_problem_at_once_and_usage(node):
    for fault, (make, _says, _fix) in FAULTS.items():
        if fault not in ("log-not-roots", "nri-other-socket"):
            make(node)
    p = doctor(node)
    assert p.returncode == 5 and p.stdout.splitlines()[-1].endswith("problems"), p.stdout
    assert len(p.stdout.splitlines()) - 1 == len(json.loads(doctor(node, "--format", "json").stdout)["problems"])
    # NVIDIA's spec alone conflicts with nothing: where nvhook has no spec, it is not reported
    assert "nvidia.yaml" in p.stdout
    (node / "etc/cdi/nvhook.json").unlink()
    assert "nvidia.yaml" not in doctor(node).stdout
    bad = nvhook("doctor", "--node", "--bundle", str(node))
    assert bad.returncode == 2 and bad.stderr.startswith("nvhook: --node checks the node"), bad.stderr
    missing = nvhook("doctor", "--node", "--prefix", str(node / "nope"))
    assert missing.returncode == 1 and missing.stderr.startswith(f"nvhook: --prefix {node / 'nope'} is")


def test_a_planted_link_never_leads_the_checks_out_of_the_prefix(node, tmp_path):
    """The node's absolute links resolve inside its root: an imports entry or a CDI dir that
    is a link to / reads the node's files, never this machine's."""
    outside = tmp_path / "outside"
    put(outside, "/etc/cdi/nvidia.yaml", "kind: nvidia.com/gpu\n")
    shutil.rmtree(node / "etc/cdi")
    (node / "etc/cdi").symlink_to(f"{outside}/etc/cdi")  # absolute: inside the node, a path that is not there
    put(node, "/etc/containerd/config.toml", f'version = 2\nimports = ["{outside}/etc/cdi/*.yaml"]\n')
    p = doctor(node)
    assert "nvidia.yaml" not in p.stdout and p.returncode == 0, p.stdout


# -- the same leftovers, one warning line from the command whose change meets them ----------------

def test_runtime_configure_warns_about_nvidias_runtime_left_beside(tmp_path):
    daemon = put(tmp_path, "/daemon.json", json.dumps({"runtimes": {
        "nvidia": {"path": "nvidia-container-runtime"},  # rewritten by configure: nothing to say
        "nvidia-legacy": {"path": "/usr/bin/nvidia-container-runtime.legacy"}}}))
    p = nvhook("runtime", "configure", "--runtime", "docker", "--config", str(daemon), "--runtime-path", RT)
    assert p.returncode == 0
    assert p.stderr == (f"nvhook: warning: {daemon}: NVIDIA's runtime 'nvidia-legacy' "
                        "(/usr/bin/nvidia-container-runtime.legacy) is still registered beside nvhook's (nvidia): pods "
                        "or containers that name it get NVIDIA's injection; fix: remove runtimes.nvidia-legacy from "
                        f"{daemon}\n")
    assert json.loads(daemon.read_text())["runtimes"]["nvidia"] == {"path": RT}
    clean = put(tmp_path, "/clean.json", "{}")
    p = nvhook("runtime", "configure", "--runtime", "docker", "--config", str(clean), "--runtime-path", RT)
    assert p.returncode == 0 and p.stderr == ""


def test_runtime_configure_warns_when_a_crio_dropin_sorts_after_its_own(tmp_path):
    d = tmp_path / "crio.conf.d"
    put(d, "/99-nvidia.conf", '[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/nvidia-container-runtime"\n')
    for dry in (["--dry-run"], []):
        p = nvhook("runtime", "configure", "--runtime", "crio", "--config", str(d / "99-nvhook.conf"),
                   "--runtime-path", RT, *dry)
        assert p.returncode == 0
        (line,) = p.stderr.splitlines()
        assert line.startswith(f"nvhook: warning: {d}/99-nvidia.conf: sorts after 99-nvhook.conf and sets the "
                               "runtime 'nvidia' to /usr/bin/nvidia-container-runtime"), line
    (d / "99-nvidia.conf").rename(d / "10-nvidia.conf")  # sorts first: nvhook's wins, nothing to say
    p = nvhook("runtime", "configure", "--runtime", "crio", "--config", str(d / "99-nvhook.conf"), "--runtime-path", RT)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_setup_warns_about_nvidias_hooks_file(tmp_path):
    theirs = put(tmp_path, "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json", json.dumps(
        {"version": "1.0.0", "hook": {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["x", "prestart"]}}))
    p = nvhook("setup", "--prefix", str(tmp_path), "--hook-path", "/opt/nvhook/bin/nvhook")
    assert p.returncode == 0
    assert p.stderr == ("nvhook: warning: /usr/share/containers/oci/hooks.d/oci-nvidia-hook.json: NVIDIA's OCI hook "
                        "is still installed beside nvhook's /etc/containers/oci/hooks.d/nvhook.json: podman and CRI-O "
                        "run both, and both inject the driver; fix: remove "
                        "/usr/share/containers/oci/hooks.d/oci-nvidia-hook.json\n")
    theirs.unlink()
    p = nvhook("setup", "--prefix", str(tmp_path), "--hook-path", "/opt/nvhook/bin/nvhook")
    assert p.returncode == 0 and p.stderr == ""


def test_cdi_generate_warns_about_a_second_spec_of_its_kind(tmp_path, fixtures_root):
    out = tmp_path / "cdi" / "nvhook.json"
    other = put(tmp_path, "/cdi/nvidia.yaml", "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n")
    put(tmp_path, "/cdi/other-vendor.yaml", "cdiVersion: 0.5.0\nkind: vendor.example/fpga\n")
    cfg = put(tmp_path, "/hook.toml", f'log_file = ""\ncache_dir = "{tmp_path / "cache"}"\n')
    p = nvhook("--config", str(cfg), "--root", str(fixtures_root / "host-gpu8"), "cdi", "generate", "--output", str(out))
    assert p.returncode == 0, p.stderr
    # (a venv under /root also gets hookreach's warning that other users cannot run the hook)
    warned = [ln for ln in p.stderr.splitlines() if ln.startswith("nvhook: warning:")
              and not ln.startswith("nvhook: warning: hook ")]
    assert warned == [f"nvhook: warning: {other}: declares nvidia.com/gpu as nvhook's {out} does: engines refuse a "
                      "device name defined twice (or take either spec's); fix: remove "
                      f"{other}, and stop what writes it (nvidia-ctk cdi generate, the toolkit's nvidia-cdi-refresh)"]
    assert json.loads(out.read_text())["kind"] == "nvidia.com/gpu"


@pytest.mark.parametrize("case", ["symlink", "no-directory"])
def test_config_check_says_when_the_log_cannot_be_written(tmp_path, case):
    """A hook-mode log that cannot be written loses every start's events silently (runc drops
    the hook's stderr): `config check` says so, exit 0 (the file may be meant for another
    machine), 1 with --strict, as for a root that is not a driver root."""
    log = tmp_path / "logs" / "nvhook.log"
    if case == "symlink":
        log.parent.mkdir()
        log.symlink_to(tmp_path / "elsewhere.log")
    cfg = put(tmp_path, "/hook.toml", f'log_file = "{log}"\nroot = "{FIXTURES / "host-gpu8"}"\n')
    p = nvhook("config", "check", str(cfg))
    assert p.returncode == 0 and p.stdout == f"{cfg}: ok (1 warning)\n", p.stdout + p.stderr
    says = "is a symbolic link" if case == "symlink" else f"its directory {log.parent} does not exist"
    assert p.stderr.startswith(f"warning: log_file = '{log}': {says}") and "; fix: " in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 1
    assert nvhook("config", "check", "--strict", str(cfg)).returncode == 1
    log.unlink(missing_ok=True)
    log.parent.mkdir(exist_ok=True)
    p = nvhook("config", "check", str(cfg))
    assert (p.returncode, p.stdout, p.stderr) == (0, f"{cfg}: ok\n", "")


def test_a_spec_hook_others_cannot_run_is_named(tmp_path):
    """Rootless engines and user-namespaced containers run the spec's hook as an unprivileged
    uid: a hook whose interpreter sits under a 0700 directory fails their starts with only
    "fork/exec ...: permission denied". doctor --node names it; links are followed inside the
    prefix only (an absolute link to /root/venv is the node's /root, not this machine's)."""
    node = make_node(tmp_path / "node")
    put(node, "/root/venv/bin/python", "ELF", 0o755)
    (node / "root").chmod(0o700)
    put(node, "/opt/nvhook/bin/nvhook", "#!/root/venv/bin/python\n", 0o755)
    p = nvhook("doctor", "--node", "--prefix", str(node), "--format", "json")
    assert p.returncode == 5, p.stdout + p.stderr
    lines = [x["problem"] for x in json.loads(p.stdout)["problems"] if x["check"] == "cdi"]
    assert lines == ["hook /opt/nvhook/bin/nvhook: its interpreter /root/venv/bin/python cannot be run by other "
                     "users: /root is mode 0700, closed to other users (rootless engines and user-namespaced "
                     "containers run it as an unprivileged uid)"], lines
    (node / "root").chmod(0o755)
    (node / "usr/bin/python3").unlink()
    (node / "usr/bin/python3").symlink_to("/root/venv/bin/python")  # inside the prefix: the node's /root
    put(node, "/opt/nvhook/bin/nvhook", "#!/usr/bin/python3\n", 0o755)
    p = nvhook("doctor", "--node", "--prefix", str(node), "--format", "json")
    assert [x for x in json.loads(p.stdout)["problems"] if x["check"] == "cdi"] == [], p.stdout
