"""A private Debian node booted by its own systemd (257 on trixie, sid's on sid) as PID 1: containerd and nvhook's
units run as systemd units there, so what the units promise (Restart=, PartOf=, `systemctl
restart` from `nvhook node install --restart-engine`) is tested as an operator's node runs it.
Used by tests/node/test_nri_systemd.py only; the other node tests run on node.py's plain init.

The root: noderoot.py's cached root of the session's suite, untouched, below a second cached
layer that adds that suite's systemd (an overlay upper directory made once by apt-get in a
chroot, kept under /var/cache/nvhook-tests/systemd-<key>/layer, <key> hashing the root's key and
the build steps), so that the root the other tests use is neither rebuilt nor changed.

How systemd is kept off the machine: besides node.py's private mount and pid namespaces, the
node has its own UTS (systemd sets the hostname at boot), network (units may bring up
interfaces, set net.* sysctls or start Docker's bridge; pods use the node's network, reached
only through unix sockets), IPC and cgroup namespaces. Its cgroup namespace is rooted at a cgroup
of its own in the machine's cgroup2 hierarchy (<cgroup2>/nvhook-node-<id>), mounted at the node's
/sys/fs/cgroup: systemd runs its slices there and nowhere else. /proc/sys and /sys are read-only
in the node (what systemd-nspawn does), so nothing in it can write the kernel's global settings;
its /dev is a tmpfs with only the harmless device nodes bound in (no console, no ttys, no
kmsg). The units that only set up a real machine's kernel (sysctl, binfmt_misc, modules, ttys)
and the ones that would start other daemons (Docker: docker.io enables it) are masked in the
layer, and a test asserts the boot left no failed unit.

systemd 256+ refuses a cgroup v1 hierarchy; this needs a kernel with cgroup2 mounted on the
machine (a pure v2 machine, or a hybrid one's /sys/fs/cgroup/unified): `cannot_boot()` says
why not where it cannot.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import noderoot
from node import (
    _RUNC_NOCPU,
    CONTAINERD_CONFIG,
    CRUN_NOCPU,
    NODE_ENV,
    PATH,
    RUNC_NOCPU,
    Node,
    NodeError,
    containerd_config,
)

PACKAGES = ("systemd",)
# Kernel-wide set-up a real machine's boot does (sysctl.d, binfmt_misc, modules), terminals,
# daemons the node's packages enable that the tests do not use (Docker would make a bridge),
# timers that would run apt or fstrim, logind (wants D-Bus, which is not installed), and the
# kernel's debug, trace and config filesystems (their settings are the machine's).
MASKED = ("systemd-sysctl.service", "systemd-binfmt.service", "proc-sys-fs-binfmt_misc.automount",
          "proc-sys-fs-binfmt_misc.mount", "systemd-modules-load.service", "kmod-static-nodes.service",
          "getty.target", "console-getty.service", "getty@.service", "serial-getty@.service",
          "docker.service", "docker.socket", "systemd-logind.service", "apt-daily.timer",
          "apt-daily-upgrade.timer", "dpkg-db-backup.timer", "fstrim.timer", "e2scrub_all.timer",
          "e2scrub_reap.service", "systemd-tmpfiles-clean.timer", "systemd-firstboot.service",
          "systemd-hwdb-update.service", "systemd-timesyncd.service", "systemd-networkd.service",
          "systemd-resolved.service", "netavark-dhcp-proxy.socket", "netavark-dhcp-proxy.service",
          "sys-kernel-debug.mount", "sys-kernel-tracing.mount", "sys-kernel-config.mount",
          "sys-fs-fuse-connections.mount", "dev-hugepages.mount")
COMPLETE = ".complete"


def layer_key(suite: str = noderoot.SUITE) -> str:
    # the root's key and the steps that make the layer: not this file's text around them
    h = hashlib.sha256()
    h.update(f"{noderoot.cache_key(suite)}\n{' '.join(PACKAGES)}\n{' '.join(MASKED)}\n{_BUILD}\n".encode())
    return h.hexdigest()[:16]


def layer_path(suite: str = noderoot.SUITE) -> Path:
    return noderoot.CACHE / f"systemd-{layer_key(suite)}" / "layer"


def cgroup2_mount() -> str | None:
    """Where the machine's cgroup2 hierarchy is mounted (None where it has none)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if fields[sep + 1] == "cgroup2":
                return fields[4]
    return None


def cannot_boot() -> str | None:
    """Why this machine cannot boot the systemd node (None when it can try)."""
    if not cgroup2_mount():
        return ("the machine has no cgroup2 hierarchy mounted: systemd 257 in the node needs one "
                "(systemd 256+ does not run on cgroup v1)")
    probe = Path(cgroup2_mount() or "/") / f"nvhook-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot make a cgroup for the node in the machine's cgroup2 hierarchy ({probe}: {e.strerror})"
    if not os.path.exists("/proc/self/ns/cgroup"):
        return "the kernel has no cgroup namespaces (CONFIG_CGROUPS namespace support)"
    r = subprocess.run(["unshare", "--help"], capture_output=True, text=True)
    if "--cgroup" not in r.stdout:
        return "unshare (util-linux) has no --cgroup"
    return None


# Runs in a private mount namespace: the layer is the upper directory of an overlay on the
# cached root, where apt-get installs systemd; the units are masked there too.
_BUILD = """set -eu
root=$1 work=$2; shift 2
mkdir -p "$work/layer" "$work/work" "$work/merged"
mount -t overlay overlay -o "lowerdir=$root,upperdir=$work/layer,workdir=$work/work" "$work/merged"
M=$work/merged
mount -t proc proc "$M/proc"
mount --rbind /dev "$M/dev"
cp /etc/resolv.conf "$M/etc/resolv.conf"
printf '#!/bin/sh\\nexit 101\\n' > "$M/usr/sbin/policy-rc.d"
chmod 755 "$M/usr/sbin/policy-rc.d"
export DEBIAN_FRONTEND=noninteractive
# Acquire::Check-Valid-Until=false: sid's Release is valid a week, and a mirror that serves a
# snapshot (or a machine whose clock runs ahead of it) is past that; debootstrap built the root
# from the same signed Release without that check
chroot "$M" apt-get -o Acquire::Retries=3 -o Acquire::Check-Valid-Until=false update -q
chroot "$M" apt-get -o Acquire::Retries=3 install -y -q --no-install-recommends "$@"
chroot "$M" apt-get clean
rm -f "$M/usr/sbin/policy-rc.d" "$M/etc/resolv.conf"
rm -rf "$M"/var/lib/apt/lists/*
for unit in $MASKED; do ln -sf /dev/null "$M/etc/systemd/system/$unit"; done
ln -sf /usr/lib/systemd/system/multi-user.target "$M/etc/systemd/system/default.target"
: > "$M/etc/machine-id"
"""


def ensure_layer(suite: str = noderoot.SUITE) -> Path:
    """The systemd layer of `suite`'s root, built first when missing (one builder at a time per
    machine)."""
    root = noderoot.ensure(suite=suite)
    final = layer_path(suite)
    key = layer_key(suite)
    with open(noderoot.CACHE / ".lock-systemd", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final.parent / COMPLETE).exists():
            (final.parent / "last-used").touch()
            return final
        work = noderoot.CACHE / f"building-systemd-{key}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log_path = noderoot.CACHE / f"build-systemd-{key}.log"
        try:
            with open(log_path, "wb") as log:
                subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", _BUILD, "sh",
                                str(root), str(work), *PACKAGES],
                               env={"PATH": PATH, "MASKED": " ".join(MASKED)}, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, check=True, timeout=1200)
            shutil.rmtree(work / "work", ignore_errors=True)
            shutil.rmtree(work / "merged", ignore_errors=True)
            (work / COMPLETE).write_text(f"{key}\n")
            shutil.rmtree(final.parent, ignore_errors=True)
            os.rename(work, final.parent)
        except BaseException:
            shutil.rmtree(work / "work", ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            raise
        (final.parent / "last-used").touch()
        current = {layer_path(s).parent for s in noderoot.SUITES}
        for old in noderoot.CACHE.glob("systemd-*"):
            used = old / "last-used"
            if old not in current and old.is_dir() and used.exists() and time.time() - used.stat().st_mtime > 86400:
                shutil.rmtree(old, ignore_errors=True)
        return final


# The node's first process: the overlay (systemd layer over the cached root), a /dev of its own,
# /proc with /proc/sys read-only, a read-only sysfs of its network namespace, its cgroup
# namespace's cgroup2, then pivot_root and, once the test has moved the holder out of the node's
# cgroup (cgroup2 forbids enabling controllers in a cgroup with processes), systemd.
_SETUP = r"""set -eu
S=$1 LOWER=$2 HOSTFIX=$3
R=$S/root
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$S/upper,workdir=$S/work" "$R"
mkdir -p "$R/dev" "$R/proc" "$R/sys" "$R/run" "$R/tmp" "$R/var/lib/containerd" "$R/nvhook"
mount -t tmpfs -o mode=755,nosuid tmpfs "$R/dev"
for d in null zero full random urandom tty; do
  [ -e "/dev/$d" ] || continue
  : > "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"
done
: > "$R/dev/console"; mount --bind "$S/console.log" "$R/dev/console"
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
mount -t mqueue mqueue "$R/dev/mqueue"
ln -s /proc/self/fd "$R/dev/fd"
ln -s /proc/self/fd/0 "$R/dev/stdin"; ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
mount -t proc proc "$R/proc"
mount --bind "$R/proc/sys" "$R/proc/sys"
mount -o remount,bind,ro "$R/proc/sys"
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"
mount --bind "$S/run" "$R/run"
mount --bind "$S/containerd" "$R/var/lib/containerd"
mount --bind "$S/share" "$R/nvhook"
mkdir -p "$R/nvhook/host" "$R/nvhook/fixtures"
mount --bind "$HOSTFIX" "$R/nvhook/host"
mount -o remount,bind,ro "$R/nvhook/host"
mount --bind "$HOSTFIX/.." "$R/nvhook/fixtures"
mount -o remount,bind,ro "$R/nvhook/fixtures"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"
cd "$R"
mkdir -p .machine
pivot_root . .machine
cd /
umount -l /.machine
rmdir /.machine
: > /run/node-ready
while [ ! -e /run/node-go ]; do sleep 0.05; done
rm -f /run/node-go
# no loading kernel modules, setting the clock or reading the kernel log from the node
exec env -i container=nvhook-test PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  setpriv --bounding-set -sys_module,-sys_time,-wake_alarm,-syslog -- /usr/lib/systemd/systemd
"""


class SystemdNode(Node):
    """A Node (node.py) whose PID 1 is systemd: containerd is its containerd.service (Debian's
    unit, enabled by the package), started at boot with the node's config (NRI on). The
    cgroup hierarchy is cgroup2 (its own namespace); runc and crun are the -nocpu ones where
    that hierarchy has no cpu controller. `systemctl(...)`, `unit(name)` (its properties),
    `journal(unit)` add to Node's run/sh/path/write/read, cri and kubelet."""

    def __init__(self, lower: str, host_fixture: Path, name: str | None = None, suite: str = noderoot.SUITE):
        super().__init__(Path(lower), host_fixture, cgroup="v2", name=name, suite=suite)
        self.lower_spec = lower
        self.cgroup2 = cgroup2_mount() or "/sys/fs/cgroup"
        self.node_cgroup = Path(self.cgroup2) / self.cgroup_parent.strip("/")

    def _prepare(self) -> None:
        """Files the node needs before its first unit starts: containerd's config (NRI on) and
        the runtimes it names, written into the session's upper layer."""
        up = self.dir / "upper"

        def put(p: str, text: str, mode: int = 0o644) -> None:
            f = up / p.lstrip("/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
            f.chmod(mode)

        has_cpu = "cpu" in (self.node_cgroup / "cgroup.controllers").read_text().split()
        self.runc, crun = "runc", "/usr/bin/crun"
        if not has_cpu:
            put(RUNC_NOCPU, _RUNC_NOCPU, 0o755)
            put(CRUN_NOCPU, _RUNC_NOCPU, 0o755)
            self.runc, crun = RUNC_NOCPU, CRUN_NOCPU
        put(CONTAINERD_CONFIG, containerd_config(nri=True, runc_binary="" if self.runc == "runc" else self.runc,
                                                 crun_binary=crun, suite=self.suite))
        put("/etc/hostname", f"nvhook-sd-{self.id}\n")

    def start(self, timeout: float = 120) -> SystemdNode:
        for d in ("upper", "work", "root", "run", "containerd", "share"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711)
        (self.dir / "console.log").touch()
        self.node_cgroup.mkdir(exist_ok=True)
        self._prepare()
        self.holder_log = open(self.dir / "node.log", "wb")
        lifeline, self._lifeline = os.pipe()
        # The holder enters the node's cgroup before unshare, so that the cgroup namespace is
        # rooted there; it reads the lifeline (its stdin, whose only writer is this process) and
        # kills unshare at its end, and unshare's child, the node's systemd, with it
        # (--kill-child): the node goes when the test process dies without closing it.
        holder = ("echo $$ > \"$CG/cgroup.procs\"; unshare --kill-child=SIGKILL --mount --pid --uts --net --ipc "
                  "--cgroup --fork --propagation private sh -c \"$SETUP\" sh \"$@\" & read -r _; kill -KILL $!; wait")
        self._holder = subprocess.Popen(
            ["sh", "-c", holder, "sh", str(self.dir), self.lower_spec, str(self.host_fixture)],
            env={"PATH": PATH, "SETUP": _SETUP, "CG": str(self.node_cgroup)},
            stdin=lifeline, stdout=self.holder_log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(lifeline)
        deadline = time.monotonic() + timeout
        while not (self.dir / "run/node-ready").exists():
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise NodeError(f"node did not start: {(self.dir / 'node.log').read_text()[-2000:]}")
            time.sleep(0.05)
        unshare = int(Path(f"/proc/{self._holder.pid}/task/{self._holder.pid}/children").read_text().split()[0])
        self.init_pid = int(Path(f"/proc/{unshare}/task/{unshare}/children").read_text().split()[0])
        (self.dir / "init.pid").write_text(f"{self.init_pid}\n")
        # the holder and unshare back to the test's own cgroup: the node's then holds only the node
        mine = Path("/proc/self/cgroup").read_text().splitlines()
        own = next(line.split(":", 2)[2] for line in mine if line.startswith("0::"))
        for pid in (self._holder.pid, unshare):
            (Path(self.cgroup2) / own.lstrip("/") / "cgroup.procs").write_text(str(pid))
        (self.dir / "run/node-go").touch()
        self.wait_booted(deadline - time.monotonic())
        (self.dir / "run/nvhook-test").mkdir(exist_ok=True)
        self.cri.wait_ready(max(deadline - time.monotonic(), 10))
        return self

    def wait_booted(self, timeout: float) -> None:
        """Until systemd says the boot is over (`is-system-running --wait`: running or degraded)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.run(["systemctl", "is-system-running", "--wait"], check=False, timeout=max(timeout, 1))
            state = r.stdout.strip()
            if state in ("running", "degraded"):
                self.boot_state = state
                return
            if self._holder.poll() is not None or time.monotonic() > deadline:
                journal = self.run(["journalctl", "-b", "--no-pager", "-n", "60"], check=False, timeout=30)
                raise NodeError(f"systemd did not finish booting the node ({state or r.stderr.strip()}); its "
                                f"console:\n{self.console()[-3000:]}\njournal:\n{journal.stdout[-4000:]}")
            time.sleep(0.1)

    def console(self) -> str:
        return (self.dir / "console.log").read_text(errors="replace")

    def _enter(self) -> list[str]:
        return ["nsenter", "--target", str(self.init_pid), "--mount", "--pid", "--uts", "--net", "--ipc", "--cgroup",
                "--root", "--wd", "env", "-i", *NODE_ENV]

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.run(["systemctl", "--no-pager", *args], check=check).stdout

    def unit(self, name: str, *props: str) -> dict:
        out = self.systemctl("show", name, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        self.run(["journalctl", "--sync"], check=False)
        return self.run(["journalctl", "--no-pager", "-o", "cat", "-u", unit]).stdout

    def start_containerd(self, timeout: float = 60) -> None:
        self.systemctl("start", "containerd.service")
        self.cri.wait_ready(timeout)

    def stop_containerd(self, timeout: float = 30) -> None:
        self.systemctl("stop", "containerd.service")

    def restart_containerd(self) -> None:
        self.systemctl("restart", "containerd.service")
        self.cri.wait_ready(60)

    @property
    def containerd_log(self) -> Path:
        log = self.dir / "containerd.log"
        log.write_text(self.journal("containerd.service"))
        return log

    def close(self) -> list[str]:
        """SIGKILL to the node's systemd (SIGTERM would make it re-execute itself): the kernel
        kills everything in its pid namespace; then its cgroups and directory go."""
        problems = []
        if self._cri is not None:
            self._cri.close()
        if self._holder is not None:
            if self._holder.poll() is None and self.init_pid:
                os.kill(self.init_pid, signal.SIGKILL)
                # unshare, its parent, reaps it (and the kernel everything else of its namespace)
                deadline = time.monotonic() + 30
                while Path(f"/proc/{self.init_pid}").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            if self._lifeline >= 0:  # the holder's end of the pipe: it exits
                os.close(self._lifeline)
                self._lifeline = -1
            try:
                self._holder.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self._holder.pid, signal.SIGKILL)
                self._holder.wait(10)
            self.holder_log.close()
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        problems += self._remove_cgroups()
        with open("/proc/self/mountinfo") as f:
            leaked = [line.split()[4] for line in f if line.split()[4].startswith(str(self.dir))]
        if leaked:
            problems.append(f"mounts of the node visible on the machine: {leaked[:5]}")
        if self.init_pid and Path(f"/proc/{self.init_pid}").exists():
            problems.append(f"node init {self.init_pid} still running")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.dir.exists():
            problems.append(f"{self.dir} not removed")
        return problems


def start_systemd_node(host_fixture: Path, images: dict[str, Path]) -> SystemdNode:
    """Booted, containerd ready (started by systemd), `images` imported; nvhook not installed."""
    Node.sweep_stale()
    suite = getattr(images, "suite", noderoot.SUITE)  # the session's root (conftest.NodeInputs)
    layer = ensure_layer(suite)
    n = SystemdNode(f"{layer}:{noderoot.root_path(suite)}", host_fixture, suite=suite)
    try:
        n.start()
        n.import_images(images)
    except BaseException:
        n.close()
        raise
    return n


if __name__ == "__main__":  # `make node`: the layer built ahead of the tests
    import sys

    suite = sys.argv[sys.argv.index("--suite") + 1] if "--suite" in sys.argv[:-1] else noderoot.SUITE
    reason = noderoot.cannot_build(suite)
    if reason:
        print(f"sdnode: cannot build the {suite} systemd layer here: {reason}", file=sys.stderr)
        sys.exit(1)
    print(ensure_layer(suite))
