"""`nvhook cdi generate | list | check` on the fixture hosts, run as a user runs them (the
installed console script, its exit code, stdout and stderr), and the pure parts of the CDI
model (decide.cdimodel): device names, cdiVersion, the request read back from linux.devices.

Drift is made the way it happens: a copy of the 8-GPU host (`cp -a`, device nodes included) is
changed after the spec was written (driver upgraded, a library deleted, nvidia-uvm's dynamic
major moved, a GPU gone); GPUs and MIG devices that appeared since are a spec that lacks them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.apply import cdispec  # noqa: E402
from nvhook.decide import cdimodel as cdi  # noqa: E402

NVHOOK = rb.NVHOOK_BIN


def nvhook(*args: str, config: Path | None = None, root: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    pre = (["--config", str(config)] if config else []) + (["--root", str(root)] if root else [])
    return subprocess.run([str(NVHOOK), *pre, *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "nvhook.jsonl",
                                  cache_dir=tmp_path / "cache",
                                  extra=f'[cdi]\nspec = "{tmp_path / "etc-cdi" / "nvhook.json"}"\n')


@pytest.fixture
def host_copy(tmp_path: Path, fixtures_root: Path) -> Path:
    dst = tmp_path / "host"
    subprocess.run(["cp", "-a", str(fixtures_root / "host-gpu8"), str(dst)], check=True)
    return dst


def names(spec: dict) -> list[str]:
    return [d["name"] for d in spec["devices"]]


# -- generate ------------------------------------------------------------------------------

def test_generate_gpu8(tmp_path, cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    out = tmp_path / "spec.json"
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[-1] == f"wrote {out}: 25 devices, cdiVersion 0.5.0"
    spec = json.loads(out.read_text())
    assert spec["kind"] == "nvidia.com/gpu" and spec["cdiVersion"] == "0.5.0"
    gpus = mf.HOSTS["host-gpu8"].gpus
    expected = []
    for g in gpus:
        expected += [str(g.index), g.uuid]
        for m in g.migs:
            expected += [f"{g.index}:{m.slot}", m.uuid]
    assert names(spec) == expected + ["all"]
    by = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    node0 = os.stat(host / "dev/nvidia0")
    assert by["0"] == [{"path": "/dev/nvidia0", "hostPath": str(host / "dev/nvidia0"), "type": "c", "major": 195,
                        "minor": 0, "fileMode": node0.st_mode & 0o777, "permissions": "rw", "uid": 0, "gid": 0}]
    assert by["0"] == by[gpus[0].uuid]
    # a MIG device: its parent's node and its GI and CI access capability nodes
    mig = by["0:1"]
    assert [n["path"] for n in mig][0] == "/dev/nvidia0" and len(mig) == 3
    assert all(n["path"].startswith("/dev/nvidia-caps/nvidia-cap") for n in mig[1:])
    assert [n["path"] for n in by["all"]] == [f"/dev/nvidia{g.minor}" for g in gpus]
    edits = spec["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    L = "/usr/lib/x86_64-linux-gnu"
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert mounts[f"{L}/libcuda.so.{mf.DRIVER_535}"] == {
        "hostPath": str(host) + f"{L}/libcuda.so.{mf.DRIVER_535}", "containerPath": f"{L}/libcuda.so.{mf.DRIVER_535}",
        "type": "bind", "options": ["ro", "nosuid", "nodev", "bind"]}
    assert "/usr/bin/nvidia-smi" in mounts
    assert not [p for p in mounts if "libnvidia-glcore" in p or "i386" in p]  # compute,utility only
    assert edits["hooks"] == [{"hookName": "createContainer", "path": str(NVHOOK),
                               "args": ["nvhook", "--config", str(cfg), "--root", str(host), "--cdi",
                                        "compute,utility", "createContainer"],
                               "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "timeout": 60}]


def test_graphics_spec_gives_each_gpu_its_own_drm_nodes(tmp_path, cfg, fixtures_root):
    """With graphics, each GPU's device carries its /dev/dri card and render nodes (found by its
    PCI address in sysfs, never the BMC's card0 or another GPU's), `all` every GPU's, a MIG
    device none; the spec-wide part has no DRM node. The by-path links are the hook's work."""
    host = fixtures_root / "host-gpu8"
    out = tmp_path / "spec.json"
    p = nvhook("cdi", "generate", "--capabilities", "compute,utility,graphics", "--output", str(out),
               config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    spec = json.loads(out.read_text())
    by = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    hs = mf.HOSTS["host-gpu8"]
    for g in hs.gpus:
        want = [f"/dev/nvidia{g.minor}"] + [f"/dev/dri/{name}" for name, _ in mf.drm_nodes(hs, g)]
        assert [n["path"] for n in by[str(g.index)]] == want
        assert by[g.uuid] == by[str(g.index)]
        for n, (_, minor) in zip(by[str(g.index)][1:], mf.drm_nodes(hs, g)):
            assert (n["major"], n["minor"], n["permissions"]) == (226, minor, "rw")
            assert n["hostPath"] == str(host) + n["path"]
    assert not [n for n in by["0:1"] if n["path"].startswith("/dev/dri/")]
    assert sorted(n["path"] for n in by["all"] if n["path"].startswith("/dev/dri/")) == sorted(
        f"/dev/dri/{name}" for g in hs.gpus for name, _ in mf.drm_nodes(hs, g))
    edits = spec["containerEdits"]
    assert not [n for n in edits["deviceNodes"] if n["path"].startswith("/dev/dri/")]
    mounts = {m["containerPath"] for m in edits["mounts"]}
    assert {"/etc/OpenCL/vendors/nvidia.icd", "/usr/share/nvidia/nvoptix.bin",
            "/usr/share/vulkan/icd.d/nvidia_icd.json"} <= mounts
    assert "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf" not in mounts  # display only
    assert nvhook("cdi", "check", str(out), config=cfg, root=host).returncode == 0
    # the default spec (compute,utility): no DRM node anywhere, the OpenCL ICD file with libnvidia-opencl
    p = nvhook("cdi", "generate", config=cfg, root=host)
    plain = json.loads(p.stdout)
    assert "/dev/dri/" not in p.stdout
    assert "/etc/OpenCL/vendors/nvidia.icd" in {m["containerPath"] for m in plain["containerEdits"]["mounts"]}


def test_graphics_spec_check_sees_a_renumbered_drm_node(tmp_path, cfg, host_copy):
    out = tmp_path / "spec.json"
    assert nvhook("cdi", "generate", "--capabilities", "graphics,compute,utility", "--output", str(out),
                  config=cfg, root=host_copy).returncode == 0
    # the kernel numbered GPU 1's render node differently after a reload
    bus = mf.HOSTS["host-gpu8"].gpus[1].bus_id
    (host_copy / "dev/dri/renderD129").unlink()
    os.mknod(host_copy / "dev/dri/renderD129", 0o020666, os.makedev(226, 140))
    (host_copy / "sys/devices/pci0000:00" / bus / "drm/renderD129/dev").write_text("226:140\n")
    p = nvhook("cdi", "check", str(out), config=cfg, root=host_copy)
    assert p.returncode == 1
    assert "device numbers: /dev/dri/renderD129 (nvidia.com/gpu=1) is 226:129 in the spec, 226:140 on the host" \
        in p.stdout + p.stderr


def test_generate_refuses_a_spec_without_the_driver_libraries(tmp_path, cfg, host_copy):
    """A driver root nvhook cannot read the libraries of (a wrong --root, a DaemonSet that
    sees another /proc) must not give a spec of device nodes without a driver, exit 0: the
    containers would start and every CUDA call fail. One line, exit 1, no file."""
    for lib in (host_copy / "usr/lib/x86_64-linux-gnu").glob("lib*"):
        if lib.name.startswith(("libcuda.so", "libnvidia-ml.so")):
            lib.unlink()
    out = tmp_path / "spec.json"
    r = nvhook("cdi", "generate", "-o", str(out), config=cfg, root=host_copy)
    assert r.returncode == 1, r.stdout + r.stderr
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("nvhook:")]
    assert len(line) == 1 and "libcuda.so and libnvidia-ml.so of driver 535." in line[0], r.stderr
    assert "--root" in line[0]
    assert not out.exists()
    # a spec that asks for neither compute nor utility does not need them
    r = nvhook("cdi", "generate", "-o", str(out), "--capabilities", "graphics", config=cfg, root=host_copy)
    assert r.returncode == 0, r.stderr


def test_generate_warns_only_about_what_its_capabilities_need(tmp_path, cfg, host_copy):
    """A compute server without nvidia-modeset (the `display` node; the H200 this was seen on
    has none): the default spec (compute,utility) says nothing of it; a spec with display does."""
    (host_copy / "dev/nvidia-modeset").unlink()
    out = tmp_path / "spec.json"
    r = nvhook("cdi", "generate", "-o", str(out), config=cfg, root=host_copy)
    assert r.returncode == 0, r.stderr
    assert "nvidia-modeset" not in r.stdout + r.stderr
    r = nvhook("cdi", "generate", "-o", str(out), "--capabilities", "all", config=cfg, root=host_copy)
    assert r.returncode == 0, r.stderr
    assert "/dev/nvidia-modeset (display) is not on the host" in r.stderr or \
        "/dev/nvidia-modeset is not on the host" in r.stderr, r.stderr


def test_generate_is_byte_stable_and_does_not_rewrite(tmp_path, cfg, fixtures_root):
    host = fixtures_root / "host-mig8x7"
    out = tmp_path / "spec.json"
    first = nvhook("cdi", "generate", config=cfg, root=host)  # stdout, cold inventory cache
    assert first.returncode == 0, first.stderr
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host)  # warm cache
    assert p.returncode == 0, p.stderr
    assert out.read_bytes() == first.stdout.encode()
    st = os.stat(out)
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host)
    assert p.returncode == 0 and p.stderr.splitlines()[-1].startswith(f"unchanged {out}: "), p.stderr
    st2 = os.stat(out)
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    # no temporary file left (the log is there only if an interactive command was asked to write it)
    assert set(os.listdir(tmp_path)) - {"nvhook.jsonl"} == {"cache", "hook.toml", "spec.json"}


def test_mig_host_names(tmp_path, cfg, fixtures_root):
    p = nvhook("cdi", "generate", config=cfg, root=fixtures_root / "host-mig8x7")
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    got = names(spec)
    assert len(got) == 8 * 2 + 56 * 2 + 1
    for g in mf.HOSTS["host-mig8x7"].gpus:
        for m in g.migs:
            assert f"{g.index}:{m.slot}" in got and m.uuid in got
    assert "7:6" in got and "7:7" not in got


def test_name_strategies_and_capabilities(tmp_path, cfg, fixtures_root):
    host = fixtures_root / "host-gpu1"
    p = nvhook("cdi", "generate", "--device-name-strategy", "uuid", "--capabilities", "utility", config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    assert names(spec) == [mf.HOSTS["host-gpu1"].gpus[0].uuid, "all"]
    mounts = [m["containerPath"] for m in spec["containerEdits"]["mounts"]]
    assert not [m for m in mounts if "libcuda" in m] and [m for m in mounts if "libnvidia-ml" in m]
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl"]  # no uvm without compute
    assert spec["containerEdits"]["hooks"][0]["args"][-3:] == ["--cdi", "utility", "createContainer"]
    p = nvhook("cdi", "generate", "--device-name-strategy", "serial", config=cfg, root=host)
    assert p.returncode == 1
    assert p.stderr == "nvhook: unknown device name strategy 'serial' (known: index, uuid, type-index)\n"


def test_type_index_names_as_nvidia_ctk(tmp_path, cfg, fixtures_root):
    """nvidia-ctk's type-index strategy: gpu<i> and mig<i>:<j>, alone or beside the others; a
    spec written with it is checked against the host with the same names."""
    host = fixtures_root / "host-mig8x7"
    out = tmp_path / "spec.json"
    p = nvhook("cdi", "generate", "--device-name-strategy", "type-index,uuid", "--output", str(out),
               config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    got = names(json.loads(out.read_text()))
    g = mf.HOSTS["host-mig8x7"].gpus[7]
    assert "gpu7" in got and f"mig7:{g.migs[0].slot}" in got and g.uuid in got and "7" not in got
    assert len(got) == 8 * 2 + 56 * 2 + 1
    p = nvhook("cdi", "check", str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stdout + p.stderr


def test_yaml_is_the_same_spec(tmp_path, cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    js = nvhook("cdi", "generate", config=cfg, root=host)
    out = tmp_path / "nvhook.yaml"
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    assert text.startswith("---\ncdiVersion: \"0.5.0\"\nkind: \"nvidia.com/gpu\"\ndevices:\n  - name: \"0\"\n")
    assert cdispec.read_spec(str(out)) == json.loads(js.stdout)


@pytest.mark.parametrize("host, message", [
    ("empty", "nvhook: no ld.so.cache at {root}/etc/ld.so.cache: is the host root {root!r} right?"),
    ("host-badcache", None),
])
def test_bad_host_is_one_line(tmp_path, cfg, fixtures_root, host, message):
    root = tmp_path / "empty" if host == "empty" else fixtures_root / host
    root.mkdir(exist_ok=True)
    out = tmp_path / "spec.json"
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=root)
    assert p.returncode == 1
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("nvhook: "), p.stderr
    if message:
        assert p.stderr.strip() == message.format(root=str(root))
    else:
        assert "ld.so.cache" in p.stderr
    assert not out.exists()


def test_host_without_gpus(tmp_path, cfg, host_copy):
    for d in (host_copy / "proc/driver/nvidia/gpus").iterdir():
        subprocess.run(["rm", "-rf", str(d)], check=True)
    p = nvhook("cdi", "generate", config=cfg, root=host_copy)
    assert p.returncode == 1
    # (the warnings before it are the console's echo of the log: this host has a stale library)
    errors = [ln for ln in p.stderr.splitlines() if not ln.startswith("[warning")]
    assert len(errors) == 1 and errors[0].startswith(f"nvhook: no NVIDIA GPU found under {host_copy} ")


# -- list ------------------------------------------------------------------------------------

def test_list(tmp_path, cfg, fixtures_root):
    host = fixtures_root / "host-gpu8"
    p = nvhook("cdi", "list", config=cfg, root=host)  # no spec installed: what generate would write
    assert p.returncode == 0, p.stderr
    assert "no CDI spec at" in p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["nvidia.com/gpu=0", "/dev/nvidia0"]
    assert "nvidia.com/gpu=0:1" in p.stdout and lines[-1].split()[0] == "nvidia.com/gpu=all"
    spec = tmp_path / "etc-cdi" / "nvhook.json"
    assert nvhook("cdi", "generate", "--output", str(spec), "--device-name-strategy", "index",
                  config=cfg, root=host).returncode == 0
    p = nvhook("cdi", "list", "--format", "json", config=cfg, root=host)
    assert p.returncode == 0 and not p.stderr, p.stderr
    items = json.loads(p.stdout)
    assert [i["name"] for i in items][:3] == ["nvidia.com/gpu=0", "nvidia.com/gpu=0:0", "nvidia.com/gpu=0:1"]


# -- check -----------------------------------------------------------------------------------

def gen(cfg: Path, host: Path, out: Path) -> dict:
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())


def check(cfg: Path, host: Path, spec: Path) -> subprocess.CompletedProcess:
    return nvhook("cdi", "check", str(spec), config=cfg, root=host)


def test_check_clean(tmp_path, cfg, host_copy):
    spec = tmp_path / "spec.json"
    gen(cfg, host_copy, spec)
    p = check(cfg, host_copy, spec)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout == f"CDI spec {spec} matches the host (25 devices)\n"


def test_check_driver_upgrade(tmp_path, cfg, host_copy):
    spec = tmp_path / "spec.json"
    gen(cfg, host_copy, spec)
    version = host_copy / "proc/driver/nvidia/version"
    version.write_text(version.read_text().replace(mf.DRIVER_535, "550.54.15"))
    p = check(cfg, host_copy, spec)
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert lines[0] == f"driver version: the spec was made for {mf.DRIVER_535}, the host has 550.54.15"
    # the 535 libraries no longer count as the driver's: each mount of one is a difference too
    assert f"mount gone: /usr/lib/x86_64-linux-gnu/libcuda.so.{mf.DRIVER_535} is in the spec, not on the host" in lines
    assert p.stderr.splitlines()[-1].startswith(f"nvhook: CDI spec {spec} does not match the host (")


def test_check_missing_file(tmp_path, cfg, host_copy):
    spec = tmp_path / "spec.json"
    gen(cfg, host_copy, spec)
    lib = host_copy / f"usr/lib/x86_64-linux-gnu/libnvidia-allocator.so.{mf.DRIVER_535}"
    lib.unlink()
    p = check(cfg, host_copy, spec)
    assert p.returncode == 1
    assert p.stdout.splitlines() == [f"missing on the host: {lib}"]


def test_check_device_numbers(tmp_path, cfg, host_copy):
    spec = tmp_path / "spec.json"
    gen(cfg, host_copy, spec)
    uvm = host_copy / "dev/nvidia-uvm"
    uvm.unlink()
    os.mknod(uvm, 0o666 | 0o020000, os.makedev(511, 0))  # a reboot gave nvidia-uvm another major
    p = check(cfg, host_copy, spec)
    assert p.returncode == 1
    assert p.stdout.splitlines() == ["device numbers: /dev/nvidia-uvm (spec-wide) is 235:0 in the spec, "
                                     "511:0 on the host"]


def test_check_gpu_removed(tmp_path, cfg, host_copy):
    spec = tmp_path / "spec.json"
    gen(cfg, host_copy, spec)
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    subprocess.run(["rm", "-rf", str(host_copy / "proc/driver/nvidia/gpus" / g7.bus_id)], check=True)
    p = check(cfg, host_copy, spec)
    assert p.returncode == 1
    lines = p.stdout.splitlines()
    assert "device gone from the host: nvidia.com/gpu=7 is in the spec" in lines
    assert f"device gone from the host: nvidia.com/gpu={g7.uuid} is in the spec" in lines
    assert "device node gone: /dev/nvidia7 (nvidia.com/gpu=all) is in the spec, not on the host" in lines


def test_check_gpu_and_mig_added_and_mig_removed(tmp_path, cfg, host_copy):
    path = tmp_path / "spec.json"
    spec = gen(cfg, host_copy, path)
    g = mf.HOSTS["host-gpu8"].gpus
    kept = [d for d in spec["devices"] if d["name"] not in ("3", g[3].uuid, "1:1")]
    ghost = json.loads(json.dumps(next(d for d in spec["devices"] if d["name"] == "0:1")))
    ghost["name"] = "0:5"
    spec["devices"] = kept + [ghost]
    path.write_text(json.dumps(spec))
    p = check(cfg, host_copy, path)
    assert p.returncode == 1
    assert sorted(p.stdout.splitlines()) == sorted([
        "device added on the host: nvidia.com/gpu=3 is not in the spec",
        f"device added on the host: nvidia.com/gpu={g[3].uuid} is not in the spec",
        "device added on the host: nvidia.com/gpu=1:1 is not in the spec",
        "device gone from the host: nvidia.com/gpu=0:5 is in the spec"])


def test_check_foreign_or_broken_spec(tmp_path, cfg, host_copy):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [],
                                "containerEdits": {}}))
    p = check(cfg, host_copy, path)
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1
    assert "was not generated by nvhook" in p.stderr
    path.write_text("{not json")
    p = check(cfg, host_copy, path)
    assert p.returncode == 1 and p.stderr.startswith(f"nvhook: CDI spec {path} is not valid JSON")
    p = check(cfg, host_copy, tmp_path / "none.json")
    assert p.returncode == 1 and p.stderr.startswith(f"nvhook: cannot read CDI spec {tmp_path / 'none.json'}")


@pytest.mark.parametrize("tamper", ["hook path swapped", "argv changed", "device hook added"])
def test_check_and_list_compare_hooks_with_what_nvhook_writes(tmp_path, cfg, host_copy, tamper):
    """A spec whose hook is not nvhook's -- its path swapped for another existing program with
    the same arguments, its arguments changed, a hook added to one device -- does not "match
    the host", however consistent the file is with itself; `cdi list` warns about it."""
    spec = tmp_path / "spec.json"
    data = gen(cfg, host_copy, spec)
    (hook,) = data["containerEdits"]["hooks"]
    assert hook["path"] == str(NVHOOK)
    if tamper == "hook path swapped":
        hook["path"] = shutil.which("env")  # exists, runs what follows it: "nvhook ..." from PATH
        needle = "hooks differ"
    elif tamper == "argv changed":
        hook["args"] = [*hook["args"][:-3], "--log-file", "/tmp/x", *hook["args"][-3:]]
        needle = "hooks differ"
    else:
        data["devices"][0]["containerEdits"]["hooks"] = [dict(hook, path="/bin/true")]
        needle = f"hooks (nvidia.com/gpu={data['devices'][0]['name']}) differ"
    spec.write_text(json.dumps(data))
    p = check(cfg, host_copy, spec)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "matches the host" not in p.stdout
    assert [ln for ln in p.stdout.splitlines() if ln.startswith(needle)], p.stdout
    assert p.stderr.splitlines()[-1].startswith(f"nvhook: CDI spec {spec} does not match the host (1 difference)")
    p = nvhook("cdi", "list", str(spec), config=cfg, root=host_copy)
    assert p.returncode == 0 and "nvidia.com/gpu=0" in p.stdout
    (warn,) = p.stderr.splitlines()  # list reads the file only: no scan, no other line
    assert warn.startswith(f"nvhook: warning: CDI spec {spec}: hook ") and "is not the one nvhook writes" in warn


def test_check_hook_path_option(tmp_path, cfg, host_copy):
    """A spec generated with --hook-path checks clean with the same --hook-path, not without."""
    spec = tmp_path / "spec.json"
    other = tmp_path / "bin" / "nvhook"
    other.parent.mkdir()
    other.symlink_to(NVHOOK)
    p = nvhook("cdi", "generate", "--output", str(spec), "--hook-path", str(other), config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    assert check(cfg, host_copy, spec).returncode == 1
    p = nvhook("cdi", "check", str(spec), "--hook-path", str(other), config=cfg, root=host_copy)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("image", ["plain", "link to the host's /proc", "the runtime's /proc mounted"])
def test_cdi_hook_outside_the_containers_mount_namespace_fails_closed(tmp_path, cfg, fixtures_root, image):
    """The createContainer hook run where the runtime's mounts for the container are not
    mounted under its rootfs -- a private copy of the host's mount namespace here, where
    /proc/1/ns/mnt says nothing useful (unreadable on some hosts, another namespace in any
    case) -- refuses with one line and mounts nothing onto the rootfs. An image whose link
    leads a mount destination to the host's /proc does not pass for the container's."""
    rootfs = tmp_path / "rootfs"
    shutil.copytree(fixtures_root / "container-debian", rootfs, symlinks=True)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    conf = mf.oci_config(str(rootfs), ["PATH=/usr/bin:/bin"])
    if image == "link to the host's /proc":
        (rootfs / "host").symlink_to("/")
        conf["mounts"] = [{"destination": "/host/proc", "type": "proc", "source": "proc"}]
    conf["linux"]["devices"] = [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
    (bundle / "config.json").write_text(json.dumps(conf))
    state = json.dumps({"ociVersion": "1.0.2", "id": "cdi-x", "status": "creating", "pid": 1,
                        "bundle": str(bundle)})
    argv = [str(NVHOOK), "--config", str(cfg), "--root", str(fixtures_root / "host-gpu8"),
            "--cdi", "compute,utility", "createContainer"]
    script = ('"$@" < "$STATE"; rc=$?; grep -F " $ROOTFS" /proc/self/mountinfo >&2; exit $rc')
    if image == "the runtime's /proc mounted":  # the control: what the container's namespace has
        script = 'mount -t proc proc "$ROOTFS/proc" && ' + script
    env = dict(os.environ, STATE=str(tmp_path / "state.json"), ROOTFS=str(rootfs))
    env.pop("NVHOOK_CONFIG", None)
    (tmp_path / "state.json").write_text(state)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                       capture_output=True, text=True, timeout=120, env=env)
    if image == "the runtime's /proc mounted":
        assert "does not run in the container's mount namespace" not in p.stderr
        assert f" {rootfs}/proc/driver/nvidia " in p.stderr, p.stderr  # it went on: its in-container part
        return
    assert p.returncode == 1, p.stdout + p.stderr
    (line,) = p.stderr.splitlines()  # and no mount under the rootfs in that namespace
    assert line.startswith("nvhook: the createContainer hook does not run in the container's mount namespace ")
    assert str(rootfs) in line and "use a prestart or createRuntime hook" in line


def test_doctor_warns_about_a_stale_spec(tmp_path, cfg, host_copy, fixtures_root):
    spec = tmp_path / "etc-cdi" / "nvhook.json"  # cdi.spec of the config
    rootfs = fixtures_root / "container-debian"
    p = nvhook("doctor", "--rootfs", str(rootfs), config=cfg, root=host_copy)
    assert p.returncode == 0 and "CDI spec   " not in p.stdout, p.stdout  # none installed: nothing said
    gen(cfg, host_copy, spec)
    p = nvhook("doctor", "--rootfs", str(rootfs), config=cfg, root=host_copy)
    assert f"CDI spec        {spec} matches the host" in p.stdout
    (host_copy / f"usr/lib/x86_64-linux-gnu/libnvidia-allocator.so.{mf.DRIVER_535}").unlink()
    p = nvhook("doctor", "--rootfs", str(rootfs), config=cfg, root=host_copy)
    warn = [ln for ln in p.stdout.splitlines() if "CDI spec " in ln]
    assert len(warn) == 1 and warn[0].startswith(f"Warning         CDI spec {spec} is stale: missing on the host: ")
    assert f"`nvhook cdi generate --output {spec}`" in warn[0]


# -- the pure model --------------------------------------------------------------------------

def test_cdi_version_is_the_lowest_that_has_the_fields_used():
    dev = {"name": "GPU-x", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
    spec = {"devices": [dev], "containerEdits": {"mounts": [{"hostPath": "/a", "containerPath": "/a"}]}}
    assert cdi.cdi_version(spec) == "0.3.0"
    spec["containerEdits"]["mounts"][0]["type"] = "bind"
    assert cdi.cdi_version(spec) == "0.4.0"
    dev["containerEdits"]["deviceNodes"][0]["hostPath"] = "/root/dev/nvidia0"
    assert cdi.cdi_version(spec) == "0.5.0"
    del dev["containerEdits"]["deviceNodes"][0]["hostPath"]
    dev["name"] = "0"
    assert cdi.cdi_version(spec) == "0.5.0"
    assert cdi.cdi_version(dict(spec, kind="nvidia.com/gpu.x")) == "0.6.0"
    assert cdi.cdi_version(dict(spec, annotations={"a": "b"})) == "0.6.0"
    dev["containerEdits"]["additionalGids"] = [44]
    assert cdi.cdi_version(spec) == "0.7.0"


# -- cdiVersion for the engines present, additionalGids --------------------------------------

def _video_node(host: Path, gid: int = 44, mode: int = 0o660) -> None:
    os.chmod(host / "dev/nvidia0", mode)
    os.chown(host / "dev/nvidia0", 0, gid)


def _install_engine(host: Path, engine: Path, name: str = "podman") -> None:
    """An engine binary in the host root's /usr/bin (a hard link where it can be: the same bytes)."""
    dst = host / "usr/bin" / name
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(engine, dst)
    except OSError:
        shutil.copy2(engine, dst)


def test_additional_gids_for_a_node_only_its_group_can_open(tmp_path, cfg, host_copy):
    """/dev/nvidia0 0660 root:video: device 0 carries additionalGids [44] and the spec is 0.7.0
    (no engine under this host root reads less); the 0666 nodes need no group."""
    _video_node(host_copy)
    out = tmp_path / "spec.json"
    p = nvhook("cdi", "generate", "--output", str(out), config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    assert p.stderr.splitlines()[-1] == f"wrote {out}: 25 devices, cdiVersion 0.7.0"
    spec = json.loads(out.read_text())
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert by_name["0"]["additionalGids"] == [44] and by_name[spec["devices"][1]["name"]]["additionalGids"] == [44]
    assert by_name["all"]["additionalGids"] == [44]
    assert "additionalGids" not in by_name["1"] and "additionalGids" not in spec["containerEdits"]
    node = by_name["0"]["deviceNodes"][0]
    assert (node["fileMode"], node["gid"]) == (0o660, 44)


@pytest.mark.parametrize("mode,gid", [(0o666, 44), (0o660, 0)])
def test_no_additional_gids_where_none_helps(tmp_path, cfg, host_copy, mode, gid):
    _video_node(host_copy, gid, mode)
    p = nvhook("cdi", "generate", config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    assert '"additionalGids"' not in p.stdout and json.loads(p.stdout)["cdiVersion"] == "0.5.0"


PODMAN4 = Path("/usr/bin/podman")


@pytest.mark.skipif(not PODMAN4.exists(), reason="no podman on this machine")
def test_an_engine_that_reads_only_0_5_keeps_the_spec_at_0_5(tmp_path, cfg, host_copy):
    """podman 4.3.1 (this machine's; CDI library 0.5) installed in the host root: the group is
    left out so that podman still reads the spec, one warning line says so and how to force it;
    --cdi-version 0.7.0 writes it anyway."""
    _video_node(host_copy)
    _install_engine(host_copy, PODMAN4)
    p = nvhook("cdi", "generate", config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    assert spec["cdiVersion"] == "0.5.0" and '"additionalGids"' not in p.stdout
    warnings = [ln for ln in p.stderr.splitlines() if "cdi.version_limited" in ln]
    assert len(warnings) == 1, p.stderr
    assert "additionalGids [44] left out (needs cdiVersion 0.7.0)" in warnings[0]
    assert f"podman ({host_copy}/usr/bin/podman) reads up to 0.5.0" in warnings[0]
    assert "--cdi-version 0.7.0" in warnings[0]
    click_cli = [sys.executable, "-c", "import sys; from nvhook.commands.cli import run; sys.exit(run(sys.argv[1:]))"]
    for fast in (True, False):  # the fast path and the click CLI take the option alike
        args = ["--config", str(cfg), "--root", str(host_copy), "cdi", "generate", "--cdi-version", "0.7.0",
                "--hook-path", "/usr/bin/nvhook"]
        p = subprocess.run(([str(NVHOOK)] if fast else click_cli) + args, capture_output=True, text=True,
                           timeout=120, env={k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"})
        assert p.returncode == 0, p.stderr
        forced = json.loads(p.stdout)
        assert forced["cdiVersion"] == "0.7.0" and forced["devices"][0]["containerEdits"]["additionalGids"] == [44]
        assert "cdi.version_limited" not in p.stderr


def test_engine_versions_read_from_the_binaries(tmp_path):
    """The newest cdiVersion each engine's CDI library reads, from the binary: this machine's
    podman 4.3.1, and the Debian 13 node root's podman 5, containerd 1.7 and Docker 26."""
    from nvhook.observe.host import engines

    if PODMAN4.exists():
        assert engines.max_cdi_version(str(PODMAN4)) == "0.5.0"
    assert engines.max_cdi_version("/bin/sh") is None
    nodes = sorted(Path("/var/cache/nvhook-tests").glob("node-*/rootfs"))
    if not nodes:
        pytest.skip("no Debian 13 node root built (tests/node)")
    found = {r["engine"]: r["max_version"] for r in engines.cdi_readers(str(nodes[-1]))}
    assert found == {"podman": "0.8.0", "containerd": "0.8.0", "docker": "0.7.0"}


@pytest.mark.parametrize("value,message", [
    ("0.3.0", "cannot write the spec as --cdi-version 0.3.0: the spec needs cdiVersion 0.5.0"),
    ("9.9", "--cdi-version 9.9 is no CDI spec version (known: 0.3.0, "),
])
def test_cdi_version_option_errors(cfg, fixtures_root, value, message):
    p = nvhook("cdi", "generate", "--cdi-version", value, config=cfg, root=fixtures_root / "host-gpu8")
    assert p.returncode != 0 and p.stdout == ""
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def _inv(fixtures_root: Path, host: str) -> dict:
    from nvhook.base.log import EventLog
    from nvhook.observe import host as host_mod

    cfgd = {"nvml": {"enabled": True, "timeout": 5.0}}
    inv = host_mod.observe(str(fixtures_root / host), "", EventLog("error", None))
    host_mod.add_nvml(inv, cfgd, EventLog("error", None), reason="test", live_instances=True)
    return inv


def test_request_from_linux_devices(fixtures_root):
    inv = _inv(fixtures_root, "host-gpu8")
    gpus = mf.HOSTS["host-gpu8"].gpus
    caps_by_name = {d["cap_name"]: d for d in inv["files"]["devices"] if d["role"] == "mig-cap"}
    gi = caps_by_name["gpu0/gi2/access"]
    ci = caps_by_name["gpu0/gi2/ci0/access"]
    devices = [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
               {"path": "/dev/x", "type": "c", "major": gi["major"], "minor": gi["minor"]},
               {"path": "/dev/y", "type": "c", "major": ci["major"], "minor": ci["minor"]},
               {"path": "/dev/renamed", "type": "c", "major": 195, "minor": 5},
               {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
               {"path": "/dev/null", "type": "c", "major": 1, "minor": 3}]
    req, unknown = cdi.request_from_devices(devices, inv, ["compute", "utility"])
    assert unknown == []
    assert req["kind"] == "devices" and req["devices"] == [gpus[0].migs[1].uuid, "5"]
    # a GI access node alone is no MIG device: GPU 0's node then stands for the whole GPU
    req, _ = cdi.request_from_devices(devices[:2] + devices[4:], inv, ["utility"])
    assert req["kind"] == "devices" and req["devices"] == ["0"]
    req, _ = cdi.request_from_devices(devices[4:], inv, ["utility"])
    assert req["kind"] == "none"


def test_spec_edits_are_the_plans_edits(fixtures_root):
    """The spec carries the edits hook mode and the runtime wrapper derive from the same plan."""
    from nvhook.base import config as config_mod
    from nvhook.decide import edits, plan

    inv = _inv(fixtures_root, "host-gpu8")
    cfgd = config_mod._defaults()
    spec = cdi.build_spec(inv, cfgd, capabilities=["compute", "utility"], strategies=("index",),
                          hook_path="/nvhook", global_args=[])
    req = {"kind": "devices", "devices": ["2"], "capabilities": ["compute", "utility"], "requirements": [],
           "requirement_sources": [], "devices_source": "x", "privileged": False, "reason": ""}
    sel, migs = plan.select(req, inv["gpus"], {})
    image = cdi.spec_image(inv["files"])
    p = plan.build({"id": "x", "pid": None, "rootfs": "/"}, req, inv, image, cfgd,
                   {"decision": "host", "reason": "", "libraries": []}, sel, migs)
    e = edits.from_plan(p)
    nodes = spec["containerEdits"]["deviceNodes"] + next(d for d in spec["devices"] if d["name"] == "2")[
        "containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == [n["path"] for n in e["device_nodes"]]
    assert [(m["hostPath"], m["containerPath"]) for m in spec["containerEdits"]["mounts"]] == \
        [(m["host_path"], m["container_path"]) for m in edits.spec_mounts(e)]
    assert re.fullmatch(r"/usr/lib/x86_64-linux-gnu", image["libdirs"][0])


def test_create_container_stage_needs_cdi(tmp_path, cfg, fixtures_root):
    """createContainer hooks run in the container's namespaces, where the state's pid (1) read
    through the host's /proc would be the host's init: only the CDI hook may run there."""
    bundle = fixtures_root / "bundle-container-debian"
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "pid": 1, "bundle": str(bundle)})
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    p = subprocess.run([str(NVHOOK), "--config", str(cfg), "--root", str(fixtures_root / "host-gpu8"),
                        "createContainer"], input=state, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1
    assert p.stderr == ("nvhook: the createContainer stage is for nvhook's CDI hook (--cdi CAPABILITIES); "
                        "register nvhook as a prestart or createRuntime hook\n")
    assert [e["event"] for e in rb.read_events(tmp_path / "nvhook.jsonl")] == ["hook.start", "hook.failed"]


UNITS = Path(__file__).resolve().parent.parent / "packaging" / "systemd"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_units_verify_and_run(tmp_path, cfg, fixtures_root):
    """The shipped units pass `systemd-analyze verify` (with nvhook where this test installed it),
    and the service's commands, pointed at a fixture host and a temp file, write a spec that the
    post-check accepts."""
    for unit in UNITS.iterdir():
        (tmp_path / unit.name).write_text(unit.read_text().replace("/usr/local/bin/nvhook", str(NVHOOK)))
    p = subprocess.run(["systemd-analyze", "verify", *sorted(u.name for u in UNITS.iterdir())], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stdout + p.stderr, p.stdout + p.stderr
    service = (UNITS / "nvhook-cdi.service").read_text()
    start = [ln.split("=", 1)[1].split() for ln in service.splitlines() if ln.startswith("ExecStart=")]
    post = [ln.split("=", 1)[1].split() for ln in service.splitlines() if ln.startswith("ExecStartPost=")]
    spec = "/etc/cdi/nvhook.json"
    assert start == [["/usr/local/bin/nvhook", "cdi", "generate", "--output", spec]]
    assert post == [["/usr/local/bin/nvhook", "cdi", "check", spec]]
    from nvhook.base.config import DEFAULTS

    assert DEFAULTS["cdi"]["spec"] == spec  # what check and doctor read by default
    out = tmp_path / "spec.json"
    host = fixtures_root / "host-gpu8"
    assert nvhook(*start[0][1:-1], str(out), config=cfg, root=host).returncode == 0
    p = nvhook(*post[0][1:-1], str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stdout + p.stderr


def test_create_container_hook_refuses_the_hosts_mount_namespace(tmp_path, cfg, fixtures_root):
    """A runtime that ran the createContainer hook in its own namespaces would have nvhook mount
    into the host. Simulated: nvhook started where /proc's pid 1 shares its mount namespace (a
    fresh PID namespace whose init is the shell that runs it) and the container's mounts are
    not under its rootfs."""
    import shlex

    bundle = fixtures_root / "bundle-container-debian"
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "pid": 1, "bundle": str(bundle)})
    cmd = " ".join(shlex.quote(a) for a in [str(NVHOOK), "--config", str(cfg), "--root",
                                             str(fixtures_root / "host-gpu8"), "--cdi", "compute,utility",
                                             "createContainer"])
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    rootfs = shlex.quote(" " + str(fixtures_root / "container-debian"))
    # what that namespace has mounted under the rootfs afterwards: nothing (this namespace's
    # own table, not the host's, which other processes change meanwhile)
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--propagation", "private", "--mount-proc",
                        "sh", "-c", f"{cmd}; rc=$?; grep -F {rootfs} /proc/self/mountinfo; echo rc=$rc"],
                       input=state, capture_output=True, text=True, timeout=60, env=env)
    assert p.stdout == "rc=1\n", p.stdout + p.stderr
    assert p.stderr.startswith("nvhook: the createContainer hook does not run in the container's mount "
                               "namespace "), p.stderr


from fuzzscale import examples  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", min_size=1, max_size=8)
_scalars = st.one_of(st.text(max_size=20), st.integers(-2**40, 2**40), st.booleans(), st.none())
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_keys, inner, max_size=4)), max_leaves=20)


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(_keys, _values, min_size=1, max_size=5))
def test_yaml_round_trips_json_data(data):
    """nvhook's YAML emitter and reader agree on any JSON data with the keys specs use (strings
    with colons, quotes, dashes, newlines, '#', unicode included)."""
    text = cdispec.to_yaml(data).decode()
    assert cdispec.from_yaml(text, "x") == data


def test_gpu_without_its_node_is_left_out(tmp_path, cfg, host_copy):
    """A runtime refuses a spec whose device has no edits: a GPU whose /dev/nvidiaN is missing
    is not in the spec (the inventory's device.missing warning says why), the others are."""
    (host_copy / "dev/nvidia7").unlink()
    p = nvhook("cdi", "generate", config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    assert "device.missing" in p.stderr
    spec = json.loads(p.stdout)
    got = names(spec)
    g7 = mf.HOSTS["host-gpu8"].gpus[7]
    assert "7" not in got and g7.uuid not in got and "6" in got
    by = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert [n["path"] for n in by["all"]] == [f"/dev/nvidia{i}" for i in range(7)]
    assert all(d["containerEdits"]["deviceNodes"] for d in spec["devices"])


def test_generate_takes_no_click_and_writes_what_the_click_command_writes(tmp_path, cfg, fixtures_root):
    """`cdi generate` runs on every driver change (nvhook-cdi.service) and from scripts: its
    fast path (nvhook/commands/cdifast.py) imports neither click nor structlog, and its spec is
    byte for byte the click command's."""
    host = fixtures_root / "host-gpu8"
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    p = subprocess.run([sys.executable, "-X", "importtime", str(NVHOOK), "--config", str(cfg), "--root", str(host),
                        "cdi", "generate", "--output", str(fast), "--hook-path", "/usr/bin/nvhook"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    imported = {ln.split("|")[-1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")}
    assert "nvhook.commands.cdifast" in imported
    assert not {m for m in imported if m.split(".")[0] in ("click", "structlog", "asyncio")}
    assert p.stderr.splitlines()[-1] == f"wrote {fast}: 25 devices, cdiVersion 0.5.0"
    code = subprocess.run([sys.executable, "-c", "import sys; from nvhook.commands.cli import run; "
                           "sys.exit(run(sys.argv[1:]))", "--config", str(cfg), "--root", str(host), "cdi",
                           "generate", "--output", str(slow), "--hook-path", "/usr/bin/nvhook"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert code.returncode == 0, code.stderr
    assert fast.read_bytes() == slow.read_bytes()
    # anything the fast path does not know goes to click, with click's message
    p = nvhook("cdi", "generate", "--bogus", config=cfg, root=host)
    # click's own wording of the option differs between its releases (--bogus, '--bogus'.)
    (line,) = p.stderr.splitlines()
    assert p.returncode == 2 and line.startswith("nvhook: No such option") and "--bogus" in line
    assert line.endswith(" (see nvhook cdi generate --help)")


def test_no_hook_spec_binds_every_link_and_runs_nothing(tmp_path, cfg, fixtures_root):
    """`cdi generate --no-hook` (fast path and click alike): no hook; every link the default spec's
    hook would make (SONAMEs, libcuda.so, gbm's) is a bind of the same host file instead, 64-bit
    SONAMEs in both glibc families' default directories; the rest of the spec unchanged."""
    host = fixtures_root / "host-gpu8"
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    out = {}
    for name, pre in (("fast", [sys.executable, str(NVHOOK)]),
                      ("slow", [sys.executable, "-c", "import sys; from nvhook.commands.cli import run; "
                                "sys.exit(run(sys.argv[1:]))"]),
                      ("default", [sys.executable, str(NVHOOK)])):
        extra = [] if name == "default" else ["--no-hook"]
        p = subprocess.run([*pre, "--config", str(cfg), "--root", str(host), "cdi", "generate", "--capabilities", "all",
                            "--output", str(tmp_path / f"{name}.json"), *extra],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr
        out[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert out["fast"] == out["slow"]
    lean, default = out["fast"]["containerEdits"], out["default"]["containerEdits"]
    assert "hooks" not in lean
    # a GPU's /dev/dri/by-path links (graphics), which the hook makes, are nodes of their own
    lean_dev = {d["name"]: d["containerEdits"]["deviceNodes"] for d in out["fast"]["devices"]}
    default_dev = {d["name"]: d["containerEdits"]["deviceNodes"] for d in out["default"]["devices"]}
    assert sorted(lean_dev) == sorted(default_dev)
    extra = [n for n in lean_dev["0"] if n not in default_dev["0"]]
    assert extra and all(n["path"].startswith("/dev/dri/by-path/pci-") for n in extra), extra
    dri = {(n["major"], n["minor"]) for n in default_dev["0"] if n["path"].startswith("/dev/dri/")}
    assert {(n["major"], n["minor"]) for n in extra} == dri
    assert all(lean_dev[k] == default_dev[k] for k in lean_dev if k.startswith(("0:", "MIG-")))
    assert lean["env"] == default["env"] + ["NVHOOK_CDI_NO_HOOK=compute,compat32,graphics,utility,video,display,ngx"]
    assert lean["deviceNodes"] == default["deviceNodes"]
    assert lean["mounts"][:len(default["mounts"])] == default["mounts"]
    binds = {m["containerPath"]: m["hostPath"] for m in lean["mounts"]}
    L = "/usr/lib/x86_64-linux-gnu"
    cuda = binds[f"{L}/libcuda.so.{mf.DRIVER_535}"]
    assert binds[f"{L}/libcuda.so.1"] == binds["/usr/lib64/libcuda.so.1"] == binds[f"{L}/libcuda.so"] == cuda
    assert binds["/usr/lib/i386-linux-gnu/libcuda.so.1"] == binds[f"/usr/lib/i386-linux-gnu/libcuda.so.{mf.DRIVER_535}"]
    assert "/usr/lib64/libcuda.so" not in binds  # the development link only where the hook makes it
    assert binds[f"{L}/gbm/nvidia-drm_gbm.so"] == binds[f"{L}/libnvidia-allocator.so.1"]
    assert all(m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in lean["mounts"][len(default["mounts"]):])


def test_refresh_keeps_a_spec_without_a_hook_without_one(tmp_path, cfg, fixtures_root):
    """nvhookd's refresh of a `--no-hook` spec gone stale regenerates it without a hook."""
    from nvhook.base import config as config_mod
    from nvhook.base.log import EventLog
    from nvhook.start import cdispecs

    host = fixtures_root / "host-gpu8"
    spec_dir = tmp_path / "cdi"
    spec_dir.mkdir(mode=0o755)
    out = spec_dir / "nvhook.json"
    p = nvhook("cdi", "generate", "--no-hook", "--output", str(out), config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    spec = json.loads(out.read_text())
    spec["devices"] = spec["devices"][:-1]
    out.write_text(json.dumps(spec))
    out.chmod(0o644)
    r = cdispecs.refresh(config_mod.load(str(cfg), explicit=True), str(host), EventLog("info", None), str(out))
    assert r is not None and r["changed"], r
    again = json.loads(out.read_text())
    assert "hooks" not in again["containerEdits"] and len(again["devices"]) == len(spec["devices"]) + 1
    assert any(v.startswith("NVHOOK_CDI_NO_HOOK=") for v in again["containerEdits"]["env"])


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(st.text(max_size=8), _values, max_size=5))
def test_json_is_the_json_packages_bytes(data):
    """The spec's JSON writer (no json package) gives json.dumps(indent=2)'s exact bytes."""
    assert cdispec.to_json(data) == (json.dumps(data, indent=2, ensure_ascii=True) + "\n").encode()


def test_list_all_reads_every_spec_dir_nvidia_ctk_yaml_too(tmp_path, cfg, fixtures_root):
    """`cdi list --all`: the devices of every spec in the spec directories (here two given with
    --spec-dir, in CDI's precedence order), nvidia-ctk's block YAML included; a later directory's
    device of the same name overrides; a broken spec is one line and exit 1."""
    etc, run = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    etc.mkdir()
    run.mkdir()
    host = fixtures_root / "host-gpu1"
    assert nvhook("cdi", "generate", "--output", str(etc / "nvhook.json"), config=cfg, root=host).returncode == 0
    (run / "other.yaml").write_text(
        "---\ncdiVersion: 0.5.0\nkind: example.com/fpga\ndevices:\n    - name: \"0\"\n      containerEdits:\n"
        "        deviceNodes:\n            - path: /dev/fpga0\ncontainerEdits: {}\n")
    assert nvhook("cdi", "generate", "--output", str(run / "again.json"), "--device-name-strategy", "index",
                  config=cfg, root=host).returncode == 0
    p = nvhook("cdi", "list", "--spec-dir", str(etc), "--spec-dir", str(run), "--format", "json", config=cfg, root=host)
    assert p.returncode == 0, p.stderr
    items = json.loads(p.stdout)
    by = {(i["name"], i["spec"]): i for i in items}
    assert ("example.com/fpga=0", str(run / "other.yaml")) in by
    assert by[("nvidia.com/gpu=0", str(run / "again.json"))]["overrides"] == str(etc / "nvhook.json")
    assert ("nvidia.com/gpu=" + mf.HOSTS["host-gpu1"].gpus[0].uuid, str(etc / "nvhook.json")) in by
    (run / "broken.json").write_text("{")
    p = nvhook("cdi", "list", "--spec-dir", str(etc), "--spec-dir", str(run), config=cfg, root=host)
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "broken.json" in p.stderr
    assert "example.com/fpga=0" in p.stdout


def test_management_spec_is_checked_as_a_management_spec(tmp_path, cfg, host_copy):
    out = tmp_path / "mgmt.json"
    p = nvhook("cdi", "generate", "--mode", "management", "--output", str(out), config=cfg, root=host_copy)
    assert p.returncode == 0, p.stderr
    spec = json.loads(out.read_text())
    assert spec["kind"] == "management.nvidia.com/gpu" and [d["name"] for d in spec["devices"]] == ["all"]
    p = check(cfg, host_copy, out)
    assert p.returncode == 0, p.stdout + p.stderr


def test_driver_root_and_dev_root_as_nvidia_ctk(tmp_path, cfg, fixtures_root):
    """nvidia-ctk's --driver-root/--dev-root mean nvhook's --root (one directory for both)."""
    host = fixtures_root / "host-gpu1"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert nvhook("cdi", "generate", "--output", str(a), config=cfg, root=host).returncode == 0
    p = nvhook("cdi", "generate", "--driver-root", str(host), "--dev-root", str(host), "--output", str(b), config=cfg)
    assert p.returncode == 0, p.stderr
    assert a.read_bytes() == b.read_bytes()
    p = nvhook("cdi", "generate", "--driver-root", str(host), "--dev-root", "/", config=cfg)
    assert p.returncode == 1 and p.stderr.startswith("nvhook: --driver-root ") and "differ" in p.stderr
    assert len(p.stderr.splitlines()) == 1
