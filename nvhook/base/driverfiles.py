"""What a driver install provides, per capability (reference section 3). Data only.

Each item is optional on a given host: a missing one is a logged warning, not an error.
"""

LIBRARIES = {
    "utility": ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so"),
    "compute": (
        "libcuda.so", "libcudadebugger.so", "libnvidia-opencl.so", "libnvidia-gpucomp.so",
        "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so",
        "libnvidia-compiler.so", "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
        "libnvidia-nvvm.so",
    ),
    "video": ("libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so", "libnvcuvid.so"),
    "graphics": (
        "libnvidia-eglcore.so", "libnvidia-glcore.so", "libnvidia-tls.so", "libnvidia-glsi.so",
        "libnvidia-fbc.so", "libnvidia-ifr.so", "libnvidia-rtcore.so", "libnvoptix.so",
        "libGLX_nvidia.so", "libEGL_nvidia.so", "libGLESv2_nvidia.so", "libGLESv1_CM_nvidia.so",
        "libnvidia-glvkspirv.so", "libnvidia-cbl.so",
    ),
    "ngx": ("libnvidia-ngx.so",),
}

# Libraries that are commonly absent (older or newer branches, optional packages): their
# absence is logged at debug level so a normal host's log is not full of false alarms.
OPTIONAL_LIBRARIES = frozenset({
    "libnvidia-nscq.so", "libnvidia-fatbinaryloader.so", "libnvidia-compiler.so",
    "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so", "libnvidia-ifr.so",
    "libnvidia-cbl.so", "libnvidia-ngx.so", "libcudadebugger.so", "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
})

BINARIES = {
    "utility": ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager"),
    "compute": ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"),
}
OPTIONAL_BINARIES = frozenset({"nv-fabricmanager", "nvidia-debugdump"})

BIN_DIRS = ("/usr/bin", "/usr/sbin", "/bin", "/sbin", "/usr/local/bin", "/usr/local/sbin")

IPC = {
    "utility": ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket"),
    "compute": ("/tmp/nvidia-mps",),
}

# Capability -> the capabilities whose libraries it needs as well.
IMPLIES = {"video": ("compute",), "display": ("graphics",)}

# Extra links the container expects besides the SONAME links (development names and the
# GLVND indirect name): link name -> (library name, what it points to by soname).
DEV_LINKS = {
    "libcuda.so": "libcuda.so",
    "libnvidia-opticalflow.so": "libnvidia-opticalflow.so",
    "libGLX_indirect.so.0": "libGLX_nvidia.so",
}

# Loader configuration the graphics stack needs besides the libraries: the Vulkan ICD and
# layers, the GLVND EGL vendor file, EGL external platforms. Mounted at the same path.
GRAPHICS_CONFIGS = (
    "/usr/share/vulkan/icd.d/nvidia_icd.json",
    "/etc/vulkan/icd.d/nvidia_icd.json",
    "/usr/share/vulkan/implicit_layer.d/nvidia_layers.json",
    "/etc/vulkan/implicit_layer.d/nvidia_layers.json",
    "/usr/share/glvnd/egl_vendor.d/10_nvidia.json",
    "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
    "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
)
