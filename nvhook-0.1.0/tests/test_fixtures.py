"""The fixture generator produces what nvhook's tests rely on
(tests/fixtures/make_fixtures.py, tests/fixtures/rootfs/README.md)."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import stat
import struct
import subprocess
from pathlib import Path

import make_fixtures as mf
import pytest
from elftools.elf.elffile import ELFFile

HOSTS = sorted(mf.HOSTS)
GOOD_CACHE_HOSTS = [h for h in HOSTS if not mf.HOSTS[h].corrupt_cache]
X86_64, I386 = 0x0300, 0x0000  # ld.so.cache flags & 0xff00
FLAG_ELF_LIBC6 = 0x0003


def read_ld_cache(path: Path) -> list[tuple[str, int, str]]:
    """(soname, flags, path) entries of a glibc-ld.so.cache1.1 file, in order."""
    data = path.read_bytes()
    assert data[:20] == b"glibc-ld.so.cache1.1"
    (nlibs,) = struct.unpack_from("<I", data, 20)

    def cstr(offset: int) -> str:
        return data[offset:data.index(b"\0", offset)].decode()

    entries = []
    for i in range(nlibs):
        flags, key, value, _osversion, _hwcap = struct.unpack_from("<iIIIQ", data, 48 + 24 * i)
        entries.append((cstr(key), flags, cstr(value)))
    return entries


def resolve_in_root(root: Path, rel: str) -> Path:
    """Follow symlinks with absolute targets taken inside `root`."""
    path = "/" + rel.lstrip("/")
    for _ in range(40):
        host = root / path.lstrip("/")
        if not host.is_symlink():
            return host
        target = os.readlink(host)
        path = target if target.startswith("/") else os.path.normpath(f"{os.path.dirname(path)}/{target}")
    raise AssertionError(f"symlink loop at {rel}")


def soname_of(path: Path) -> str:
    with open(path, "rb") as f:
        dynamic = ELFFile(f).get_section_by_name(".dynamic")
        return next(t.soname for t in dynamic.iter_tags() if t.entry.d_tag == "DT_SONAME")


def fwd_compat_notes(path: Path) -> list[dict]:
    with open(path, "rb") as f:
        section = ELFFile(f).get_section_by_name(".note.cuda.fwd_compatibility")
        if section is None:
            return []
        return [{"owner": n["n_name"], "desc": n["n_descdata"]} for n in section.iter_notes()]


def label_of(path: Path) -> str:
    label = ctypes.c_char.in_dll(ctypes.CDLL(str(path)), "nvhook_fixture_lib")  # a char array
    return ctypes.string_at(ctypes.addressof(label)).decode()


def expected_libs(spec: mf.HostSpec) -> list[mf.Lib]:
    return [lib for lib in mf.LIBRARIES if lib.name not in spec.omit_libs]


# ------------------------------------------------------------------ hosts


@pytest.mark.parametrize("host", GOOD_CACHE_HOSTS)
def test_cache_lists_every_library(fixtures_root, host):
    spec = mf.HOSTS[host]
    root = fixtures_root / host
    entries = read_ld_cache(root / "etc/ld.so.cache")
    x64 = {name: p for name, flags, p in entries if flags & 0xFF00 == X86_64}
    for lib in expected_libs(spec):
        assert lib.soname_for(spec.driver) in x64, lib.name
    assert "libnvidia-nscq.so.1" not in x64  # optional library left out on purpose
    # ldconfig -p agrees with our reading of the format
    out = subprocess.run([mf.LDCONFIG, "-r", str(root), "-p"], capture_output=True, text=True, check=True).stdout
    assert f"{len(entries)} libs found" in out


@pytest.mark.parametrize("host", GOOD_CACHE_HOSTS)
def test_library_files_carry_the_driver_version(fixtures_root, host):
    spec = mf.HOSTS[host]
    root = fixtures_root / host
    entries = read_ld_cache(root / "etc/ld.so.cache")
    for soname, flags, rel in entries:
        if flags & 0xFF00 != X86_64 or "nvidia-old" in rel:
            continue
        real = resolve_in_root(root, rel)
        if spec.layout == "debian" and not soname.endswith(spec.driver):
            assert real.parent == root / mf.DEBIAN_REAL_LIBDIR
        if not real.exists():
            assert soname.startswith(tuple(spec.dangling_libs)), rel
            continue
        assert real.name.endswith(f".so.{spec.driver}")
        assert soname_of(real) == soname
        name = real.name[: -len(f".so.{spec.driver}")]
        assert label_of(real) == f"{name} {spec.driver}"


def test_versioned_sonames(fixtures_root):
    libdir = fixtures_root / "host-gpu8" / mf.LIBDIR64
    assert soname_of(libdir / "libnvidia-glcore.so.535.261.03") == "libnvidia-glcore.so.535.261.03"
    assert soname_of(libdir / "libGLX_nvidia.so.535.261.03") == "libGLX_nvidia.so.0"
    assert soname_of(libdir / "libGLESv2_nvidia.so.535.261.03") == "libGLESv2_nvidia.so.2"
    assert os.readlink(libdir / "libcuda.so.1") == "libcuda.so.535.261.03"


def test_gpu8_has_32bit_libraries(fixtures_root):
    entries = read_ld_cache(fixtures_root / "host-gpu8/etc/ld.so.cache")
    i386 = {name: (flags, p) for name, flags, p in entries if flags & 0xFF00 == I386}
    for lib in mf.LIBRARIES:
        if lib.lib32:
            flags, rel = i386[lib.soname_for("535.261.03")]
            assert flags == FLAG_ELF_LIBC6  # "(libc6)", as the real libraries
            assert rel.startswith("/usr/lib/i386-linux-gnu/")
    assert "libnvidia-ngx.so.1" not in i386
    with open(fixtures_root / "host-gpu8/usr/lib/i386-linux-gnu/libcuda.so.535.261.03", "rb") as f:
        assert ELFFile(f).elfclass == 32
    gpu1 = read_ld_cache(fixtures_root / "host-gpu1/etc/ld.so.cache")
    assert all(flags & 0xFF00 == X86_64 for _, flags, _ in gpu1)


def test_gpu8_stale_libcuda_comes_first(fixtures_root):
    root = fixtures_root / "host-gpu8"
    cuda = [p for name, flags, p in read_ld_cache(root / "etc/ld.so.cache")
            if name == "libcuda.so.1" and flags & 0xFF00 == X86_64]
    assert cuda == ["/usr/lib/x86_64-linux-gnu/nvidia-old/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert resolve_in_root(root, cuda[0]).name == "libcuda.so.470.82.01"
    assert resolve_in_root(root, cuda[1]).name == "libcuda.so.535.261.03"


def test_libcuda_reports_cuda_version(fixtures_root):
    for host in ("host-gpu8", "host-geforce-460"):
        spec = mf.HOSTS[host]
        lib = ctypes.CDLL(str(fixtures_root / host / mf.LIBDIR64 / f"libcuda.so.{spec.driver}"))
        version = ctypes.c_int()
        assert lib.cuInit(0) == 0
        assert lib.cuDriverGetVersion(ctypes.byref(version)) == 0
        assert version.value == spec.cuda


def test_debian_layout_uses_absolute_alternatives(fixtures_root):
    root = fixtures_root / "host-debian"
    link = root / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert os.readlink(link) == "/etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu"
    alternative = root / "etc/alternatives/nvidia--libcuda.so.1-x86_64-linux-gnu"
    assert os.readlink(alternative) == "/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.525.147.05"
    assert not link.exists()  # dangles when followed on the real host: resolve inside the root
    assert resolve_in_root(root, "/usr/lib/x86_64-linux-gnu/libcuda.so.1").is_file()
    assert os.readlink(root / "usr/bin/nvidia-smi") == "/etc/alternatives/nvidia-smi"
    assert os.readlink(root / "etc/alternatives/nvidia-smi") == "/usr/lib/nvidia/current/nvidia-smi"
    assert (root / "etc/ld.so.conf").read_text() == "/usr/lib/x86_64-linux-gnu\n"
    # libraries whose soname is versioned live directly in the lib dir
    assert (root / "usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.525.147.05").is_file()
    assert (root / mf.DEBIAN_REAL_LIBDIR / "fake-nvml.conf").is_file()


def test_broken_host(fixtures_root):
    spec = mf.HOSTS["host-broken"]
    root = fixtures_root / "host-broken"
    names = {name for name, _, _ in read_ld_cache(root / "etc/ld.so.cache")}
    assert "libnvidia-ptxjitcompiler.so.1" not in names and "libnvidia-opencl.so.1" not in names
    assert "libnvidia-cfg.so.1" in names  # cached, but its target is gone
    link = root / mf.LIBDIR64 / "libnvidia-cfg.so.1"
    assert link.is_symlink() and not link.exists()
    bad = (root / f"proc/driver/nvidia/gpus/{spec.gpus[1].bus_id}/information").read_text()
    good = (root / f"proc/driver/nvidia/gpus/{spec.gpus[0].bus_id}/information").read_text()
    assert "Bus Location" not in bad and "Bus Location: \t 0000:07:00.0\n" in good


def test_badcache_is_rejected_by_ldconfig(fixtures_root):
    cache = fixtures_root / "host-badcache/etc/ld.so.cache"
    assert cache.read_bytes().startswith(b"glibc-ld.so.cache1.1") and cache.stat().st_size < 48
    proc = subprocess.run([mf.LDCONFIG, "-C", str(cache), "-p"], capture_output=True)
    assert proc.returncode != 0


def parse_information(text: str) -> dict[str, str]:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        assert sep and value[0] in " \t", line
        fields[key] = value.strip()
    return fields


@pytest.mark.parametrize("host", HOSTS)
def test_procfs(fixtures_root, host):
    spec = mf.HOSTS[host]
    proc = fixtures_root / host / "proc"
    version = (proc / "driver/nvidia/version").read_text()
    assert version.startswith(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {spec.driver}  ")
    # a real driver's layout: ModifyDeviceFiles is a module parameter (params), registry only
    # holds what an admin set
    assert "\nModifyDeviceFiles: 1\n" in (proc / "driver/nvidia/params").read_text()
    assert (proc / "driver/nvidia/registry").read_text() == 'Binary: ""\n'
    assert (proc / "driver/nvidia/warnings").is_dir()
    devices = (proc / "devices").read_text()
    for line in ("195 nvidia-frontend", "195 nvidia", "235 nvidia-uvm", "236 nvidia-caps"):
        assert f"\n{line}\n" in devices
    assert sorted(p.name for p in (proc / "driver/nvidia/gpus").iterdir()) == sorted(g.bus_id for g in spec.gpus)
    for gpu in spec.gpus:
        text = (proc / f"driver/nvidia/gpus/{gpu.bus_id}/information").read_text()
        assert text.startswith(f"Model: \t\t {gpu.name}\n")
        info = parse_information(text)
        assert info["GPU UUID"] == gpu.uuid and info["Device Minor"] == str(gpu.minor)
        assert info.get("Bus Location", gpu.bus_id) == gpu.bus_id
        assert (info.get("GPU Excluded") or info.get("Blacklisted")) == "No"


@pytest.mark.parametrize("host", ["host-gpu8", "host-mig8x7", "host-gpu1"])
def test_mig_capabilities(fixtures_root, host):
    spec = mf.HOSTS[host]
    root = fixtures_root / host
    minors = dict(line.split() for line in (root / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines())
    assert minors["config"] == "1" and minors["monitor"] == "2"
    expected = 2
    for gpu in spec.gpus:
        for gi in {m.gi for m in gpu.migs}:
            expected += 1 + len({m.ci for m in gpu.migs if m.gi == gi})
        for m in gpu.migs:
            for cap in (f"gpu{gpu.minor}/gi{m.gi}/access", f"gpu{gpu.minor}/gi{m.gi}/ci{m.ci}/access"):
                procfile = root / "proc/driver/nvidia/capabilities" / cap.replace("/gi", "/mig/gi", 1)
                assert f"DeviceFileMinor: {minors[cap]}\n" in procfile.read_text()
    assert len(minors) == expected
    assert "DeviceFileMinor: 2\n" in (root / "proc/driver/nvidia/capabilities/mig/monitor").read_text()
    if host == "host-mig8x7":
        assert sum(len(g.migs) for g in spec.gpus) == 56


needs_nodes = pytest.mark.skipif(os.geteuid() != 0, reason="device nodes are made only as root")


@needs_nodes
@pytest.mark.parametrize("host", HOSTS)
def test_device_nodes(fixtures_root, host):
    spec = mf.HOSTS[host]
    dev = fixtures_root / host / "dev"

    def node(rel: str) -> tuple[int, int]:
        st = (dev / rel).lstat()
        assert stat.S_ISCHR(st.st_mode), rel
        return os.major(st.st_rdev), os.minor(st.st_rdev)

    assert node("nvidiactl") == (195, 255)
    assert node("nvidia-modeset") == (195, 254)
    assert node("nvidia-uvm") == (235, 0) and node("nvidia-uvm-tools") == (235, 1)
    for gpu in spec.gpus:
        assert node(f"nvidia{gpu.minor}") == (195, gpu.minor)
    minors = [int(line.split()[1]) for line in
              (fixtures_root / host / "proc/driver/nvidia-caps/mig-minors").read_text().splitlines()]
    assert sorted(p.name for p in (dev / "nvidia-caps").iterdir()) == sorted(f"nvidia-cap{m}" for m in minors)
    for m in minors:
        assert node(f"nvidia-caps/nvidia-cap{m}") == (236, m)


@pytest.mark.parametrize("host", HOSTS)
def test_binaries_ipc_firmware(fixtures_root, host):
    spec = mf.HOSTS[host]
    root = fixtures_root / host
    for name in mf.BINARIES:
        target = resolve_in_root(root, f"usr/bin/{name}")
        assert target.is_file() and os.access(target, os.X_OK)
    assert not (root / "usr/bin/nv-fabricmanager").exists()
    assert stat.S_ISSOCK((root / "run/nvidia-persistenced/socket").lstat().st_mode)
    assert (root / "tmp/nvidia-mps").is_dir()
    for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert (root / f"lib/firmware/nvidia/{spec.driver}/{fw}").is_file()
    conf = (root / mf.nvml_lib_path(spec)).parent / "fake-nvml.conf"
    assert conf.read_text() == mf.nvml_conf(spec)


def test_mixed_450_minors_differ_from_indices():
    gpus = mf.HOSTS["host-mixed-450"].gpus
    assert [(g.index, g.minor, g.brand) for g in gpus] == [(0, 1, 2), (1, 0, 5)]


# ------------------------------------------------------------- containers

NOTE_KEYS = {"Format", "CUDA Version", "Driver", "Device"}


@pytest.mark.parametrize("name", sorted(mf.CONTAINERS))
def test_container_rootfs(fixtures_root, name):
    spec = mf.CONTAINERS[name]
    root = fixtures_root / name
    family = mf.FAMILIES[spec.family]
    for applet in mf.BUSYBOX_APPLETS:
        assert os.readlink(root / family.bindir / applet) == "busybox"
    assert resolve_in_root(root, "/bin/sh").is_file()
    assert resolve_in_root(root, "/lib64/ld-linux-x86-64.so.2").is_file()
    assert resolve_in_root(root, "/sbin/ldconfig").is_file()
    assert (root / "usr/bin/cuda-probe").is_file()
    for d in ("proc", "dev", "sys", "tmp"):
        assert (root / d).is_dir()
    cache = {name: p for name, _, p in read_ld_cache(root / "etc/ld.so.cache")}
    assert cache["libc.so.6"] == f"/{family.libdir}/libc.so.6"
    if spec.family == "debian":
        assert (root / "etc/debian_version").is_file()
        assert (root / "usr/lib/x86_64-linux-gnu").is_dir()
        assert "include /etc/ld.so.conf.d/*.conf" in (root / "etc/ld.so.conf").read_text()
    else:
        assert 'ID="rhel"' in (root / "etc/os-release").read_text()
        assert (root / "etc/redhat-release").is_file()
        assert not (root / "usr/lib/x86_64-linux-gnu").exists()
        assert "/usr/lib64" in (root / "etc/ld.so.conf").read_text().split()


@pytest.mark.parametrize("name", [n for n, s in sorted(mf.CONTAINERS.items()) if s.compat])
def test_compat_libraries(fixtures_root, name):
    compat = mf.CONTAINERS[name].compat
    root = fixtures_root / name
    assert os.readlink(root / "usr/local/cuda") == compat.cuda_dir
    libdir = root / "usr/local/cuda/compat"
    lib = libdir / f"libcuda.so.{compat.version}"
    assert os.readlink(libdir / "libcuda.so.1") == lib.name
    assert (libdir / f"libnvidia-ptxjitcompiler.so.{compat.version}").is_file()
    assert soname_of(lib) == "libcuda.so.1"
    assert label_of(lib) == f"compat libcuda {compat.version}"
    version = ctypes.c_int()
    assert ctypes.CDLL(str(lib)).cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == compat.cuda
    notes = fwd_compat_notes(lib)
    if compat.note is None:
        assert notes == []
    else:
        assert [n["owner"] for n in notes] == ["NVIDIA Corporation"]
        desc = json.loads(notes[0]["desc"])
        assert set(desc) == NOTE_KEYS and desc == compat.note
    readelf = subprocess.run(["readelf", "-n", str(lib)], capture_output=True, text=True, check=True).stdout
    assert ("NVIDIA Corporation" in readelf) == (compat.note is not None)
    cudart = root / f"usr/local/{compat.cuda_dir}/targets/x86_64-linux/lib/libcudart.so.{compat.cudart}"
    assert soname_of(cudart) == f"libcudart.so.{compat.cudart.split('.')[0]}.0"


def test_branch470_note(fixtures_root):
    lib = fixtures_root / "container-cuda113-branch470/usr/local/cuda/compat/libcuda.so.465.19.01"
    assert json.loads(fwd_compat_notes(lib)[0]["desc"])["Driver"] == [470]


def test_build_compat_lib_with_any_version(tmp_path):
    note = {"Format": 1, "CUDA Version": "12.4", "Driver": [535, 550], "Device": [2]}
    lib = mf.build_compat_lib(tmp_path / "compat", "550.54.15", note, 12040)
    assert lib == tmp_path / "compat/libcuda.so.550.54.15"
    assert json.loads(fwd_compat_notes(lib)[0]["desc"]) == note
    assert label_of(lib) == "compat libcuda 550.54.15"
    plain = mf.build_compat_lib(tmp_path / "plain", "550.54.15", None, 12040)
    assert fwd_compat_notes(plain) == []


@pytest.mark.parametrize("name", sorted(mf.CONTAINERS))
def test_bundles(fixtures_root, name):
    bundle = fixtures_root / f"bundle-{name}"
    config = json.loads((bundle / "config.json").read_text())
    assert config["root"] == {"path": f"../{name}", "readonly": False}
    assert (bundle / config["root"]["path"]).resolve() == (fixtures_root / name).resolve()
    process = config["process"]
    assert process["terminal"] is False and "rlimits" not in process
    assert process["args"] == ["/bin/sh", "-c", "true"]
    env = dict(e.split("=", 1) for e in process["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "PATH" in env
    if name.startswith("container-cuda113"):
        assert env["CUDA_VERSION"] == "11.3.1"
        assert env["NVIDIA_REQUIRE_CUDA"].startswith("cuda>=11.3 brand=tesla,driver>=418,driver<419 ")


def test_demo_state(fixtures_root):
    state = json.loads((fixtures_root / "demo-state.json").read_text())
    assert state["status"] == "creating" and state["id"] == "demo" and "pid" not in state
    assert Path(state["bundle"]).is_absolute()
    assert Path(state["bundle"], "config.json").is_file()


@pytest.mark.skipif(shutil.which("runc") is None or os.geteuid() != 0, reason="needs runc and root")
def test_runc_runs_the_container(fixtures_root, tmp_path):
    """The rootfs boots under real runc; cuda-probe runs (and finds no libcuda)."""
    config = json.loads((fixtures_root / "bundle-container-debian/config.json").read_text())
    config["root"]["path"] = str(fixtures_root / "container-debian")
    config["process"]["args"] = ["/bin/sh", "-c", "cuda-probe; echo rc=$?"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(["runc", "run", f"nvhook-fixture-{os.getpid()}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "cannot load libcuda.so.1" in proc.stdout + proc.stderr and "rc=1" in proc.stdout
