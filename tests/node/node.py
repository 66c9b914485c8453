"""A private Debian node: Debian 13's containerd 1.7 or Debian unstable's containerd 2.1 (and runc,
crun, podman, Docker) run from a cached root of noderoot.py (Node's `suite`), with its own state,
config and sockets, beside the machine's own engines and never touching them.

How it is isolated, and why this way rather than systemd-nspawn or a VM: the node is one
`unshare --mount --pid` namespace pair whose first process mounts an overlay (the cached root
read-only below, this session's directory above), the machine's /dev and /sys (so its cgroup
hierarchy, and the device cgroup that decides what a container may open) and a fresh /proc,
then pivot_root()s into it and stays as the namespace's init, reaping what is reparented to it.
- The mount namespace is private (no propagation either way): nothing the node or its
  containers mount appears in the machine's mount table, and the machine's /etc/containerd,
  /var/lib/containerd, /run/containerd and systemd units are simply not in the node's tree.
- The pid namespace makes teardown total: when its init dies the kernel kills every process in
  it (containerd, shims, every container, whatever a test left running), so a crashed test
  cannot leave a shim behind; its mounts go with the last process.
- The network is the machine's (pods use the node's network: the node has no CNI plugin, and a
  bridge would change the machine's interfaces and firewall).
- systemd-nspawn would need systemd in the root and registers with the machine's systemd
  (machined, units, cgroups under machine.slice): global state this suite must not touch.
The node's /run, /var/lib/containerd and /nvhook (files the tests hand in) are directories of
this session on the machine, so the tests reach the CRI socket, logs and state directly; any
other node path is reachable from the machine as `Node.path(p)` (/proc/<init>/root/..., the node's
links in it resolved inside the node), written with `Node.write` and removed with `Node.remove`
(tests/node/nodefiles.py: a node's absolute link never leads a test onto the machine's files).

Pods' cgroups go under one parent per node (`Node.cgroup_parent`), removed at close.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import nodefiles  # noqa: E402
import noderoot  # noqa: E402

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
NODE_ENV = ["PATH=" + PATH, "HOME=/root", "LANG=C.UTF-8"]
NVHOOK_VENV = "/opt/nvhook"
NVHOOK = f"{NVHOOK_VENV}/bin/nvhook"
NVHOOK_RUNTIME = f"{NVHOOK_VENV}/bin/nvhook-runtime"
NVHOOK_CONFIG = "/etc/nvhook/hook.toml"
NVHOOK_LOG = "/var/log/nvhook.log"  # the shipped config's, as node install writes it
HOST_ROOT = "/nvhook/host"  # the fixture host root (fake driver, GPUs, device nodes), read-only
RUNTIME_HANDLER = "nvidia"
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
CRI_SOCKET = "/run/containerd/containerd.sock"
DOCKER_SOCKET = "/run/docker.sock"
DOCKER_CONFIG = "/etc/docker/daemon.json"
FIXTURES = "/nvhook/fixtures"  # every fixture host (tests/fixtures/rootfs), read-only
NRI_SOCKET = "/run/nri/nri.sock"

# The node's first process: mounts, pivot_root, then init (argv: session dir, lower root,
# fixture host root, cgroup mode). The engines' image stores (containerd's, Docker's, podman's)
# are directories of the session, not the overlay: overlayfs cannot be their upper layer.
_SETUP = r"""set -eu
S=$1 LOWER=$2 HOSTFIX=$3 CGROUP=$4
R=$S/root
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$S/upper,workdir=$S/work" "$R"
mkdir -p "$R/dev" "$R/proc" "$R/sys" "$R/run" "$R/tmp" "$R/var/lib/containerd" "$R/nvhook" \
  "$R/var/lib/docker" "$R/var/lib/containers"
mount --rbind /dev "$R/dev"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
if [ "$CGROUP" = v2 ]; then mount -t cgroup2 cgroup2 "$R/sys/fs/cgroup"; fi
mount --bind "$S/run" "$R/run"
mount --bind "$S/containerd" "$R/var/lib/containerd"
mount --bind "$S/docker" "$R/var/lib/docker"
mount --bind "$S/containers" "$R/var/lib/containers"
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
exec /usr/bin/python3 -I -c "$INIT"
"""

# pid 1 of the node: reaps orphans (exited shims, daemons' children), exits on SIGTERM, which
# makes the kernel kill everything else in the node. It also exits when the test process dies
# without closing the node (killed pytest): the lifeline pipe's only writer is that process.
_INIT = r"""
import os, select, signal, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
lifeline = int(os.environ["LIFELINE"])
open("/run/node-ready", "w").close()
while True:
    ready, _, _ = select.select([lifeline], [], [], 0.5)
    if ready and not os.read(lifeline, 1):
        os._exit(0)
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""


# On a machine that boots hybrid (controllers on cgroup v1, the unified hierarchy without them)
# a node with cgroup2 mounted has no cpu controller, yet containerd gives every pod sandbox CPU
# shares and runc then fails to write cpu.weight. These runtimes, the node's "runc" and "crun"
# there (and the runtime nvhook-runtime runs), drop linux.resources.cpu from config.json on
# create and run the real one (their name without -nocpu): the device cgroup, what the v2
# tests are about, stays the runtime's own BPF program, untouched.
RUNC_NOCPU = "/usr/local/sbin/runc-nocpu"
CRUN_NOCPU = "/usr/local/sbin/crun-nocpu"
_RUNC_NOCPU = r"""#!/usr/bin/python3 -I
import json, os, sys
args = sys.argv[1:]
if "create" in args or "run" in args:
    bundle = "."
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            bundle = args[i + 1]
        elif a.startswith("--bundle="):
            bundle = a.split("=", 1)[1]
    path = os.path.join(bundle, "config.json")
    with open(path) as f:
        spec = json.load(f)
    if (spec.get("linux") or {}).get("resources", {}).pop("cpu", None) is not None:
        with open(path + ".tmp", "w") as f:
            json.dump(spec, f)
        os.replace(path + ".tmp", path)
real = os.path.basename(sys.argv[0]).replace("-nocpu", "")
os.execvp(real, [real, *args])
"""


def cgroup2_has_cpu(root: str = "/sys/fs/cgroup") -> bool:
    """Whether the machine's cgroup2 hierarchy offers the cpu controller (a pure v2 machine
    does; a hybrid one has it on v1)."""
    for top in (root, f"{root}/unified"):
        try:
            with open(f"{top}/cgroup.controllers") as f:
                return "cpu" in f.read().split()
        except OSError:
            continue
    return False


def containerd_config(*, nri: bool | None = None, runc_binary: str = "", crun_binary: str = "/usr/bin/crun",
                      suite: str = noderoot.SUITE) -> str:
    """The node's containerd config: every path inside the node; the local pause image as sandbox
    image (present, so never pulled); runc and crun as runtime handlers. trixie's containerd 1.7
    gets a version 2 config with CDI on and NRI configured but off unless `nri`
    (Node.enable_nri); sid's containerd 2.1 its version 3 config, CDI and NRI left at 2.1's
    defaults (both on) unless `nri` is False. The NRI tests switch it either way."""
    if suite == "sid":
        return _containerd_config_v3(nri=nri, runc_binary=runc_binary, crun_binary=crun_binary)
    import images

    return f"""# The node's containerd (tests/node/node.py): written per session.
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "{CRI_SOCKET}"

[debug]
  level = "info"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{images.PAUSE}"
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  disable_apparmor = true
  # The pause container's oom_score_adj is -998 otherwise, which needs CAP_SYS_RESOURCE: a
  # machine that runs the suite in a container may not have it (this one does not).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false{f"{chr(10)}        BinaryName = {json.dumps(runc_binary)}" if runc_binary else ""}
    # crun as a runtime handler of its own: CDI-injected pods on crun
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun.options]
        BinaryName = "{crun_binary}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"

[plugins."io.containerd.nri.v1.nri"]
  disable = {"false" if nri else "true"}
  socket_path = "{NRI_SOCKET}"
  plugin_path = "/opt/nri/plugins"
  plugin_config_path = "/etc/nri/conf.d"
"""


def _containerd_config_v3(*, nri: bool | None, runc_binary: str, crun_binary: str) -> str:
    """containerd 2.x's layout: the CRI runtime settings under io.containerd.cri.v1.runtime, the
    sandbox image a pinned image of io.containerd.cri.v1.images."""
    import images

    rt = '[plugins."io.containerd.cri.v1.runtime"'
    return f"""# The node's containerd 2.1 (tests/node/node.py): written per session.
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "{CRI_SOCKET}"

[debug]
  level = "info"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{images.PAUSE}"

{rt}]
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  disable_apparmor = true
  # see the version 2 config: no CAP_SYS_RESOURCE needed for the pause container
  restrict_oom_score_adj = true
  {rt}.containerd]
    default_runtime_name = "runc"
    {rt}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      {rt}.containerd.runtimes.runc.options]
        SystemdCgroup = false{f"{chr(10)}        BinaryName = {json.dumps(runc_binary)}" if runc_binary else ""}
    {rt}.containerd.runtimes.crun]
      runtime_type = "io.containerd.runc.v2"
      {rt}.containerd.runtimes.crun.options]
        BinaryName = "{crun_binary}"
  {rt}.cni]
    bin_dirs = ["/opt/cni/bin"]
    conf_dir = "/etc/cni/net.d"

[plugins."io.containerd.nri.v1.nri"]{"" if nri is not False else chr(10) + "  disable = true"}
  socket_path = "{NRI_SOCKET}"
  plugin_path = "/opt/nri/plugins"
  plugin_config_path = "/etc/nri/conf.d"
"""


# What each root's engines say they are (`--version`'s start), and where containerd's `config
# dump` shows the CRI runtimes: 1.7's io.containerd.grpc.v1.cri, 2.x's io.containerd.cri.v1.runtime.
ENGINES = {
    "trixie": {"containerd": "1.7.", "runc": "runc version 1.1.15", "crun": "crun version 1.21",
               "podman": "podman version 5.", "dockerd": "Docker version 26.", "python3": "3.13"},
    "sid": {"containerd": "2.1.", "runc": "runc version 1.3.", "crun": "crun version 1.28",
            "podman": "podman version 5.8.", "dockerd": "Docker version 28.5.", "python3": "3.14"},
}
CRI_RUNTIME_PLUGIN = {"trixie": ("plugins", "io.containerd.grpc.v1.cri"),
                      "sid": ("plugins", "io.containerd.cri.v1.runtime")}


class NodeError(AssertionError):
    pass


class Node:
    """A running private node (see the module docstring). Made by the session fixture `node`
    (tests/node/conftest.py); the NRI tests build on it.

    - `run(argv)` / `sh(script)`: a command in the node (its root, mounts and pids), as root,
      with a clean environment; returns CompletedProcess (check=True raises with the output).
    - `path(p)`: the machine path of node path `p`, to read or write node files from a test.
    - `start_containerd()`, `stop_containerd()`, `restart_containerd()`: containerd 1.7 with
      /etc/containerd/config.toml (containerd_config()); its log is `containerd_log`.
    - `cri` (a cri.CRI on the node's socket), `kubelet` (a cri.Kubelet running pods under
      `cgroup_parent`).
    - `install_nvhook()`: `nvhook node install --host-root /proc/<init>/root` (the fixture
      host as driver root, runtime handler "nvidia", the node's runc, device list from envvar
      and volume-mounts), then containerd restarted to read its config.
    - `enable_nri()`: turn containerd's NRI on (socket `nri_socket` on the machine) and restart.
    - `nvhook_events()`: nvhook's JSON log in the node, parsed.
    - `close()`: everything stopped and removed (the pid namespace dies; cgroups removed).
    """

    def __init__(self, lower: Path, host_fixture: Path, *, cgroup: str = "host", name: str | None = None,
                 suite: str = noderoot.SUITE):
        if cgroup not in ("host", "v2"):
            raise ValueError("cgroup is 'host' (the machine's hierarchy as it is) or 'v2' (cgroup2 mounted)")
        self.id = name or uuid.uuid4().hex[:8]
        # short: the CRI and NRI sockets live under it, and unix socket paths are limited
        self.dir = Path(f"/tmp/nvhook-node-{self.id}")
        self.lower = lower
        self.suite = suite  # the root's Debian suite: trixie (containerd 1.7) or sid (2.1)
        self.host_fixture = host_fixture
        self.cgroup_mode = cgroup
        self.cgroup_parent = f"/nvhook-node-{self.id}"
        self.init_pid: int | None = None
        self._lifeline = -1
        self._holder: subprocess.Popen | None = None
        self._containerd: subprocess.Popen | None = None
        self._dockerd: subprocess.Popen | None = None
        self._cri = None
        self._kubelet = None
        self.nvhook_installed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> Node:
        for d in ("upper", "work", "root", "run", "containerd", "docker", "containers", "share"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711)
        self.holder_log = open(self.dir / "node.log", "wb")
        lifeline, self._lifeline = os.pipe()
        self._holder = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
             "sh", "-c", _SETUP, "sh", str(self.dir), str(self.lower), str(self.host_fixture), self.cgroup_mode],
            env={"PATH": PATH, "INIT": _INIT, "LIFELINE": str(lifeline)}, stdin=subprocess.DEVNULL,
            stdout=self.holder_log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(lifeline,))
        os.close(lifeline)
        deadline = time.monotonic() + timeout
        while not (self.dir / "run/node-ready").exists():
            if self._holder.poll() is not None or time.monotonic() > deadline:
                raise NodeError(f"node did not start: {(self.dir / 'node.log').read_text()[-2000:]}")
            time.sleep(0.05)
        children = Path(f"/proc/{self._holder.pid}/task/{self._holder.pid}/children").read_text().split()
        self.init_pid = int(children[0])
        (self.dir / "init.pid").write_text(f"{self.init_pid}\n")
        (self.dir / "run/nvhook-test").mkdir(exist_ok=True)  # the tests' own files in the node's /run
        self.runc, crun = "runc", "/usr/bin/crun"
        if self.cgroup_mode == "v2" and not cgroup2_has_cpu():
            self.write(RUNC_NOCPU, _RUNC_NOCPU, 0o755)
            self.write(CRUN_NOCPU, _RUNC_NOCPU, 0o755)
            self.runc, crun = RUNC_NOCPU, CRUN_NOCPU
        self.write(CONTAINERD_CONFIG, containerd_config(runc_binary="" if self.runc == "runc" else self.runc,
                                                        crun_binary=crun, suite=self.suite))
        return self

    def close(self) -> list[str]:
        """Stop everything; returns what could not be cleaned (empty when all went)."""
        problems = []
        if self._kubelet is not None and self._containerd is not None and self._containerd.poll() is None:
            try:
                self._kubelet.remove_all()
            except Exception as e:  # the node goes anyway
                problems.append(f"removing pods: {e}")
        if self._dockerd is not None and self._dockerd.poll() is None:
            try:
                self.stop_dockerd()
            except Exception as e:
                problems.append(f"stopping dockerd: {e}")
        if self._cri is not None:
            self._cri.close()
        if self._containerd is not None and self._containerd.poll() is None:
            try:
                self.stop_containerd()
            except Exception as e:
                problems.append(f"stopping containerd: {e}")
        if self._holder is not None:
            if self._holder.poll() is None:
                os.kill(self.init_pid or self._holder.pid, signal.SIGTERM)
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
        with open("/proc/self/mountinfo") as f:  # only our own directory: what could have leaked
            leaked = [line.split()[4] for line in f if line.split()[4].startswith(str(self.dir))]
        if leaked:
            problems.append(f"mounts of the node visible on the machine: {leaked[:5]}")
        if self.init_pid and Path(f"/proc/{self.init_pid}").exists():
            problems.append(f"node init {self.init_pid} still running")
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.dir.exists():
            problems.append(f"{self.dir} not removed")
        return problems

    @staticmethod
    def sweep_stale() -> list[str]:
        """Remove what nodes of killed test sessions left: a /tmp/nvhook-node-* whose init is
        gone (its processes died with it, see _INIT) and that node's cgroups. Returns the ids."""
        swept = []
        for d in Path("/tmp").glob("nvhook-node-*"):
            try:
                pid = int((d / "init.pid").read_text())
            except (OSError, ValueError):
                if time.time() - d.stat().st_mtime < 3600:
                    continue  # starting now, or not ours to judge yet
                pid = None
            if pid is not None and Path(f"/proc/{pid}").exists():
                continue
            stale = Node.__new__(Node)
            stale.id, stale.dir = d.name[len("nvhook-node-"):], d
            stale.cgroup_parent = f"/nvhook-node-{stale.id}"
            stale._remove_cgroups(timeout=2)
            shutil.rmtree(d, ignore_errors=True)
            swept.append(stale.id)
        return swept

    def _remove_cgroups(self, timeout: float = 20) -> list[str]:
        """rmdir the pods' cgroups (deepest first) in every hierarchy of the machine: the
        processes in them are gone with the pid namespace, but the kernel frees a cgroup only
        once its last task has exited, so this retries for a while."""
        base = Path("/sys/fs/cgroup")
        name = self.cgroup_parent.strip("/")
        tops = [base / name] + [d / name for d in base.iterdir() if d.is_dir()] if base.is_dir() else []
        tops = [t for t in tops if t.is_dir()]
        deadline = time.monotonic() + timeout
        left = []
        while True:
            left = []
            for top in tops:
                for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
                    try:
                        os.rmdir(dirpath)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        left.append(dirpath)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return [f"cgroup {p} not removed" for p in left]

    # -- commands and files ------------------------------------------------------------------

    def _enter(self) -> list[str]:
        return ["nsenter", "--target", str(self.init_pid), "--mount", "--pid", "--root", "--wd",
                "env", "-i", *NODE_ENV]

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
        p = subprocess.run([*self._enter(), *argv], capture_output=True, text=True, errors="replace",
                           timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise NodeError(f"in the node: {shlex.join(argv)[:300]}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
        return p

    def sh(self, script: str, **kw) -> subprocess.CompletedProcess:
        return self.run(["sh", "-c", script], **kw)

    @property
    def root(self) -> Path:
        """The node's "/" as the machine reaches it (the node init's root)."""
        return Path(f"/proc/{self.init_pid}/root")

    def path(self, p: str, follow: bool = True) -> Path:
        """The machine path of node path `p`, the node's links in it resolved inside the node
        (tests/node/nodefiles.py): for reading and stat. Write with `write`, remove with `remove`."""
        return self.root / nodefiles.resolve(self.root, p, follow).lstrip("/")

    def write(self, p: str, text: str | bytes, mode: int = 0o644) -> None:
        """Replace node file `p` atomically, resolved inside the node: a link of the node's is
        never followed onto the machine."""
        nodefiles.write(self.root, p, text, mode)

    def read(self, p: str) -> str:
        return nodefiles.read(self.root, p).decode()

    def remove(self, p: str) -> None:
        """Unlink node file `p` (a link itself, not its target), if it is there."""
        nodefiles.remove(self.root, p)

    # -- containerd --------------------------------------------------------------------------

    @property
    def cri_socket(self) -> str:
        return str(self.dir / "run" / CRI_SOCKET[len("/run/"):])

    @property
    def nri_socket(self) -> str:
        return str(self.dir / "run" / NRI_SOCKET[len("/run/"):])

    @property
    def containerd_log(self) -> Path:
        return self.dir / "containerd.log"

    def start_containerd(self, timeout: float = 60) -> None:
        assert self._containerd is None or self._containerd.poll() is not None, "containerd is running"
        out = open(self.containerd_log, "ab")
        self._containerd = subprocess.Popen(
            [*self._enter(), "sh", "-c", f"echo $$ > /run/containerd.pid; exec containerd --config {CONTAINERD_CONFIG}"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self.cri.wait_ready(timeout)

    def stop_containerd(self, timeout: float = 30) -> None:
        """SIGTERM and wait, as `systemctl stop containerd` (KillMode=process): the shims and
        the containers keep running."""
        if self._containerd is None or self._containerd.poll() is not None:
            return
        pid = (self.dir / "run/containerd.pid").read_text().strip()
        self.run(["kill", "-TERM", pid])
        try:
            self._containerd.wait(timeout)
        except subprocess.TimeoutExpired:
            self.run(["kill", "-KILL", pid], check=False)
            self._containerd.wait(10)

    def restart_containerd(self) -> None:
        self.stop_containerd()
        self.start_containerd()

    @property
    def cri(self):
        if self._cri is None:
            import cri

            self._cri = cri.CRI(self.cri_socket)
        return self._cri

    @property
    def kubelet(self):
        if self._kubelet is None:
            import cri

            self._kubelet = cri.Kubelet(self.cri, self.run, self.cgroup_parent,
                                        cgroup_controllers=self.cgroup_mode == "host")
        return self._kubelet

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(["ctr", "--address", CRI_SOCKET, "-n", "k8s.io", *args], check=check, timeout=timeout)

    def import_images(self, archives: dict[str, Path]) -> None:
        """`ctr images import` each archive (handed in through /nvhook/images)."""
        dest = self.dir / "share/images"
        dest.mkdir(exist_ok=True)
        for archive in archives.values():
            shutil.copy2(archive, dest / archive.name)
            self.ctr("images", "import", f"/nvhook/images/{archive.name}")
            (dest / archive.name).unlink()
        # containerd 2.x's CRI learns of an imported image from containerd's image events, a
        # moment after `ctr images import` returns: waited for (1.7 lists it at once)
        from waiting import wait_until

        def listed() -> set:
            return {t for img in self.cri.ListImages().images for t in img.repo_tags}

        try:
            wait_until(lambda: not set(archives) - listed(), "the imported images in the CRI's list", timeout=30)
        except AssertionError:
            missing = set(archives) - listed()
            raise NodeError(f"images not listed by the CRI after import: {sorted(missing)} "
                            f"(listed: {sorted(listed())})") from None

    def specs(self, cid: str) -> tuple[dict, dict]:
        """(the OCI spec containerd made for container `cid`, the config.json its runtime was
        given in the bundle, as the runtime left it): equal where nothing edited the spec."""
        info = json.loads(self.ctr("containers", "info", cid).stdout)
        bundle = self.path(f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{cid}/config.json")
        return info["Spec"], json.loads(bundle.read_text())

    def enable_nri(self, enabled: bool = True) -> None:
        """containerd's NRI on (`[plugins."io.containerd.nri.v1.nri"] disable = false`, or no
        `disable` where 2.x has it on by default; its socket at `nri_socket` on the machine,
        plugins pre-installed in the node's /opt/nri/plugins), or off again with enabled=False;
        containerd restarted to read it."""
        head = '[plugins."io.containerd.nri.v1.nri"]'
        text = self.read(CONTAINERD_CONFIG)
        if head not in text:
            raise NodeError(f"{CONTAINERD_CONFIG} in the node has no NRI section to switch")
        before, after = text.split(head, 1)
        body = [ln for ln in after.split("\n") if not ln.strip().startswith("disable =")]
        body.insert(1, f"  disable = {'false' if enabled else 'true'}")
        self.write(CONTAINERD_CONFIG, before + head + "\n".join(body))
        self.restart_containerd()

    # -- Docker 26 and podman 5 ---------------------------------------------------------------

    @property
    def dockerd_log(self) -> Path:
        return self.dir / "dockerd.log"

    def start_dockerd(self, timeout: float = 120) -> None:
        """dockerd (Docker 26) in the node, on the node's containerd (namespace moby), reading
        /etc/docker/daemon.json as an operator's would (the tests write it first; the flags
        below are not in it: dockerd refuses a setting given both ways). Everything it keeps is
        the node's: data root /var/lib/docker (a session directory), exec root, pidfile and
        socket in the node's /run. It never touches the machine's network: no bridge, no
        iptables or ip6tables rules, no forwarding or masquerading sysctl, no userland proxy;
        containers run with --network none. Containers' cgroups go under the node's parent."""
        assert self._dockerd is None or self._dockerd.poll() is not None, "dockerd is running"
        out = open(self.dockerd_log, "ab")
        argv = ["dockerd", "--config-file", DOCKER_CONFIG, "--data-root", "/var/lib/docker",
                "--exec-root", "/run/docker", "--pidfile", "/run/docker.pid", "-H", f"unix://{DOCKER_SOCKET}",
                "--containerd", CRI_SOCKET, "--iptables=false", "--ip6tables=false", "--bridge=none",
                "--ip-forward=false", "--ip-masq=false", "--userland-proxy=false",
                "--exec-opt", "native.cgroupdriver=cgroupfs", "--cgroup-parent", f"{self.cgroup_parent}/docker"]
        self._dockerd = subprocess.Popen([*self._enter(), *argv], stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        deadline = time.monotonic() + timeout
        while self.docker("version", check=False, timeout=30).returncode != 0:
            if self._dockerd.poll() is not None or time.monotonic() > deadline:
                raise NodeError(f"dockerd did not start: {self.dockerd_log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def stop_dockerd(self, timeout: float = 60) -> None:
        if self._dockerd is None or self._dockerd.poll() is not None:
            return
        pid = (self.dir / "run/docker.pid").read_text().strip()
        self.run(["kill", "-TERM", pid])
        try:
            self._dockerd.wait(timeout)
        except subprocess.TimeoutExpired:
            self.run(["kill", "-KILL", pid], check=False)
            self._dockerd.wait(10)

    def restart_dockerd(self) -> None:
        """As `systemctl restart docker` (what `node install --restart-engine` runs): besides
        daemon.json, dockerd reads the CDI spec directories afresh at its start (later it
        follows them with inotify, on its own time)."""
        self.stop_dockerd()
        self.start_dockerd()

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(["docker", "-H", f"unix://{DOCKER_SOCKET}", *args], check=check, timeout=timeout)

    # podman 5 rootful, all its state the node's (storage in /var/lib/containers, a session
    # directory; run root in the node's /run), cgroupfs under the node's parent, runc as its
    # runtime (crun 1.21 refuses a hybrid hierarchy whose cgroup2 holds a controller), events
    # to a file (no journald in the node).
    PODMAN_GLOBAL = ("--cgroup-manager", "cgroupfs", "--events-backend", "file", "--runtime", "runc",
                     "--storage-driver", "overlay")

    def podman(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run(["env", "PODMAN_IGNORE_CGROUPSV1_WARNING=1", "podman", *self.PODMAN_GLOBAL, *args],
                        check=check, timeout=timeout)

    def load_images(self, archives: dict[str, Path]) -> None:
        """The image archives into Docker (`docker load`, when dockerd runs) and podman
        (`podman load`), as Docker archives (images.docker_archive)."""
        import images

        dest = self.dir / "share/images"
        dest.mkdir(exist_ok=True)
        for ref, archive in archives.items():
            tar = images.docker_archive(archive, dest / f"docker-{archive.name}")
            inside = f"/nvhook/images/{tar.name}"
            if self._dockerd is not None and self._dockerd.poll() is None:
                self.docker("load", "-q", "-i", inside, timeout=300)
            self.podman("load", "-q", "-i", inside, timeout=300)
            tar.unlink()
            for listed in (self.docker("images", "-q", ref).stdout if self._dockerd is not None else "x",
                           self.podman("images", "-q", ref).stdout):
                if not listed.strip():
                    raise NodeError(f"{ref} not listed after loading it")

    # -- nvhook ------------------------------------------------------------------------------

    def install_nvhook(self, *, runtime_name: str = RUNTIME_HANDLER,
                       strategies: str = "envvar,volume-mounts") -> subprocess.CompletedProcess:
        """nvhook as a cluster installs it on this node: `nvhook node install` (this checkout's,
        as the DaemonSet's container runs it: node_install) with the node's root at /proc/<init>/root, the
        node's own python3 running what it puts in /opt/nvhook. The driver is the fixture host
        (--driver-root), the runtime handler `runtime_name`, the OCI runtime the node's runc
        (the -nocpu one on a hybrid machine's v2 node), the device list from the device
        plugin's `strategies` (both envvar and volume-mounts: the tests run every strategy on
        one node). Then containerd restarted to read its config: the node runs no systemd, so
        this is the restart --restart-engine makes with a systemd (see test_cri_restart_engine.py).
        Returns install's result (its stdout says what it did)."""
        r = node_install(self, "install", "--runtime", "containerd", "--runtime-name", runtime_name,
                         "--driver-root", HOST_ROOT, "--device-list-strategy", strategies, "--oci-runtime", self.runc)
        if r.returncode != 0:
            raise NodeError(f"nvhook node install: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
        self.nvhook_installed = True
        if self._containerd is not None and self._containerd.poll() is None:
            self.restart_containerd()
        return r

    def install_nvidia_reference(self, ref: Path, handler: str = "nvidia-ref",
                                 ctk_env: dict[str, str] | None = None) -> None:
        """NVIDIA's own runtime handler beside nvhook's, for side-by-side benches: their
        nvidia-container-runtime, nvidia-ctk and nvidia-cdi-hook (built outside the repo by
        bench/build_reference_cdi.sh into `ref`) handed in at /nvhook/nvidia-ref; the runtime in
        its "cdi" mode (NVIDIA_VISIBLE_DEVICES and cdi.k8s.io/ annotations become nvidia.com/gpu
        devices) reading a spec that nvidia-ctk generated for the fixture host, whose hooks are
        their nvidia-cdi-hook; registered with containerd as runtime handler `handler` over the
        node's runc. Their spec lives in a directory of its own, so containerd's CDI (and
        nvhook's spec in /etc/cdi) never sees it. containerd restarted. `ctk_env`: more variables
        for nvidia-ctk (see bench/nri_pod_start.py)."""
        sys.path.insert(0, str(REPO / "tests/e2e"))
        import cdihookbox

        dest = self.dir / "share/nvidia-ref"
        (dest / "cdi").mkdir(parents=True, exist_ok=True)
        for tool in ("nvidia-container-runtime", "nvidia-ctk", "nvidia-cdi-hook"):
            shutil.copy2(ref / tool, dest / tool)
        p = cdihookbox.nvidia_ctk_generate(ref, self.host_fixture, "/nvhook/nvidia-ref/nvidia-cdi-hook",
                                           env=ctk_env)
        if p.returncode:
            raise NodeError(f"nvidia-ctk cdi generate failed: {p.stderr[-2000:]}")
        spec = p.stdout
        for machine_path in {str(self.host_fixture.resolve()), str(self.host_fixture)}:
            spec = spec.replace(machine_path, HOST_ROOT)
        (dest / "cdi/nvidia.json").write_text(spec)
        self.write("/etc/nvidia-container-runtime/config.toml", f"""# NVIDIA's runtime, cdi mode (bench only)
[nvidia-container-runtime]
mode = "cdi"
runtimes = ["{self.runc}"]
log-level = "info"

[nvidia-container-runtime.modes.cdi]
spec-dirs = ["/nvhook/nvidia-ref/cdi"]
default-kind = "nvidia.com/gpu"
annotation-prefixes = ["cdi.k8s.io/"]

[nvidia-ctk]
path = "/nvhook/nvidia-ref/nvidia-ctk"
""")
        plugin = CRI_RUNTIME_PLUGIN[self.suite][1]
        table = f'[plugins."{plugin}".containerd.runtimes.{handler}]'
        text = self.read(CONTAINERD_CONFIG)
        if table not in text:
            self.write(CONTAINERD_CONFIG, text + f"""
{table}
  runtime_type = "io.containerd.runc.v2"
  [plugins."{plugin}".containerd.runtimes.{handler}.options]
    BinaryName = "/nvhook/nvidia-ref/nvidia-container-runtime"
""")
        self.restart_containerd()

    def containerd_dump(self, config: str = CONTAINERD_CONFIG) -> dict:
        """The node's containerd's own reading of `config` (`containerd config dump` in the node)."""
        from nvhook.base import tomlread

        return tomlread.loads(self.run(["containerd", "--config", config, "config", "dump"]).stdout)

    def cri_runtimes(self, dump: dict | None = None) -> dict:
        """The CRI plugin's `containerd` table as the node's containerd reads its config
        (runtimes, default_runtime_name), whichever its version."""
        d = self.containerd_dump() if dump is None else dump
        for k in CRI_RUNTIME_PLUGIN[self.suite]:
            d = d[k]
        return d["containerd"]

    def nvhook(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """The node's installed nvhook command."""
        return self.run([NVHOOK, *args], check=check)

    def nvhook_events(self, event: str | None = None) -> list[dict]:
        log = self.path(NVHOOK_LOG)
        if not log.exists():
            return []
        evs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return evs if event is None else [e for e in evs if e.get("event") == event]


# What `nvhook node install` may add to a node and `node uninstall` must take back: every file
# of these trees (not the engines' image stores, caches or pods' logs).
WATCHED = ("etc", "opt", "var", "root", "srv", "usr/local")
UNWATCHED = ("var/lib/containerd", "var/lib/docker", "var/lib/containers", "var/cache", "var/log/apt",
             "var/lib/kubelet", "var/log/pods")


def node_tree(root: Path) -> dict:
    """{relative path: what it is} of the node's WATCHED trees: links, dirs, files' mode and hash."""
    import hashlib

    out = {}
    for top in WATCHED:
        for dirpath, dirnames, filenames in os.walk(root / top):
            rel_dir = os.path.relpath(dirpath, root)
            dirnames[:] = [d for d in dirnames if os.path.join(rel_dir, d) not in UNWATCHED]
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                st = p.lstat()
                rel = os.path.relpath(p, root)
                if p.is_symlink():
                    out[rel] = ("link", os.readlink(p))
                elif p.is_dir():
                    out[rel] = ("dir", st.st_mode)
                elif p.is_file():
                    out[rel] = ("file", st.st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
                else:
                    out[rel] = ("special", st.st_mode)
    return out


def node_install(n: Node, *args: str) -> subprocess.CompletedProcess:
    """`nvhook node install|uninstall ... --host-root /proc/<node init>/root` run by this
    checkout's nvhook on the machine, as a DaemonSet's container runs it with the node's root:
    its files and mount namespace the machine's, its pid namespace the node's. A pod's pid
    namespace is a child of its node's, so its processes have pids in the node's /proc, which
    the commands install runs chrooted into the node read through /proc/self; from the
    machine's own pid namespace (the node's parent) /proc/self would not resolve there."""
    nvhook = os.path.join(os.path.dirname(sys.executable), "nvhook")
    return subprocess.run(["nsenter", "--target", str(n.init_pid), "--pid", "--",
                           nvhook, "node", *args, "--host-root", f"/proc/{n.init_pid}/root"],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("NVHOOK_")})


def start_node(host_fixture: Path, images: dict[str, Path], *, cgroup: str = "host", install: bool = True,
               suite: str | None = None) -> Node:
    """A node as the tests use it: started, containerd running, `images` imported, nvhook
    installed by `nvhook node install` (unless `install` is false: the tests of the install
    itself). Closed again when any step fails. The root: `suite`, else the session's (the
    `node_inputs` fixture's images carry it: conftest.NodeInputs), else trixie."""
    Node.sweep_stale()
    suite = suite or getattr(images, "suite", noderoot.SUITE)
    n = Node(noderoot.ensure(suite=suite), host_fixture, cgroup=cgroup, suite=suite)
    try:
        n.start()
        n.start_containerd()
        n.import_images(images)
        if install:
            n.install_nvhook()
    except BaseException:
        n.close()
        raise
    return n
