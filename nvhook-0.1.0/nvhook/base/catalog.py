"""The catalog: everything nvhook knows a driver install can provide, as data.

One table per kind of thing, each row saying where it is found, what role it plays, what
gates it (a capability, "always" for every GPU container, or the request variable that asks
for it) and whether its absence is worth a warning. The inventory (observe), the cache's
validity stamp, the plan (decide), `nvhook list`, `doctor` and CDI output all read these
tables; none keeps a list of its own.

Adding a device kind (say gdrcopy, `/dev/gdrdrv`, asked for by `NVIDIA_GDRCOPY=enabled`) is
one DEVICES row gated by that variable, plus its request rule in decide/request.py and tests.

Why rows are tuples and views are built at import: this module is read on every container
start, so it costs one tuple walk and imports nothing.
"""

from __future__ import annotations

# NVIDIA_DRIVER_CAPABILITIES vocabulary, in the order messages list it.
CAPABILITIES = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
DEFAULT_CAPABILITIES = ("utility", "compute")
# A capability that needs another's libraries as well (video decodes through CUDA; display is
# graphics plus the modeset node).
IMPLIES = {"video": ("compute",), "display": ("graphics",)}

# Gates that are not capabilities.
ALWAYS = "always"                   # every container that gets the driver
GPU = "gpu"                         # per selected GPU
MIG = "MIG"                         # per selected MIG device, or NVIDIA_MIG_CONFIG/MONITOR_DEVICES
IMEX = "IMEX"                       # per channel NVIDIA_IMEX_CHANNELS (or the mount list) asks for

# Log level of an item's absence: "warning" for what a working install has, "debug" for what
# many installs lack (other branches, optional packages, daemons not running).
WARN, QUIET = "warning", "debug"

# Libraries, by linker name, found through the host's ld.so.cache: (name, capability, absence).
LIBRARY_ROWS = (
    ("libnvidia-ml.so", "utility", WARN),
    ("libnvidia-cfg.so", "utility", WARN),
    ("libnvidia-nscq.so", "utility", QUIET),
    ("libcuda.so", "compute", WARN),
    ("libcudadebugger.so", "compute", QUIET),
    ("libnvidia-opencl.so", "compute", WARN),
    ("libnvidia-gpucomp.so", "compute", QUIET),
    ("libnvidia-ptxjitcompiler.so", "compute", WARN),
    ("libnvidia-fatbinaryloader.so", "compute", QUIET),
    ("libnvidia-allocator.so", "compute", WARN),
    ("libnvidia-compiler.so", "compute", QUIET),
    ("libnvidia-pkcs11.so", "compute", QUIET),
    ("libnvidia-pkcs11-openssl3.so", "compute", QUIET),
    ("libnvidia-nvvm.so", "compute", QUIET),
    ("libvdpau_nvidia.so", "video", WARN),
    ("libnvidia-encode.so", "video", WARN),
    ("libnvidia-opticalflow.so", "video", WARN),
    ("libnvcuvid.so", "video", WARN),
    ("libnvidia-eglcore.so", "graphics", WARN),
    ("libnvidia-glcore.so", "graphics", WARN),
    ("libnvidia-tls.so", "graphics", WARN),
    ("libnvidia-glsi.so", "graphics", WARN),
    ("libnvidia-fbc.so", "graphics", WARN),
    ("libnvidia-ifr.so", "graphics", QUIET),
    ("libnvidia-rtcore.so", "graphics", WARN),
    ("libnvoptix.so", "graphics", WARN),
    ("libGLX_nvidia.so", "graphics", WARN),
    ("libEGL_nvidia.so", "graphics", WARN),
    ("libGLESv2_nvidia.so", "graphics", WARN),
    ("libGLESv1_CM_nvidia.so", "graphics", WARN),
    ("libnvidia-glvkspirv.so", "graphics", WARN),
    ("libnvidia-cbl.so", "graphics", QUIET),
    ("libnvidia-ngx.so", "ngx", QUIET),
)

# Programs, by name, looked for in BIN_DIRS under the host root and mounted into /usr/bin.
BINARY_ROWS = (
    ("nvidia-smi", "utility", WARN),
    ("nvidia-debugdump", "utility", QUIET),
    ("nvidia-persistenced", "utility", WARN),
    ("nv-fabricmanager", "utility", QUIET),
    ("nvidia-cuda-mps-control", "compute", WARN),
    ("nvidia-cuda-mps-server", "compute", WARN),
)
BIN_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")

# Daemons' sockets and directories, bound at the same path. Daemons start and stop, so their
# absence is never a warning.
IPC_ROWS = (
    ("/run/nvidia-persistenced/socket", "utility", QUIET),
    ("/run/nvidia-fabricmanager/socket", "utility", QUIET),
    ("/tmp/nvidia-mps", "compute", QUIET),
)

# Loader and application configuration the driver's libraries need besides themselves, bound at
# the same path: (path, capability, library it serves or None). The Vulkan ICD and layers (RPM
# packages name the ICD file by architecture), the GLVND EGL vendor file, EGL external
# platforms, OptiX's shader cache seed that libnvoptix reads, the X server's configuration
# snippets (an X server in the container: display), and the OpenCL ICD file that the OpenCL ICD
# loader reads to find libnvidia-opencl (compute, like that library). A file that names a
# library is given only with that library: an ICD pointing at nothing would make the loader
# report a broken platform.
CONFIG_ROWS = (
    ("/usr/share/vulkan/icd.d/nvidia_icd.json", "graphics", None),
    ("/etc/vulkan/icd.d/nvidia_icd.json", "graphics", None),
    ("/usr/share/vulkan/icd.d/nvidia_icd.x86_64.json", "graphics", None),
    ("/etc/vulkan/icd.d/nvidia_icd.x86_64.json", "graphics", None),
    ("/usr/share/vulkan/icd.d/nvidia_layers.json", "graphics", None),
    ("/etc/vulkan/icd.d/nvidia_layers.json", "graphics", None),
    ("/usr/share/vulkan/implicit_layer.d/nvidia_layers.json", "graphics", None),
    ("/etc/vulkan/implicit_layer.d/nvidia_layers.json", "graphics", None),
    ("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "graphics", None),
    ("/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json", "graphics", None),
    ("/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json", "graphics", None),
    ("/usr/share/nvidia/nvoptix.bin", "graphics", "libnvoptix.so"),
    ("/etc/X11/xorg.conf.d/10-nvidia.conf", "display", None),
    ("/usr/share/X11/xorg.conf.d/10-nvidia.conf", "display", None),
    ("/etc/X11/xorg.conf.d/nvidia-drm-outputclass.conf", "display", None),
    ("/usr/share/X11/xorg.conf.d/nvidia-drm-outputclass.conf", "display", None),
    ("/etc/OpenCL/vendors/nvidia.icd", "compute", "libnvidia-opencl.so"),
)

# Device nodes: (path or pattern, role, gate, absence). Fixed paths are looked up on every
# inventory; patterns are filled in from what the host lists (GPU minors from procfs, MIG
# capability minors from /proc/driver/nvidia-caps/mig-minors, IMEX channels from the
# directory). nvidia-uvm's major is dynamic: /proc/devices says which it is.
DEVICES = (
    ("/dev/nvidiactl", "control", ALWAYS, WARN),
    ("/dev/nvidia-uvm", "uvm", "compute", WARN),
    ("/dev/nvidia-uvm-tools", "uvm-tools", "compute", WARN),
    ("/dev/nvidia-modeset", "modeset", "display", WARN),
    ("/dev/nvidia{minor}", "gpu", GPU, WARN),
    ("/dev/nvidia-caps/nvidia-cap{minor}", "mig-cap", MIG, QUIET),
    ("/dev/nvidia-caps-imex-channels/channel{channel}", "imex", IMEX, QUIET),
)
FIXED_DEVICES = tuple(row for row in DEVICES if "{" not in row[0])
# The gate of each device role, for the plan and for `nvhook list`.
DEVICE_GATES = {role: gate for _, role, gate, _ in DEVICES}

# Firmware the GSP-enabled kernel module loads (per driver version), needed wherever the
# driver is: gated like the driver itself.
FIRMWARE_DIR = "/lib/firmware/nvidia/{version}"
FIRMWARE_GATES = ("utility", "compute")

# /proc/driver/nvidia files copied into the container's view, and the lines rewritten in the
# copy. ModifyDeviceFiles=0 stops the driver from creating device nodes on the container's
# behalf (a container must have only the nodes it was given). Real drivers keep the key in
# params (seen with 535 and 580); registry holds only what an admin set.
PROCFS_FILES = ("version", "params", "registry")
PROCFS_REWRITES = {"params": (("ModifyDeviceFiles", "0"),)}

# Extra links the container expects besides the SONAME links (development names, the GLVND
# indirect name, the GBM backend Mesa's libgbm loads from <libdir>/gbm/<drm driver>_gbm.so):
# link name (relative to the library directory) -> the library it points to (by that
# library's soname; from a subdirectory, through "..").
DEV_LINKS = {
    "libcuda.so": "libcuda.so",
    "libnvidia-opticalflow.so": "libnvidia-opticalflow.so",
    "libGLX_indirect.so.0": "libGLX_nvidia.so",
    "gbm/nvidia-drm_gbm.so": "libnvidia-allocator.so",
}


def _by_capability(rows: tuple[tuple[str, str, object], ...]) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for name, cap, _ in rows:
        out.setdefault(cap, []).append(name)
    return {cap: tuple(names) for cap, names in out.items()}


# Views for the readers: capability -> names, and the set of names whose absence is quiet.
LIBRARIES = _by_capability(LIBRARY_ROWS)
BINARIES = _by_capability(BINARY_ROWS)
IPC = _by_capability(IPC_ROWS)
CONFIGS = tuple(p for p, _, _ in CONFIG_ROWS)
CONFIG_NEEDS = {p: lib for p, _, lib in CONFIG_ROWS if lib}
OPTIONAL_LIBRARIES = frozenset(n for n, _, lvl in LIBRARY_ROWS if lvl == QUIET)
OPTIONAL_BINARIES = frozenset(n for n, _, lvl in BINARY_ROWS if lvl == QUIET)

