"""`nvidia-cdi-hook`, by nvhook: NVIDIA's CDI hook command line, done with nvhook's fd-safe code.

CDI specs written by NVIDIA's tools (nvidia-ctk, the device plugin, the DRA driver) call
`<hook path> <subcommand> --flag ...` as createContainer hooks. This front door accepts every
subcommand and flag of NVIDIA's 1.17-1.20 hook with the same meaning and exit codes, so that
those specs run with nvhook as their hook (docs/cdi-hook.md says where each differs on purpose).

Each subcommand is the module named after it (NVIDIA's cmd/nvidia-cdi-hook/<name>/), the act
code it uses in nvhook/apply:

  create-symlinks --link TARGET::LINK ...         create_symlinks.py: links in the rootfs
                                                  (apply/symlinks.py)
  update-ldcache --folder DIR ... [--ldconfig-path P]
                                                  update_ldcache.py: the rootfs's ld.so.cache,
                                                  written by nvhook (apply/ldscan.py, drop-in
                                                  apply/ldconfdropin.py); no host ldconfig runs
  enable-cuda-compat [--host-driver-version V] [--host-cuda-version V]
                     [--cuda-compat-container-root DIR]
                                                  enable_cuda_compat.py: the image's compat
                                                  libcuda, when nvhook's per-GPU decision
                                                  (decide/compat.py) says so
  disable-device-node-modification                disable_device_node_modification.py: params
                                                  with ModifyDeviceFiles 0 over the container's
                                                  /proc/driver/nvidia/params (apply/paramsmask.py)
  chmod --mode OCTAL --path P ...                 chmod.py: modes, resolved inside the rootfs
  update-application-profile                      update_application_profile.py: EGL/Vulkan see
                                                  only the container's GPUs (1.20's hook;
                                                  decide/appprofile.py, apply/profilefile.py)
  create-soname-symlinks --folder DIR ...         create_soname_symlinks.py: SONAME links
                                                  (1.18.0-rc.1's hook)
  noop                                            nothing
  global: --debug/-d, --quiet, --help/-h, --version/-v; every subcommand: --container-spec

The rest: hookmain.py (`main`: the command line, the environment, the state, errors and exit
codes), hookargs.py (the parser, NVIDIA's), hookstate.py (the OCI state and the container
root), dispatch.py (subcommand -> module), coalesce.py (a run of entries in one process).

An unknown subcommand, no subcommand, or an
unknown flag before the subcommand: a warning and exit 0, as NVIDIA's 1.18+ (a spec naming a
hook this version does not have never stops a container). An unknown flag or a bad value of a
known subcommand: one error line, exit 1, as NVIDIA's (urfave/cli's "flag provided but not
defined: -NAME").

The environment: when a spec's hook entry carries no `env`, runc runs createContainer hooks
with the container's own environment. Nothing of it is read here but NVIDIA's two logging
switches (NVIDIA_CTK_DEBUG/QUIET and their NVIDIA_CDI_ forms); the rest (NVHOOK_CONFIG and
NVHOOK_RUN_DIR included) is dropped before anything else runs, and nvhook's config is read from
its default path or from `--nvhook-config PATH` in the hook's arguments (which the spec's author
wrote, not the image). That the container's LD_PRELOAD never reached this interpreter at all is
the first stage's job: see bin/nvidia-cdi-hook and docs/cdi-hook.md.
"""

from .hookmain import main

__all__ = ["main"]
