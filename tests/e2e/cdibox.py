"""podman with an nvhook CDI spec: `podman run --device nvidia.com/gpu=...` on a fixture host.

podman 4.3.1 reads CDI specs only from /etc/cdi and /var/run/cdi (no cdi_spec_dirs in its
containers.conf), so each podman command runs in a private mount namespace with a /run of its
own (a tmpfs: /run/cdi, /var/run/cdi through the /var/run link, is made there, never on the
machine) where the test's spec directory is bind-mounted on /run/cdi and a directory of the
test on /run/nvhook (the CDI hook's config cache: not the machine's). With `cgroup2`, cgroup2
is mounted on /sys/fs/cgroup in that namespace as well, so podman and runc work in cgroup v2
mode (runc's BPF device program) on a hybrid host.

podman's runtime is a small script that copies the config.json podman hands runc (after CDI
injection) into the test's directory, then execs runc: the test reads what the runtime was
really given. All of podman's state is under the test's tmp dir (storage, libpod tmp, runc
state) and a fresh /tmp/nvhook-pm-* run root (podman wants it short).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import runcbox as rb

CDI_DIR = Path("/run/cdi")


def skip_reason() -> str | None:
    return rb.podman_skip_reason() or (None if shutil.which("unshare") else "unshare is not installed")


class CdiPodman:
    def __init__(self, tmp: Path, *, cgroup2: bool = False, runtime: str = "runc"):
        self.tmp = tmp
        self.spec_dir = tmp / "cdi"
        self.spec_dir.mkdir(parents=True, exist_ok=True)
        self.capture = tmp / "captured"
        self.capture.mkdir(exist_ok=True)
        self.run_dir = tmp / "run-nvhook"  # the namespace's /run/nvhook
        self.run_dir.mkdir(mode=0o700, exist_ok=True)
        self.cgroup2 = cgroup2
        # named as the runtime: podman decides by that name what the runtime supports
        self.runtime = tmp / "capture" / runtime
        self.runtime.parent.mkdir(exist_ok=True)
        runc = shutil.which(runtime)
        # crun refuses this machine's hybrid cgroups and cannot raise RLIMIT_MEMLOCK for a device
        # program here: it runs in cgroup2 mode with its cgroup manager off (no device cgroup).
        flags = " --cgroup-manager disabled" if runtime == "crun" else ""
        self.runtime.write_text(
            "#!/bin/sh\n"
            "# copy the config.json that podman hands the runtime, then run runc with the same arguments\n"
            "prev=\n"
            "for a in \"$@\"; do\n"
            f"  if [ \"$prev\" = --bundle ] || [ \"$prev\" = -b ]; then cp \"$a/config.json\" "
            f"{shlex.quote(str(self.capture))}/config.json; fi\n"
            "  prev=$a\n"
            "done\n"
            f"exec {shlex.quote(runc)}{flags} \"$@\"\n")
        self.runtime.chmod(0o755)
        state = tmp / "podman"
        self.runroot = Path(tempfile.mkdtemp(prefix="nvhook-pm-"))
        self.base = ["podman", "--root", str(state / "storage"), "--runroot", str(self.runroot),
                     "--tmpdir", str(state / "libpod"), "--runtime", str(self.runtime),
                     "--runtime-flag", f"root={state / 'runc'}", "--cgroup-manager", "cgroupfs",
                     "--events-backend", "none"]

    def _ns(self, cmd: list[str]) -> list[str]:
        """`cmd` in a private mount namespace that sees the spec dir as /run/cdi (and cgroup2)."""
        # the mount point is made on the namespace's own /run: a mkdir on the machine's /run
        # would leave an empty /run/cdi behind (tests/machinestate.py checks it). The CDI hook
        # keeps its config cache in /run/nvhook whatever NVHOOK_RUN_DIR says (it drops the
        # environment): this test's own directory there, kept from one podman command to the next.
        pre = (f"mount -t tmpfs -o mode=0755 tmpfs /run && mkdir {CDI_DIR} /run/nvhook && "
               f"mount --bind {shlex.quote(str(self.spec_dir))} {CDI_DIR} && "
               f"mount --bind {shlex.quote(str(self.run_dir))} /run/nvhook || exit 125; ")
        if self.cgroup2 and rb.host_cgroup_mode() != "v2":
            pre += ('mount -t cgroup2 none /sys/fs/cgroup || '
                    '{ echo "nvhook-test: cannot mount cgroup2" >&2; exit 125; }; ')
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", pre + 'exec "$@"', "sh", *cmd]

    def run(self, rootfs: Path, script: str, devices: list[str], env: dict | None = None,
            extra: list[str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        name = f"nvhook-cdi-{uuid.uuid4().hex[:12]}"
        cmd = [*self.base, "run", "--rm", "--name", name, "--network", "none",
               "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        if self.cgroup2:
            cmd += ["--pids-limit", "0"]  # the v2 hierarchy here has no controllers enabled
        for d in devices:
            cmd += ["--device", d]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += [*(extra or []), "--rootfs", str(rootfs), "/bin/sh", "-c", script]
        try:
            return subprocess.run(self._ns(cmd), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  errors="replace", timeout=timeout)
        finally:
            subprocess.run(self._ns([*self.base, "rm", "--force", "--ignore", "--time", "0", name]),
                           capture_output=True, timeout=60)

    def captured(self) -> dict:
        return json.loads((self.capture / "config.json").read_text())

    def leftovers(self) -> list[str]:
        proc = subprocess.run(self._ns([*self.base, "ps", "--all", "--format", "{{.Names}}"]),
                              capture_output=True, text=True, timeout=60)
        return [n for n in proc.stdout.split() if n]

    def close(self) -> None:
        shutil.rmtree(self.runroot, ignore_errors=True)


def generate(spec_file: Path, *, config: Path, host: Path, extra: list[str] | None = None,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """`nvhook --config C --root H cdi generate --output F` with the installed nvhook."""
    e = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    e.update(env or {})
    return subprocess.run([str(rb.NVHOOK_BIN), "--config", str(config), "--root", str(host), "cdi", "generate",
                           "--output", str(spec_file), *(extra or [])],
                          capture_output=True, text=True, timeout=120, env=e)
