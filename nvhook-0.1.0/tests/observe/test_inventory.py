"""The host inventory (nvhook.observe.host): driver libraries from the host root's ld.so.cache, binaries,
device nodes, IPC paths, firmware, GPUs from procfs or NVML (the fixture hosts' fake
libnvidia-ml through the real pynvml), and the inventory cache."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
from hostfix import config_dict, copy_host, fx, lib_names, mf, named, private_dir, processes, spec  # noqa: F401

from nvhook.base.errors import HookError
from nvhook.base.log import EventLog
from nvhook.observe import host

LIB64 = "/usr/lib/x86_64-linux-gnu"
LIB32 = "/usr/lib/i386-linux-gnu"


def observe(root: Path, cache_dir: Path | str = "") -> tuple[dict, EventLog]:
    log = EventLog("debug")
    return host.observe(str(root), str(cache_dir), log), log


def by_name(inv_or_files: dict, kind: str = "library") -> dict[str, dict]:
    files = inv_or_files.get("files", inv_or_files)
    return {lib["name"]: lib for lib in files["libraries"] if lib["kind"] == kind}


def ldconfig(root: Path) -> None:
    subprocess.run(["ldconfig", "-i", "-r", str(root)], check=True, capture_output=True)


# --- host-gpu8: a full install with 32-bit libraries and a stale libcuda ------------------------

@pytest.fixture(scope="module")
def gpu8(fx):
    inv, log = observe(fx / "host-gpu8")
    return inv, log


def test_gpu8_libraries_64_and_32_bit(gpu8, fx):
    inv, _ = gpu8
    driver = spec("host-gpu8").driver
    assert inv["driver"]["version"] == driver == "535.261.03"
    assert inv["driver"]["source"] == "procfs"
    want64 = {lib.name + ".so" for lib in mf.LIBRARIES}
    want32 = {lib.name + ".so" for lib in mf.LIBRARIES if lib.lib32}
    assert lib_names(inv["files"]["libraries"]) == want64
    assert lib_names(inv["files"]["libraries"], "library32") == want32
    for kind, libdir, arch in (("library", LIB64, "x86_64"), ("library32", LIB32, "i386")):
        for name, lib in by_name(inv, kind).items():
            fl = mf.LIBRARY[name[:-3]]
            assert lib["arch"] == arch
            assert lib["path"] == f"{libdir}/{fl.real_name(driver)}"
            assert lib["file"] == fl.real_name(driver)
            assert lib["source"] == str(fx / "host-gpu8") + lib["path"]
            assert lib["cap"] == fl.capability
            assert lib["soname"] == fl.soname_for(driver)


def test_gpu8_32bit_files_are_32bit_elf(gpu8):
    from nvhook.observe.host import elf

    inv, _ = gpu8
    for lib in by_name(inv, "library32").values():
        assert elf.elf_facts(lib["source"])["class"] == 32


def test_gpu8_stale_libcuda_470_is_rejected_with_its_reason(gpu8):
    inv, log = gpu8
    assert by_name(inv)["libcuda.so"]["path"] == f"{LIB64}/libcuda.so.535.261.03"
    skipped = [e for e in named(log.events, "library.skipped") if e["library"] == "libcuda.so"]
    assert len(skipped) == 1
    ev = skipped[0]
    # a leftover of an older driver beside this driver's own file: info, not a warning on
    # every start (the container gets this driver's file; nothing to act on)
    assert ev["level"] == "info" and "this driver's own file is used" in ev["reason"]
    assert ev["entry"] == f"{LIB64}/nvidia-old/libcuda.so.1"
    assert ev["file"] == f"{LIB64}/nvidia-old/libcuda.so.470.82.01"
    assert "535.261.03" in ev["reason"] and "driver version" in ev["reason"]
    # The stale entry really comes first in the cache: the choice is not by accident.
    from nvhook.observe.host import ldcache

    entries = [p for k, p, a in ldcache.read(inv["root"] + "/etc/ld.so.cache") if k == "libcuda.so.1" and a == "x86_64"]
    assert entries[0].endswith("nvidia-old/libcuda.so.1")


def test_gpu8_binaries_ipc_firmware_procfs(gpu8, fx):
    inv, _ = gpu8
    root = str(fx / "host-gpu8")
    files = inv["files"]
    bins = {b["name"]: b for b in files["binaries"]}
    assert set(bins) == set(mf.BINARIES)
    for name, b in bins.items():
        assert b["path"] == f"/usr/bin/{name}" and b["source"] == root + b["path"]
        assert b["cap"] == ("compute" if "mps" in name else "utility")
    ipc = {i["path"]: i for i in files["ipc"]}
    assert set(ipc) == {"/run/nvidia-persistenced/socket", "/tmp/nvidia-mps"}
    assert stat.S_ISSOCK(os.stat(ipc["/run/nvidia-persistenced/socket"]["source"]).st_mode)
    assert ipc["/run/nvidia-persistenced/socket"]["cap"] == "utility"
    assert ipc["/tmp/nvidia-mps"]["cap"] == "compute"
    fw = [f["path"] for f in files["firmware"]]
    assert fw == [f"/lib/firmware/nvidia/535.261.03/{n}" for n in ("gsp_ga10x.bin", "gsp_tu10x.bin")]
    assert all(os.path.isfile(f["source"]) and f["source"].startswith(root) for f in files["firmware"])
    assert files["procfs"] == ["version", "params", "registry"]


def test_gpu8_missing_optional_items_are_debug_level(gpu8):
    _, log = gpu8
    missing = {e["library"]: e["level"] for e in named(log.events, "library.missing")}
    assert missing.get("libnvidia-nscq.so") == "debug"
    assert all(level == "debug" for level in missing.values()), missing
    fm = [e for e in named(log.events, "binary.missing") if e["binary"] == "nv-fabricmanager"]
    assert fm and fm[0]["level"] == "debug"


def test_gpu8_devices_with_real_numbers(gpu8):
    inv, _ = gpu8
    devs = {d["path"]: d for d in inv["files"]["devices"]}
    assert (devs["/dev/nvidiactl"]["major"], devs["/dev/nvidiactl"]["minor"]) == (195, 255)
    assert (devs["/dev/nvidia-modeset"]["major"], devs["/dev/nvidia-modeset"]["minor"]) == (195, 254)
    # nvidia-uvm's major is dynamic: the fixture's is 235, as its /proc/devices says.
    assert mf.UVM_MAJOR == 235
    assert (devs["/dev/nvidia-uvm"]["major"], devs["/dev/nvidia-uvm"]["minor"]) == (235, 0)
    assert (devs["/dev/nvidia-uvm-tools"]["major"], devs["/dev/nvidia-uvm-tools"]["minor"]) == (235, 1)
    for d in inv["files"]["devices"]:
        st = os.stat(d["source"])
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (d["major"], d["minor"])
    caps = {d["cap_name"]: d for d in inv["files"]["devices"] if d["role"] == "mig-cap"}
    assert caps["config"]["minor"] == 1 and caps["monitor"]["minor"] == 2
    assert caps["gpu0/gi1/access"]["minor"] == mf.mig_minor(0, 1) and caps["gpu0/gi1/access"]["major"] == 236
    assert caps["gpu1/gi1/ci1/access"]["minor"] == mf.mig_minor(1, 1, 1)


def test_gpu8_gpus_from_procfs(gpu8):
    inv, log = gpu8
    want = spec("host-gpu8").gpus
    assert inv["gpu_source"] == "procfs"
    assert [(g["index"], g["minor"], g["uuid"], g["bus_id"], g["model"]) for g in inv["gpus"]] == \
        [(g.index, g.minor, g.uuid, g.bus_id, g.name) for g in want]
    assert all(g["source"] == "procfs" and g["brand"] is None and g["cc"] is None for g in inv["gpus"])
    for g in inv["gpus"]:
        assert g["device"]["path"] == f"/dev/nvidia{g['minor']}"
        assert (g["device"]["major"], g["device"]["minor"]) == (195, g["minor"])
    ev = named(log.events, "gpus.procfs")
    assert ev and ev[0]["level"] == "info" and ev[0]["source"] == "procfs" and ev[0]["count"] == 8


@pytest.mark.parametrize("host, key", [("host-gpu8", "GPU Excluded"), ("host-t4-450", "Blacklisted")])
def test_gpu_excluded_by_the_driver_is_skipped(fx, tmp_path, host, key):
    """Drivers before 460 say 'Blacklisted', later ones 'GPU Excluded'."""
    root = copy_host(fx, host, tmp_path)
    gpus = spec(host).gpus
    info = root / f"proc/driver/nvidia/gpus/{gpus[1].bus_id}/information"
    text = info.read_text()
    assert f"{key}:\t No" in text
    info.write_text(text.replace(f"{key}:\t No", f"{key}:\t Yes"))
    inv, log = observe(root)
    assert [g["uuid"] for g in inv["gpus"]] == [g.uuid for g in gpus if g is not gpus[1]]
    assert [g["index"] for g in inv["gpus"]] == list(range(len(gpus) - 1))
    ev = [e for e in named(log.events, "gpu.procfs_problem") if "excluded" in e["problem"]]
    assert len(ev) == 1 and gpus[1].bus_id in ev[0]["problem"] and ev[0]["level"] == "warning"


def test_gpu_minors_differ_from_indices(fx):
    inv, _ = observe(fx / "host-mixed-450")
    assert [(g["index"], g["minor"], g["device"]["minor"]) for g in inv["gpus"]] == [(0, 1, 1), (1, 0, 0)]


# --- host-debian: libraries and binaries behind absolute /etc/alternatives links ----------------

def test_debian_alternatives_resolved_inside_the_host_root(fx):
    root = fx / "host-debian"
    driver = spec("host-debian").driver
    link = root / "usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert os.readlink(link).startswith("/etc/alternatives/")  # absolute: must not escape the root
    assert os.readlink(root / os.readlink(link).lstrip("/")).startswith("/usr/lib/x86_64-linux-gnu/nvidia/current/")
    inv, log = observe(root)
    libs = by_name(inv)
    assert set(libs) == {lib.name + ".so" for lib in mf.LIBRARIES}
    cuda = libs["libcuda.so"]
    assert cuda["path"] == f"/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.{driver}"
    assert cuda["source"] == f"{root}{cuda['path']}" and cuda["file"] == f"libcuda.so.{driver}"
    assert cuda["soname"] == "libcuda.so.1"
    assert libs["libnvidia-glcore.so"]["path"] == f"/usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.{driver}"
    smi = {b["name"]: b for b in inv["files"]["binaries"]}["nvidia-smi"]
    assert smi["path"] == "/usr/lib/nvidia/current/nvidia-smi" and smi["source"].startswith(str(root))
    assert not named(log.events, "library.skipped")


# --- host-broken -----------------------------------------------------------------------------

def test_broken_host_problems_are_warnings_not_errors(fx):
    inv, log = observe(fx / "host-broken")
    libs = by_name(inv)
    assert "libnvidia-opencl.so" not in libs and "libnvidia-ptxjitcompiler.so" not in libs
    assert "libcuda.so" in libs
    missing = {e["library"]: e for e in named(log.events, "library.missing")}
    for name, cap in (("libnvidia-opencl.so", "compute"), ("libnvidia-ptxjitcompiler.so", "compute")):
        assert missing[name]["level"] == "warning" and missing[name]["capability"] == cap
    # libnvidia-cfg: its cache entry is a link to a deleted file.
    assert "libnvidia-cfg.so" not in libs
    sk = [e for e in named(log.events, "library.skipped") if e["library"] == "libnvidia-cfg.so"]
    assert len(sk) == 1 and sk[0]["level"] == "warning"
    assert sk[0]["entry"] == f"{LIB64}/libnvidia-cfg.so.1" and "dangling" in sk[0]["reason"]
    # GPU 1 has no Bus Location: kept, with the directory's bus id, and a warning.
    assert [g["bus_id"] for g in inv["gpus"]] == ["0000:07:00.0", "0000:0f:00.0"]
    probs = [e for e in named(log.events, "gpu.procfs_problem") if "Bus Location" in e["problem"]]
    assert len(probs) == 1 and probs[0]["level"] == "warning" and "0000:0f:00.0" in probs[0]["problem"]


def test_corrupt_ld_so_cache_is_a_hookerror(fx):
    root = fx / "host-badcache"
    with pytest.raises(HookError, match="corrupt ld.so.cache") as e:
        observe(root)
    assert str(root / "etc/ld.so.cache") in str(e.value)


def test_missing_ld_so_cache_is_a_hookerror(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "etc/ld.so.cache").unlink()
    with pytest.raises(HookError, match="no ld.so.cache"):
        observe(root)


def test_driver_version_from_library_names_without_the_module(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "proc/driver/nvidia/version").unlink()
    inv, log = observe(root)
    assert inv["driver"] == {"version": "535.261.03", "source": "library file names", "cuda": None, "cuda_source": None}
    assert named(log.events, "driver.version_guessed")[0]["level"] == "warning"


# --- ELF checks, SONAME, duplicates ------------------------------------------------------------

def test_elf_class_must_match_the_cache_entry(fx, tmp_path):
    """A 32-bit file where the cache says x86-64: skipped, with the reason."""
    root = copy_host(fx, "host-gpu1", tmp_path)
    target = root / "usr/lib/x86_64-linux-gnu/libnvidia-cfg.so.535.261.03"
    shutil.copyfile(fx / "host-gpu8/usr/lib/i386-linux-gnu/libnvidia-ml.so.535.261.03", target)
    inv, log = observe(root)
    assert "libnvidia-cfg.so" not in by_name(inv)
    sk = [e for e in named(log.events, "library.skipped") if e["library"] == "libnvidia-cfg.so"]
    assert len(sk) == 1 and sk[0]["level"] == "warning"
    assert "32-bit i386" in sk[0]["reason"] and "x86_64" in sk[0]["reason"]


def test_non_elf_library_file_is_skipped(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-cfg.so.535.261.03").write_text("not a library\n")
    inv, log = observe(root)
    assert "libnvidia-cfg.so" not in by_name(inv)
    sk = [e for e in named(log.events, "library.skipped") if e["library"] == "libnvidia-cfg.so"]
    assert sk and "not an ELF file" in sk[0]["reason"]


def test_soname_is_read_from_the_elf_file(fx, tmp_path):
    """The cache key says libnvidia-cfg.so.1; the file's own DT_SONAME wins."""
    root = copy_host(fx, "host-gpu1", tmp_path)
    obj = mf.compile_driver_lib("libnvidia-cfg", "535.261.03", "libnvidia-cfg.so.7")
    shutil.copyfile(obj, root / "usr/lib/x86_64-linux-gnu/libnvidia-cfg.so.535.261.03")
    inv, _ = observe(root)
    assert by_name(inv)["libnvidia-cfg.so"]["soname"] == "libnvidia-cfg.so.7"


def _with_duplicate_libcuda(root: Path, dup_first: bool) -> None:
    dup = root / "usr/lib/x86_64-linux-gnu/nvidia-dup"
    dup.mkdir(exist_ok=True)
    shutil.copyfile(root / "usr/lib/x86_64-linux-gnu/libcuda.so.535.261.03", dup / "libcuda.so.535.261.03")
    dirs = ["/usr/lib/x86_64-linux-gnu/nvidia-dup", "/usr/lib/x86_64-linux-gnu"]
    (root / "etc/ld.so.conf").write_text("\n".join(dirs if dup_first else dirs[::-1]) + "\n")
    ldconfig(root)


@pytest.mark.parametrize("dup_first", [True, False])
def test_duplicate_valid_entries_first_cache_entry_wins_and_is_logged(fx, tmp_path, dup_first):
    root = copy_host(fx, "host-gpu1", tmp_path)
    _with_duplicate_libcuda(root, dup_first)
    first, second = f"{LIB64}/nvidia-dup/libcuda.so.535.261.03", f"{LIB64}/libcuda.so.535.261.03"
    if not dup_first:
        first, second = second, first
    for _ in range(2):  # deterministic: the same choice every time
        inv, log = observe(root)
        assert by_name(inv)["libcuda.so"]["path"] == first
        dups = [e for e in named(log.events, "library.duplicate") if e["library"] == "libcuda.so"]
        assert len(dups) == 1
        assert dups[0]["chosen"] == first and dups[0]["skipped"] == second and dups[0]["reason"]


# --- binaries, devices, IPC on modified hosts --------------------------------------------------

def test_binary_found_in_sbin(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "usr/sbin").mkdir(exist_ok=True)
    os.rename(root / "usr/bin/nvidia-persistenced", root / "usr/sbin/nvidia-persistenced")
    inv, _ = observe(root)
    b = {b["name"]: b for b in inv["files"]["binaries"]}["nvidia-persistenced"]
    assert b["path"] == "/usr/sbin/nvidia-persistenced"


def test_missing_binary_is_a_warning(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "usr/bin/nvidia-smi").unlink()
    inv, log = observe(root)
    assert "nvidia-smi" not in {b["name"] for b in inv["files"]["binaries"]}
    ev = [e for e in named(log.events, "binary.missing") if e["binary"] == "nvidia-smi"]
    assert ev and ev[0]["level"] == "warning"


def _mknod(path: Path, major: int, minor: int) -> None:
    if path.exists() or path.is_symlink():
        path.unlink()
    os.mknod(path, 0o20666, os.makedev(major, minor))


def _set_proc_major(root: Path, name: str, major: int) -> None:
    p = root / "proc/devices"
    lines = [f"{major} {name}" if line.split()[1:] == [name] else line for line in p.read_text().splitlines()]
    p.write_text("\n".join(lines) + "\n")


def test_uvm_major_is_whatever_the_node_says(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    _mknod(root / "dev/nvidia-uvm", 240, 0)
    _mknod(root / "dev/nvidia-uvm-tools", 240, 1)
    _set_proc_major(root, "nvidia-uvm", 240)
    inv, log = observe(root)
    devs = {d["role"]: d for d in inv["files"]["devices"]}
    assert (devs["uvm"]["major"], devs["uvm"]["minor"]) == (240, 0)
    assert (devs["uvm-tools"]["major"], devs["uvm-tools"]["minor"]) == (240, 1)
    assert not named(log.events, "device.major_mismatch")


def test_uvm_node_disagreeing_with_proc_devices_is_a_warning(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    _mknod(root / "dev/nvidia-uvm", 241, 0)
    inv, log = observe(root)
    ev = named(log.events, "device.major_mismatch")
    assert len(ev) == 1 and ev[0]["device"] == "/dev/nvidia-uvm"
    assert ev[0]["major"] == 241 and ev[0]["proc_devices"] == 235


def test_device_that_is_not_a_character_device_is_refused(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    (root / "dev/nvidia-modeset").unlink()
    (root / "dev/nvidia-modeset").write_text("")
    inv, log = observe(root)
    assert "/dev/nvidia-modeset" not in {d["path"] for d in inv["files"]["devices"]}
    ev = named(log.events, "device.invalid")
    assert ev and ev[0]["device"] == "/dev/nvidia-modeset" and "character device" in ev[0]["reason"]
    assert ev[0]["level"] == "warning"


def test_gpu_device_node_missing_or_not_a_chardev(fx, tmp_path):
    root = copy_host(fx, "host-mixed-450", tmp_path)
    (root / "dev/nvidia1").unlink()
    (root / "dev/nvidia0").unlink()
    (root / "dev/nvidia0").write_text("")
    inv, log = observe(root)
    assert [g["device"] for g in inv["gpus"]] == [None, None]
    ev = {e["device"]: e for e in named(log.events, "device.missing")}
    assert ev["/dev/nvidia1"]["gpu"] == 0 and ev["/dev/nvidia0"]["reason"] == "not a character device"


def test_ipc_path_that_is_a_regular_file_is_refused(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    sock = root / "run/nvidia-persistenced/socket"
    sock.unlink()
    sock.write_text("")
    inv, log = observe(root)
    assert "/run/nvidia-persistenced/socket" not in {i["path"] for i in inv["files"]["ipc"]}
    assert named(log.events, "ipc.invalid")[0]["path"] == "/run/nvidia-persistenced/socket"


# --- the inventory cache -----------------------------------------------------------------------

def _built(log: EventLog) -> bool:
    if named(log.events, "inventory.built"):
        assert not named(log.events, "inventory.cache_hit")
        return True
    assert named(log.events, "inventory.cache_hit")
    return False


@pytest.fixture
def cached_host(fx, tmp_path):
    """A host copy and a private cache dir, with the cache already built."""
    root = copy_host(fx, "host-gpu1", tmp_path / "hosts")
    cache = private_dir(tmp_path / "cache")
    inv, log = observe(root, cache)
    assert _built(log) and named(log.events, "inventory.built")[0]["cached"] is True
    return root, cache, inv


def test_cache_hit_gives_the_same_inventory(cached_host):
    root, cache, first = cached_host
    inv, log = observe(root, cache)
    assert not _built(log)
    assert inv["files"] == first["files"]
    assert [g["uuid"] for g in inv["gpus"]] == [g["uuid"] for g in first["gpus"]]


def test_cache_written_by_other_code_is_rebuilt(cached_host, tmp_path, monkeypatch):
    """An nvhook upgrade or a catalog change rewrites the modules that decide what an inventory
    holds: a cache written by the old code is never read (no format number to bump by hand)."""
    from nvhook.observe.host import cache as cache_mod

    root, cache, _ = cached_host
    copies = []
    for i, path in enumerate(cache_mod._CODE):
        c = tmp_path / f"code{i}.py"
        c.write_bytes(Path(path).read_bytes())
        copies.append(str(c))
    monkeypatch.setattr(cache_mod, "_CODE", tuple(copies))
    _, log = observe(root, cache)
    assert _built(log)  # identity of the code differs from the one recorded
    _, log = observe(root, cache)
    assert not _built(log)
    _bump_mtime(Path(copies[0]))  # "catalog.py" changed
    _, log = observe(root, cache)
    assert _built(log)


def test_every_fixed_catalog_device_is_inventoried(fx):
    from nvhook.base import catalog

    inv, _ = observe(fx / "host-gpu8", "")
    roles = {d["role"] for d in inv["files"]["devices"]}
    assert {role for _, role, _, _ in catalog.FIXED_DEVICES} <= roles


def test_cache_hit_replays_the_problems(fx, tmp_path):
    cache = private_dir(tmp_path / "cache")
    root = fx / "host-gpu8"
    observe(root, cache)
    inv, log = observe(root, cache)
    assert not _built(log)
    assert [e["library"] for e in named(log.events, "library.skipped")] == ["libcuda.so"]


def _bump_mtime(p: Path) -> None:
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("change", [
    "touch library", "rewrite library", "touch ld.so.cache", "rerun ldconfig", "module version",
    "uvm renumbered", "uvm appears", "persistenced socket appears", "mig cap node appears", "imex channel appears",
])
def test_cache_invalidation(cached_host, change):
    root, cache, first = cached_host
    lib = root / "usr/lib/x86_64-linux-gnu/libcuda.so.535.261.03"
    if change == "touch library":
        _bump_mtime(lib)
    elif change == "rewrite library":
        data = lib.read_bytes()
        lib.unlink()
        lib.write_bytes(data)  # same bytes, a new file
    elif change == "touch ld.so.cache":
        _bump_mtime(root / "etc/ld.so.cache")
    elif change == "rerun ldconfig":
        ldconfig(root)
    elif change == "module version":
        p = root / "proc/driver/nvidia/version"
        p.write_text(p.read_text().replace("Tue Nov 18 2025", "Wed Nov 19 2025"))
    elif change == "uvm renumbered":
        _mknod(root / "dev/nvidia-uvm", 240, 0)
    elif change in ("uvm appears", "persistenced socket appears", "mig cap node appears",
                    "imex channel appears"):
        # Built without it, then it appears (module loaded, daemon started after boot).
        path = {"uvm appears": "dev/nvidia-uvm", "persistenced socket appears": "run/nvidia-persistenced/socket",
                "mig cap node appears": "dev/nvidia-caps/nvidia-cap1",
                "imex channel appears": "dev/nvidia-caps-imex-channels/channel0"}[change]
        p = root / path
        if p.exists():
            saved = p.with_name(p.name + ".saved")
            os.rename(p, saved)
            inv, log = observe(root, cache)
            assert _built(log)  # its disappearance is noticed ...
            inv, log = observe(root, cache)
            assert not _built(log)
            os.rename(saved, p)
        else:
            p.parent.mkdir(exist_ok=True)
            _mknod(p, 237, 0)
    inv, log = observe(root, cache)
    assert _built(log), change  # ... and so is this one
    if change == "uvm renumbered":
        assert {d["role"]: d["major"] for d in inv["files"]["devices"]}["uvm"] == 240
    if change == "uvm appears":
        assert "uvm" in {d["role"] for d in inv["files"]["devices"]}
    if change == "imex channel appears":
        assert [d["path"] for d in inv["files"]["devices"] if d["role"] == "imex"] == \
            ["/dev/nvidia-caps-imex-channels/channel0"]
    inv, log = observe(root, cache)
    assert not _built(log)


@pytest.mark.parametrize("unsafe", ["world-writable", "group-writable", "not owned"])
def test_unsafe_cache_dir_is_ignored(fx, tmp_path, unsafe):
    root = fx / "host-gpu1"
    cache = private_dir(tmp_path / "cache")
    observe(root, cache)  # a valid cache file is there ...
    assert list(cache.glob("inventory*.json"))
    if unsafe == "world-writable":
        os.chmod(cache, 0o777)
    elif unsafe == "group-writable":
        os.chmod(cache, 0o770)
    else:
        os.chown(cache, 65534, 65534)
    for _ in range(2):  # ... but never read, nor rewritten
        before = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
        inv, log = observe(root, cache)
        assert _built(log)
        assert named(log.events, "inventory.built")[0]["cached"] is False
        assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == before


def test_forged_or_garbage_cache_file_is_ignored(cached_host):
    root, cache, first = cached_host
    (f,) = cache.glob("inventory*.json")
    f.write_text("{not json")
    inv, log = observe(root, cache)
    assert _built(log) and inv["files"] == first["files"]
    f.write_text('{"format": 2, "files": {"root": "/elsewhere"}, "stamp": {}}')
    inv, log = observe(root, cache)
    assert _built(log) and inv["files"] == first["files"]


def test_cache_dir_is_created_private(fx, tmp_path):
    cache = tmp_path / "new" / "cache"
    inv, log = observe(fx / "host-gpu1", cache)
    assert named(log.events, "inventory.built")[0]["cached"] is True
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700


# --- NVML through the fake libnvidia-ml and the real pynvml ------------------------------------

def _nvml_conf(root: Path) -> Path:
    return root / "usr/lib/x86_64-linux-gnu/fake-nvml.conf"


def _set_init(root: Path, mode: str) -> None:
    p = _nvml_conf(root)
    p.write_text(p.read_text().replace("\ninit ok\n", f"\ninit {mode}\n"))
    assert f"\ninit {mode}\n" in p.read_text()


def _own_children() -> set[int]:
    me = str(os.getpid())
    return {pid for pid, fields in processes().items() if fields[1] == me}


@pytest.fixture(autouse=True)
def _children_before():
    """The children pytest had before the test (a session fixture's, such as the Debian 13
    node's holder): not the test's, never counted or killed by _children."""
    _KNOWN.clear()
    _KNOWN.update(_own_children())
    yield


_KNOWN: set[int] = set()


def _children() -> list[int]:
    """The children this test left; killed on the way (a leftover must fail one test, not hang
    others)."""
    out = sorted(_own_children() - _KNOWN)
    for pid in out:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return out


def test_nvml_facts_merged(fx, tmp_path):
    root = fx / "host-gpu8"
    inv, log = observe(root)
    assert host.add_nvml(inv, config_dict(tmp_path / "c"), log, reason="test") is True
    assert inv["gpu_source"] == "nvml"
    assert inv["driver"]["cuda"] == "12.2" and inv["driver"]["cuda_source"] == "nvml"
    assert len(inv["gpus"]) == len(spec("host-gpu8").gpus)
    for g, s in zip(inv["gpus"], spec("host-gpu8").gpus):
        assert g["source"] == "nvml"
        assert g["brand_id"] == s.brand and g["brand"] == host.BRAND_NAMES[s.brand]
        assert g["cc"] == f"{s.cc[0]}.{s.cc[1]}"
        assert g["mig_mode"] == {"1": True, "0": False, "na": None}[s.mig_mode]
        assert [(m["uuid"], m["gi"], m["ci"], m["index"]) for m in g["migs"]] == \
            [(m.uuid, m.gi, m.ci, m.slot) for m in s.migs]
    assert [g["brand"] for g in inv["gpus"]][::3] == ["tesla", "tesla", "geforcertx"]
    q = named(log.events, "nvml.queried")
    assert len(q) == 1 and q[0]["library"].startswith(str(root))
    assert named(log.events, "gpus.nvml")[0]["source"] == "nvml"
    assert _children() == []


@pytest.mark.parametrize("mode, error", [("fail", "Driver Not Loaded"), ("fail 999", "Unknown Error")])
def test_nvml_init_failure_falls_back_to_procfs(fx, tmp_path, mode, error):
    root = copy_host(fx, "host-gpu1", tmp_path)
    _set_init(root, mode)
    inv, log = observe(root)
    assert host.add_nvml(inv, config_dict(tmp_path / "c"), log, reason="test") is False
    assert inv["gpu_source"] == "procfs" and inv["nvml_state"] == "failed"
    assert all(g["source"] == "procfs" and g["brand"] is None for g in inv["gpus"])
    ev = named(log.events, "nvml.unavailable")
    assert len(ev) == 1 and ev[0]["level"] == "warning" and ev[0]["fallback"] == "procfs"
    assert error in ev[0]["error"]
    assert _children() == []


def test_nvml_hang_is_bounded_by_the_timeout(fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path)
    _set_init(root, "hang")
    inv, log = observe(root)
    t = time.monotonic()
    assert host.add_nvml(inv, config_dict(tmp_path / "c", nvml_timeout=0.5), log, reason="test") is False
    elapsed = time.monotonic() - t
    assert 0.5 <= elapsed < 30, f"gave up after {elapsed:.1f} s, not at the 0.5 s timeout (the fake hangs for good)"
    ev = named(log.events, "nvml.unavailable")
    assert ev and "within 0.5 s" in ev[0]["error"] and ev[0]["fallback"] == "procfs"
    assert _children() == []  # the hung query process was killed and reaped


def test_nvml_disabled_in_config(fx, tmp_path):
    inv, log = observe(fx / "host-gpu1")
    cfg = config_dict(tmp_path / "c")
    cfg["nvml"]["enabled"] = False
    assert host.add_nvml(inv, cfg, log, reason="test") is False
    (ev,) = named(log.events, "nvml.unavailable")
    assert ev["level"] == "warning" and ev["state"] == "disabled" and "[nvml] enabled" in ev["error"]
    assert inv["gpu_source"] == "procfs"


def test_nvml_queried_at_most_once_per_run(fx, tmp_path):
    inv, log = observe(fx / "host-gpu1")
    cfg = config_dict(tmp_path / "c")
    assert host.add_nvml(inv, cfg, log, reason="a") and host.add_nvml(inv, cfg, log, reason="b")
    assert len(named(log.events, "nvml.queried")) == 1


def test_nvml_facts_cached_until_mig_instances_change(fx, tmp_path):
    root = copy_host(fx, "host-gpu8", tmp_path / "h")
    cache = private_dir(tmp_path / "cache")
    cfg = config_dict(cache)
    inv, log = observe(root, cache)
    assert host.add_nvml(inv, cfg, log, reason="t")
    assert named(log.events, "nvml.queried")
    # Next run: facts from the cache, no query (the query costs a fork and pynvml's import).
    _set_init(root, "fail")  # would fail if it were asked
    inv, log = observe(root, cache)
    assert host.add_nvml(inv, cfg, log, reason="t")
    assert not named(log.events, "nvml.queried") and named(log.events, "nvml.cache_hit")
    assert named(log.events, "gpus.nvml")[0]["cached"] is True
    assert inv["gpus"][0]["migs"] and inv["gpus"][0]["brand"] == "tesla"
    # A new GPU instance on GPU 2. Requests by MIG UUID still use the cache (the UUIDs it
    # lists name the same instances); requests by index must see the live instances, so
    # NVML is asked again (and fails here, as set up above).
    (root / "proc/driver/nvidia/capabilities/gpu2/mig/gi3").mkdir(parents=True)
    inv, log = observe(root, cache)
    assert host.add_nvml(inv, cfg, log, reason="t")
    assert not named(log.events, "nvml.unavailable")
    assert host.add_nvml(inv, cfg, log, reason="t", live_instances=True) is False
    assert named(log.events, "nvml.unavailable")
    inv, log = observe(root, cache)
    assert host.add_nvml(inv, cfg, log, reason="t", live_instances=True) is False
    assert named(log.events, "nvml.unavailable") and not named(log.events, "nvml.cache_hit")
    # refresh: the cached facts could not answer; NVML is asked even though the cache matched.
    inv, log = observe(root, cache)
    assert host.add_nvml(inv, cfg, log, reason="t")
    assert host.add_nvml(inv, cfg, log, reason="t", refresh=True) is False
    assert named(log.events, "nvml.unavailable")


def test_nvml_refresh_never_asks_twice_in_one_run(fx, tmp_path):
    root = copy_host(fx, "host-gpu8", tmp_path / "h")
    inv, log = observe(root, private_dir(tmp_path / "cache"))
    cfg = config_dict(tmp_path / "cache")
    assert host.add_nvml(inv, cfg, log, reason="a")
    assert host.add_nvml(inv, cfg, log, reason="b", refresh=True)
    assert host.add_nvml(inv, cfg, log, reason="c", live_instances=True)
    assert len(named(log.events, "nvml.queried")) == 1


def test_procfs_reader_closes_what_it_opens(tmp_path):
    """A directory (or anything unreadable) in a procfs file's place: no fd left open."""
    from nvhook.observe.host import procfs

    (tmp_path / "proc/driver/nvidia/version").mkdir(parents=True)
    (tmp_path / "proc/devices").mkdir(parents=True)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert procfs.driver_version(str(tmp_path)) is None
        assert procfs.char_majors(str(tmp_path)) == {}
    assert len(os.listdir("/proc/self/fd")) == before
