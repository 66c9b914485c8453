"""The mount plan (pipeline.decide -> plan.build) for containers on the fixture hosts: which GPUs
a request selects, where libraries and binaries go, devices and their cgroup rules, procfs,
symlinks, and the plan's JSON schema."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hostfix import assert_schema, bundle, config_dict, copy_host, fx, mf, named, private_dir, spec  # noqa: F401

from nvhook.base import catalog
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog
from nvhook.decide import plan as plan_mod
from nvhook.decide.sources import Host, OciBundle
from nvhook.start import pipeline

DRIVER = "535.261.03"
GPU8 = spec("host-gpu8").gpus
DEB64, DEB32 = "/usr/lib/x86_64-linux-gnu", "/usr/lib/i386-linux-gnu"
RH64, RH32 = "/usr/lib64", "/usr/lib"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> dict:
    return config_dict(private_dir(tmp_path_factory.mktemp("plancache")))


@pytest.fixture
def decide(fx, tmp_path, cfg):
    """decide(env..., host=, container=, config=) -> (plan, log)."""
    n = [0]

    def run(*env, host="host-gpu8", container="container-debian", config=None, root=None, **kw):
        n[0] += 1
        b = bundle(tmp_path / f"bundle{n[0]}", fx / container, env, **kw)
        log = EventLog("debug")
        state = {"id": f"c{n[0]}", "pid": None, "bundle": str(b), "annotations": {}}
        p = pipeline.decide(OciBundle.from_state(state), Host(str(root or fx / host), config or cfg, log)).plan
        # Whatever the plan holds must survive JSON as it is (what --format json prints).
        assert json.loads(json.dumps(p)) == p
        return p, log
    return run


def mounts(p, kind=None):
    return [m for m in p["mounts"] if kind is None or m["kind"] == kind]


def targets(p, kind=None):
    return [m["target"] for m in mounts(p, kind)]


def gpu_nodes(p):
    return sorted(t for t in targets(p, "device") if t[len("/dev/nvidia"):].isdigit())


def gpu_proc(p):
    return [t.rsplit("/", 1)[1] for t in targets(p, "procfs") if "/gpus/" in t]


def rules(p):
    return {(r["major"], r["minor"]) for r in p["devices_cgroup"]}


def lib_files(p, kind="library"):
    """Shared objects only: loader configs (Vulkan/EGL json, the OpenCL ICD, nvoptix.bin) ride
    along as kind "library"."""
    return {t.rsplit("/", 1)[1] for t in targets(p, kind) if t not in catalog.CONFIGS}


# --- selecting GPUs ----------------------------------------------------------------------------

def test_indices_select_only_those_gpus(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0,2")
    assert [g["index"] for g in p["gpus"]] == [0, 2]
    for g, s in zip(p["gpus"], (GPU8[0], GPU8[2])):
        assert (g["minor"], g["uuid"], g["bus_id"], g["model"]) == (s.minor, s.uuid, s.bus_id, s.name)
    assert gpu_nodes(p) == ["/dev/nvidia0", "/dev/nvidia2"]
    assert gpu_proc(p) == [GPU8[0].bus_id, GPU8[2].bus_id]
    assert (195, 0) in rules(p) and (195, 2) in rules(p)
    assert not {(195, m) for m in (1, 3, 4, 5, 6, 7)} & rules(p)


def test_duplicate_ids_select_a_gpu_once(decide):
    p, _ = decide(f"NVIDIA_VISIBLE_DEVICES=1,{GPU8[1].uuid},{GPU8[1].bus_id}")
    assert [g["index"] for g in p["gpus"]] == [1]
    assert gpu_nodes(p) == ["/dev/nvidia1"]


@pytest.mark.parametrize("form", [str.lower, str.upper, lambda u: "gpu-" + u[4:].upper()])
def test_gpu_uuid_any_case(decide, form):
    p, _ = decide(f"NVIDIA_VISIBLE_DEVICES={form(GPU8[3].uuid)}")
    assert [g["index"] for g in p["gpus"]] == [3]
    assert gpu_nodes(p) == ["/dev/nvidia3"]


@pytest.mark.parametrize("bus, index", [
    ("0000:47:00.0", 2), ("47:00.0", 2), ("00000000:47:00.0", 2),
    ("0000:4E:00.0", 3), ("4e:00.0", 3), ("00000000:BD:00.0", 7),
])
def test_pci_bus_id_short_and_long_forms(decide, bus, index):
    p, _ = decide(f"NVIDIA_VISIBLE_DEVICES={bus}")
    assert [g["index"] for g in p["gpus"]] == [index]
    assert gpu_proc(p) == [GPU8[index].bus_id]


def _caps(gpu: int, gi: int, ci: int) -> set:
    minor = GPU8[gpu].minor
    return {(236, mf.mig_minor(minor, gi)), (236, mf.mig_minor(minor, gi, ci))}


def _all_caps() -> set:
    return {(236, m) for g in GPU8 for mig in g.migs
            for m in (mf.mig_minor(g.minor, mig.gi), mf.mig_minor(g.minor, mig.gi, mig.ci))}


@pytest.mark.parametrize("token, gpu, slot", [
    (GPU8[0].migs[1].uuid, 0, 1),
    (GPU8[0].migs[1].uuid.lower(), 0, 1),
    ("mig-" + GPU8[1].migs[0].uuid[4:].upper(), 1, 0),
    ("0:0", 0, 0),
    ("1:1", 1, 1),
])
def test_mig_devices_by_uuid_and_gpu_colon_mig(decide, token, gpu, slot):
    """Needs NVML (the fake one): the parent GPU's node and exactly that instance's caps."""
    p, log = decide(f"NVIDIA_VISIBLE_DEVICES={token}")
    mig = GPU8[gpu].migs[slot]
    assert [g["index"] for g in p["gpus"]] == [gpu]
    assert gpu_nodes(p) == [f"/dev/nvidia{GPU8[gpu].minor}"]
    want = _caps(gpu, mig.gi, mig.ci)
    cap_targets = {t for t in targets(p, "device") if "nvidia-caps" in t}
    assert cap_targets == {f"/dev/nvidia-caps/nvidia-cap{m}" for _, m in want}
    assert rules(p) & _all_caps() == want
    assert gpu_proc(p) == [GPU8[gpu].bus_id]
    assert named(log.events, "gpus.nvml")


def test_two_mig_devices_of_one_gpu(decide):
    a, b = GPU8[1].migs
    p, _ = decide(f"NVIDIA_VISIBLE_DEVICES={a.uuid},{b.uuid}")
    assert [g["index"] for g in p["gpus"]] == [1]
    assert rules(p) & _all_caps() == _caps(1, a.gi, a.ci) | _caps(1, b.gi, b.ci)


@pytest.mark.parametrize("token", ["MIG-00000000-0000-0000-0000-000000000000", "0:5", "2:0"])
def test_unknown_mig_device_is_an_error_naming_it(decide, token):
    with pytest.raises(HookError, match="unknown MIG device") as e:
        decide(f"NVIDIA_VISIBLE_DEVICES={token}")
    assert repr(token) in str(e.value)


def test_mig_request_without_nvml_is_an_error(decide, fx, tmp_path):
    root = copy_host(fx, "host-gpu8", tmp_path / "h")
    conf = root / "usr/lib/x86_64-linux-gnu/fake-nvml.conf"
    conf.write_text(conf.read_text().replace("\ninit ok\n", "\ninit fail\n"))
    cfg = config_dict(private_dir(tmp_path / "cache"))
    with pytest.raises(HookError, match="NVML is unavailable") as e:
        decide(f"NVIDIA_VISIBLE_DEVICES={GPU8[0].migs[0].uuid}", root=root, config=cfg)
    assert GPU8[0].migs[0].uuid in str(e.value)


@pytest.mark.parametrize("token", ["8", "01x", "GPU-00000000-0000-0000-0000-000000000000", "0000:99:00.0", "99:00.0"])
def test_unknown_device_is_an_error_naming_it(decide, token):
    with pytest.raises(HookError, match="unknown device") as e:
        decide(f"NVIDIA_VISIBLE_DEVICES=0,{token}")
    assert repr(token) in str(e.value)


def test_all_selects_every_gpu(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=all")
    assert [g["index"] for g in p["gpus"]] == list(range(8))
    assert gpu_nodes(p) == sorted(f"/dev/nvidia{i}" for i in range(8))
    assert gpu_proc(p) == [g.bus_id for g in GPU8]


def test_none_gives_the_driver_but_no_gpu(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=none")
    assert p["gpus"] == [] and gpu_nodes(p) == [] and gpu_proc(p) == []
    assert p["request"]["devices"] == ["none"]
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= set(targets(p, "device"))
    assert f"libcuda.so.{DRIVER}" in lib_files(p) and "/usr/bin/nvidia-smi" in targets(p, "binary")
    assert not {(195, m) for m in range(8)} & rules(p)
    assert "/proc/driver/nvidia" in targets(p, "tmpfs")


@pytest.mark.parametrize("env, reason", [
    (("NVIDIA_VISIBLE_DEVICES=void",), "'void'"),
    (("NVIDIA_VISIBLE_DEVICES=",), "''"),
    (("NVIDIA_VISIBLE_DEVICES= , ",), "nothing requested"),
    ((), "not a GPU container"),
    (("NVIDIA_DRIVER_CAPABILITIES=all",), "not a GPU container"),
])
def test_void_requests_give_an_empty_plan_with_a_reason(decide, env, reason):
    p, _ = decide(*env)
    assert p["mounts"] == [] and p["symlinks"] == [] and p["devices_cgroup"] == [] and p["gpus"] == []
    assert p["ldconfig"] is None
    assert p["compat"]["decision"] == "none" and reason in p["compat"]["reason"]
    assert_schema(p)


def test_minor_numbers_not_equal_to_indices(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", host="host-mixed-450")
    assert [(g["index"], g["minor"]) for g in p["gpus"]] == [(0, 1)]
    assert gpu_nodes(p) == ["/dev/nvidia1"]
    assert (195, 1) in rules(p) and (195, 0) not in rules(p)


def test_legacy_cuda_image_gets_everything(decide):
    p, _ = decide("CUDA_VERSION=12.0.1")
    assert len(p["gpus"]) == 8
    assert set(p["request"]["capabilities"]) == {"compute", "compat32", "graphics", "utility", "video",
                                                 "display", "ngx"}
    assert p["request"]["requirements"] == ["cuda>=12.0"]
    assert "/dev/nvidia-modeset" in targets(p, "device") and mounts(p, "library32")


# --- capabilities ------------------------------------------------------------------------------

def test_utility_only_has_no_libcuda(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility")
    libs = lib_files(p)
    assert f"libnvidia-ml.so.{DRIVER}" in libs and f"libnvidia-cfg.so.{DRIVER}" in libs
    assert not any(f.startswith("libcuda") for f in libs)
    assert not any("libcuda" in s["path"] for s in p["symlinks"])
    assert "/usr/bin/nvidia-smi" in targets(p, "binary")
    assert "/usr/bin/nvidia-cuda-mps-control" not in targets(p, "binary")
    assert "/dev/nvidia-uvm" not in targets(p, "device") and (235, 0) not in rules(p)
    assert "/tmp/nvidia-mps" not in targets(p, "ipc")
    assert "/run/nvidia-persistenced/socket" in targets(p, "ipc")
    assert mounts(p, "firmware")


def test_compute_only(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute")
    libs = lib_files(p)
    assert f"libcuda.so.{DRIVER}" in libs and f"libnvidia-ml.so.{DRIVER}" not in libs
    assert "/usr/bin/nvidia-smi" not in targets(p, "binary")
    assert "/usr/bin/nvidia-cuda-mps-server" in targets(p, "binary")
    assert {(235, 0), (235, 1)} <= rules(p)
    assert "/dev/nvidia-modeset" not in targets(p, "device")


def test_video_implies_the_compute_libraries(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=video")
    libs = lib_files(p)
    assert f"libnvcuvid.so.{DRIVER}" in libs and f"libnvidia-encode.so.{DRIVER}" in libs
    assert f"libcuda.so.{DRIVER}" in libs and f"libnvidia-ptxjitcompiler.so.{DRIVER}" in libs
    assert f"libGLX_nvidia.so.{DRIVER}" not in libs
    assert "/dev/nvidia-uvm" in targets(p, "device")


def test_display_adds_modeset_and_graphics(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=display")
    assert "/dev/nvidia-modeset" in targets(p, "device") and (195, 254) in rules(p)
    assert f"libGLX_nvidia.so.{DRIVER}" in lib_files(p) and f"libnvidia-glcore.so.{DRIVER}" in lib_files(p)
    g, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=graphics")
    assert f"libGLX_nvidia.so.{DRIVER}" in lib_files(g)
    assert "/dev/nvidia-modeset" not in targets(g, "device") and (195, 254) not in rules(g)


def test_graphics_brings_the_loader_configs_and_compute_does_not(decide):
    g, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=graphics")
    icd = {"/usr/share/vulkan/icd.d/nvidia_icd.json", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"}
    assert icd <= set(targets(g, "library"))
    assert g["ldconfig"]["directories"] == ["/usr/lib/x86_64-linux-gnu"]  # not the config dirs
    c, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    assert not icd & set(targets(c, "library"))


def drm_view(p):
    nodes = {m["target"]: (m["node"]["major"], m["node"]["minor"]) for m in mounts(p, "device")
             if m["target"].startswith("/dev/dri/")}
    links = {s["path"]: s["target"] for s in p["symlinks"] if s["path"].startswith("/dev/dri/")}
    return nodes, links


def test_graphics_gives_the_selected_gpus_own_drm_nodes_and_links(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=1,6", "NVIDIA_DRIVER_CAPABILITIES=graphics,utility")
    nodes, links = drm_view(p)
    b1, b6 = GPU8[1].bus_id, GPU8[6].bus_id
    assert nodes == {"/dev/dri/card2": (226, 2), "/dev/dri/renderD129": (226, 129),
                     "/dev/dri/card7": (226, 7), "/dev/dri/renderD134": (226, 134)}
    assert links == {f"/dev/dri/by-path/pci-{b1}-card": "../card2", f"/dev/dri/by-path/pci-{b1}-render": "../renderD129",
                     f"/dev/dri/by-path/pci-{b6}-card": "../card7", f"/dev/dri/by-path/pci-{b6}-render": "../renderD134"}
    assert {(226, 2), (226, 129), (226, 7), (226, 134)} <= rules(p) and (226, 1) not in rules(p)


@pytest.mark.parametrize("env", [("NVIDIA_VISIBLE_DEVICES=1", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"),
                                 ("NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_DRIVER_CAPABILITIES=graphics")])
def test_no_drm_nodes_without_graphics_or_without_a_gpu(decide, env):
    p, _ = decide(*env)
    assert drm_view(p) == ({}, {}) and not any(r[0] == 226 for r in rules(p))


def test_mig_device_gets_no_drm_nodes(decide):
    """A MIG device does no graphics; its parent's DRM nodes would be the whole GPU's."""
    p, _ = decide(f"NVIDIA_VISIBLE_DEVICES={GPU8[0].migs[0].uuid}", "NVIDIA_DRIVER_CAPABILITIES=graphics,compute")
    assert drm_view(p) == ({}, {})


def test_display_brings_the_x_server_configs_and_graphics_does_not(decide):
    xconf = "/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf"
    g, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=graphics")
    assert "/usr/share/nvidia/nvoptix.bin" in targets(g, "library") and xconf not in targets(g)
    d, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=display")
    assert xconf in targets(d, "library")


def test_opencl_icd_comes_with_libnvidia_opencl(decide, fx):
    icd = "/etc/OpenCL/vendors/nvidia.icd"
    c, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute")
    m = [m for m in mounts(c, "library") if m["target"] == icd]
    assert m and m[0]["source"] == str(fx / "host-gpu8") + icd and "ro" in m[0]["options"]
    u, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility,graphics")
    assert icd not in targets(u)
    # host-broken lacks libnvidia-opencl: its ICD file would name nothing
    b, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute", host="host-broken")
    assert icd not in targets(b) and os.path.exists(fx / "host-broken" / icd.lstrip("/"))


def test_capabilities_map_to_exactly_their_libraries(decide):
    for cap in ("utility", "compute", "graphics", "ngx"):
        p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_DRIVER_CAPABILITIES={cap}")
        want = {lib.real_name(DRIVER) for lib in mf.LIBRARIES if lib.capability == cap}
        assert lib_files(p) == want, cap
        assert not mounts(p, "library32")


def test_unknown_capability_is_an_error(decide):
    with pytest.raises(HookError, match="unknown capability 'bogus'"):
        decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,bogus")


# --- where things go ---------------------------------------------------------------------------

@pytest.mark.parametrize("container, d64, d32", [("container-debian", DEB64, DEB32), ("container-rhel", RH64, RH32)])
def test_library_directories_by_image_family(decide, container, d64, d32):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics,compat32",
                  container=container)
    assert {t.rsplit("/", 1)[0] for t in targets(p, "library") if t not in catalog.CONFIGS} == {d64}
    assert {t.rsplit("/", 1)[0] for t in targets(p, "library32")} == {d32}
    want32 = {lib.real_name(DRIVER) for lib in mf.LIBRARIES
              if lib.lib32 and lib.capability in ("compute", "utility", "graphics")}
    assert lib_files(p, "library32") == want32
    for m in mounts(p, "library32"):
        assert "/usr/lib/i386-linux-gnu/" in m["source"]
    assert p["ldconfig"]["directories"] == sorted({d64, d32})
    links = {s["path"]: s["target"] for s in p["symlinks"]}
    assert links[f"{d32}/libcuda.so.1"] == f"libcuda.so.{DRIVER}"
    assert links[f"{d64}/libcuda.so.1"] == f"libcuda.so.{DRIVER}"


def test_no_32bit_libraries_without_compat32(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics")
    assert mounts(p, "library32") == []
    assert p["ldconfig"]["directories"] == [DEB64]


def test_files_keep_their_real_names(decide, fx):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all")
    root = str(fx / "host-gpu8")
    for m in mounts(p):
        if m["kind"] in ("library", "library32", "binary"):
            assert m["source"].startswith(root + "/") and os.path.isfile(m["source"])
            assert not os.path.islink(m["source"])
            assert m["target"].rsplit("/", 1)[1] == m["source"].rsplit("/", 1)[1]
    assert sorted(targets(p, "binary")) == sorted(f"/usr/bin/{b}" for b in mf.BINARIES)
    assert targets(p, "firmware") == [f"/lib/firmware/nvidia/{DRIVER}/gsp_ga10x.bin",
                                      f"/lib/firmware/nvidia/{DRIVER}/gsp_tu10x.bin"]


def test_debian_host_sources_are_the_real_files(decide, fx):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=utility,compute", host="host-debian")
    root = fx / "host-debian"
    drv = spec("host-debian").driver
    src = {m["target"]: m["source"] for m in mounts(p)}
    assert src[f"{DEB64}/libcuda.so.{drv}"] == f"{root}/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.{drv}"
    assert src["/usr/bin/nvidia-smi"] == f"{root}/usr/lib/nvidia/current/nvidia-smi"
    links = {s["path"]: s["target"] for s in p["symlinks"]}
    assert links[f"{DEB64}/libcuda.so.1"] == f"libcuda.so.{drv}" and links[f"{DEB64}/libcuda.so"] == "libcuda.so.1"


def test_symlinks_cover_every_soname_and_the_dev_links(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all")
    links = {s["path"]: s["target"] for s in p["symlinks"]}
    want = {}
    for m in mounts(p):
        if m["kind"] in ("library", "library32") and m["target"] not in catalog.CONFIGS:
            d, f = m["target"].rsplit("/", 1)
            lib = mf.LIBRARY[f.split(".so.")[0]]
            if lib.soname_for(DRIVER) != f:
                want[f"{d}/{lib.soname_for(DRIVER)}"] = f
    want[f"{DEB64}/libcuda.so"] = "libcuda.so.1"
    want[f"{DEB64}/libnvidia-opticalflow.so"] = "libnvidia-opticalflow.so.1"
    want[f"{DEB64}/libGLX_indirect.so.0"] = "libGLX_nvidia.so.0"
    want[f"{DEB64}/gbm/nvidia-drm_gbm.so"] = "../libnvidia-allocator.so.1"  # Mesa's libgbm backend, as nvidia-ctk
    want[f"/dev/dri/by-path/pci-{GPU8[0].bus_id}-card"] = "../card1"  # udev's links of GPU 0's DRM nodes
    want[f"/dev/dri/by-path/pci-{GPU8[0].bus_id}-render"] = "../renderD128"
    assert links == want
    # sonames that are the real file name itself get no link
    assert f"{DEB64}/libnvidia-glcore.so.{DRIVER}" not in links
    assert links[f"{DEB64}/libGLESv2_nvidia.so.2"] == f"libGLESv2_nvidia.so.{DRIVER}"


def test_compat_libraries_get_the_soname_and_dev_links(decide):
    """CUDA forward compat chosen (T4, driver 450, image with compat 465): the image's files are
    mounted instead of the host's, and the links lead to them."""
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                  host="host-t4-450", container="container-cuda113")
    assert p["compat"]["decision"] == "image"
    compat = sorted(t.rsplit("/", 1)[1] for t in targets(p, "compat"))
    assert compat == ["libcuda.so.465.19.01", "libnvidia-ptxjitcompiler.so.465.19.01"]
    assert not any(f.startswith(("libcuda.so.", "libnvidia-ptxjitcompiler.so.")) for f in lib_files(p))
    links = {s["path"]: s["target"] for s in p["symlinks"]}
    assert links[f"{DEB64}/libcuda.so.1"] == "libcuda.so.465.19.01"
    assert links[f"{DEB64}/libnvidia-ptxjitcompiler.so.1"] == "libnvidia-ptxjitcompiler.so.465.19.01"
    assert links[f"{DEB64}/libcuda.so"] == "libcuda.so.1"
    assert DEB64 in p["ldconfig"]["directories"]


def test_device_cgroup_rules_are_the_nodes_real_numbers(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0,5", "NVIDIA_DRIVER_CAPABILITIES=all")
    real = set()
    for m in mounts(p, "device"):
        st = os.stat(m["source"])
        assert stat.S_ISCHR(st.st_mode)
        real.add((os.major(st.st_rdev), os.minor(st.st_rdev)))
    assert rules(p) == real
    assert all(r["type"] == "c" and r["access"] == "rw" for r in p["devices_cgroup"])
    assert len(p["devices_cgroup"]) == len(rules(p))
    assert (mf.UVM_MAJOR, 0) in real and (195, 255) in real and (195, 5) in real


def test_dynamic_uvm_major_reaches_the_cgroup_rules(decide, fx, tmp_path):
    root = copy_host(fx, "host-gpu1", tmp_path / "h")
    for name, minor in (("nvidia-uvm", 0), ("nvidia-uvm-tools", 1)):
        (root / "dev" / name).unlink()
        os.mknod(root / "dev" / name, 0o20666, os.makedev(511, minor))
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", root=root, config=config_dict(private_dir(tmp_path / "c")))
    assert {(511, 0), (511, 1)} <= rules(p) and (235, 0) not in rules(p)


def test_procfs_is_a_tmpfs_with_copies_and_the_selected_gpus(decide, fx):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=3", "NVIDIA_DRIVER_CAPABILITIES=utility")
    kinds = [m["kind"] for m in p["mounts"]]
    tmpfs = kinds.index("tmpfs")
    assert p["mounts"][tmpfs]["target"] == "/proc/driver/nvidia" and p["mounts"][tmpfs]["source"] == "tmpfs"
    procs = mounts(p, "procfs")
    assert all(p["mounts"].index(m) > tmpfs for m in procs)
    root = str(fx / "host-gpu8")
    by_target = {m["target"]: m for m in procs}
    assert set(by_target) == {"/proc/driver/nvidia/version", "/proc/driver/nvidia/params",
                              "/proc/driver/nvidia/registry", f"/proc/driver/nvidia/gpus/{GPU8[3].bus_id}"}
    for t, m in by_target.items():
        assert m["source"] == root + t and os.path.exists(m["source"])
    # Real drivers keep ModifyDeviceFiles in params; registry is copied as it is.
    assert "set:ModifyDeviceFiles=0" in by_target["/proc/driver/nvidia/params"]["options"]
    assert not any(o.startswith("set:") for o in by_target["/proc/driver/nvidia/registry"]["options"])
    assert "copy" in by_target["/proc/driver/nvidia/version"]["options"]
    assert "ro" in by_target[f"/proc/driver/nvidia/gpus/{GPU8[3].bus_id}"]["options"]


def test_mount_options_per_kind(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=all")
    for m in p["mounts"]:
        assert m["kind"] in plan_mod.KINDS
        if m["kind"] in ("library", "library32", "binary", "firmware"):
            assert m["options"] == ["ro", "nosuid", "nodev"]
        elif m["kind"] == "device":
            assert m["options"] == ["ro", "nosuid", "noexec"]
        elif m["kind"] == "ipc":
            # rw only for a socket; a directory (the MPS pipe directory) is read-only
            sock = stat.S_ISSOCK(os.stat(m["source"]).st_mode)
            assert m["options"] == ["nosuid", "nodev", "noexec"] + ([] if sock else ["ro"]), m


# --- requirements ------------------------------------------------------------------------------

def test_brand_and_arch_requirements_checked_per_selected_gpu(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_GPU=brand=tesla,arch>=8.0")
    assert p["request"]["requirements"] == ["brand=tesla,arch>=8.0"]
    with pytest.raises(HookError, match="unsatisfied requirement NVIDIA_REQUIRE_GPU='brand=tesla'"):
        decide("NVIDIA_VISIBLE_DEVICES=0,6", "NVIDIA_REQUIRE_GPU=brand=tesla")
    decide("NVIDIA_VISIBLE_DEVICES=0,6", "NVIDIA_REQUIRE_GPU=brand=tesla brand=geforcertx")


@pytest.mark.parametrize("expr", ["cuda>=13.0", "driver>=600", "driver<535"])
def test_unsatisfied_cuda_or_driver_requirement(decide, expr):
    with pytest.raises(HookError, match="unsatisfied requirement NVIDIA_REQUIRE_CUDA=") as e:
        decide("NVIDIA_VISIBLE_DEVICES=0", f"NVIDIA_REQUIRE_CUDA={expr}")
    assert repr(expr) in str(e.value) and DRIVER in str(e.value)


def test_disable_require_skips_the_check(decide):
    p, _ = decide("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=99.0", "NVIDIA_DISABLE_REQUIRE=true")
    assert p["gpus"]


# --- the JSON schema ---------------------------------------------------------------------------

@pytest.mark.parametrize("env", [
    ("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"),
    ("NVIDIA_VISIBLE_DEVICES=none",),
    (f"NVIDIA_VISIBLE_DEVICES={GPU8[1].migs[1].uuid}",),
])
def test_plan_schema(decide, env):
    p, _ = decide(*env)
    assert_schema(p)
    assert p["gpus"] or env == ("NVIDIA_VISIBLE_DEVICES=none",)
    assert p["driver"] == {"version": DRIVER, "cuda": "12.2"}
