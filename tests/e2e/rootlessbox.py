"""Rootless podman as a real unprivileged user, without touching the machine's /etc.

`User` is a throwaway user (a free uid, a 65536-id subordinate range) that exists only inside
the private mount namespaces the tests start: every command runs under `unshare --mount` where
copies of /etc/passwd, /etc/group, /etc/subuid and /etc/subgid with the user's lines added are
bind-mounted over the machine's (newuidmap and newgidmap, set-user-ID root, read them there),
then as that user (setpriv) with HOME and XDG_RUNTIME_DIR in the user's own directory under
/tmp. The namespace has a /run of its own (a tmpfs: no journald socket unless a test binds a
stand-in's directory on /run/systemd/journal) with the test's CDI spec directory on /run/cdi, and (crun: it refuses a hybrid cgroup host) cgroup2 on
/sys/fs/cgroup. podman keeps all its state there too (vfs storage, run root, tmp dir); its
rootless pause process is killed and the directory removed by `close()`.

The hook: the .venv's interpreter may be one other users cannot run (a pyenv build under
/root), which is itself the failure `nvhook cdi check` now reports. So the tests' hook is a
copy of this checkout's nvhook package (and pyelftools) under the user's directory, run by the
distribution's python3 through a four-line launcher: what the .deb and the node install lay out.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import runcbox as rb

PY = "/usr/bin/python3"
REPO = Path(__file__).resolve().parents[2]
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the throwaway user is set up by root"
    for tool, why in (("podman", ""), ("newuidmap", " (the uidmap package)"), ("newgidmap", " (the uidmap package)"),
                      ("unshare", ""), ("setpriv", "")):
        if not shutil.which(tool):
            return f"{tool} is not installed{why}"
    probe = subprocess.run(["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", PY, "-c",
                            "import sys; assert sys.version_info >= (3, 9)"], capture_output=True, timeout=60)
    if probe.returncode:
        return f"no {PY} (3.9 or later) that an unprivileged user can run, for the hook"
    return None


def _ids(path: str, field: int) -> set[int]:
    out = set()
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        f = line.split(":")
        if len(f) > field and f[field].isdigit():
            out.add(int(f[field]))
    return out


def _sub_end(path: str) -> int:
    end = 0
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        f = line.split(":")
        if len(f) == 3 and f[1].isdigit() and f[2].isdigit():
            end = max(end, int(f[1]) + int(f[2]))
    return end


class User:
    """A throwaway user with subordinate ids and a home under a fresh /tmp/nvhook-rl-*."""

    def __init__(self, name: str = "nvrl"):
        self.dir = Path(tempfile.mkdtemp(prefix="nvhook-rl-", dir="/tmp"))
        os.chmod(self.dir, 0o755)
        taken = _ids("/etc/passwd", 2) | _ids("/etc/group", 2)
        self.uid = next(u for u in (random.randrange(40000, 59000) for _ in range(1000)) if u not in taken)
        self.gid = self.uid
        self.name = name
        # above every range already given out, on a 64k boundary, at a random height
        self.subid = (max(_sub_end("/etc/subuid"), _sub_end("/etc/subgid"), 1 << 20) // 65536
                      + random.randrange(1, 512)) * 65536
        self.home = self._own(self.dir / "home", 0o700)
        self.runtime_dir = self._own(self.dir / "run", 0o700)
        etc = self.dir / "etc"
        etc.mkdir()
        for f, line in (("passwd", f"{name}:x:{self.uid}:{self.gid}::{self.home}:/bin/sh"),
                        ("group", f"{name}:x:{self.gid}:"),
                        ("subuid", f"{name}:{self.subid}:65536"), ("subgid", f"{name}:{self.subid}:65536")):
            try:
                text = Path("/etc", f).read_text()
            except FileNotFoundError:
                text = ""
            (etc / f).write_text(text + ("" if not text or text.endswith("\n") else "\n") + line + "\n")
            (etc / f).chmod(0o644)
        self.etc = etc

    def _own(self, path: Path, mode: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)
        return path

    def chown_tree(self, path: Path) -> None:
        subprocess.run(["chown", "-R", "--no-dereference", f"{self.uid}:{self.gid}", str(path)], check=True)

    def command(self, cmd: list[str], *, binds: dict | None = None, cgroup2: bool = False,
                groups: tuple = (), env: dict | None = None, devs: Path | None = None,
                node_mode: str | None = None, readonly: Path | None = None) -> list[str]:
        """`cmd` as this user in a private mount namespace with the user's /etc lines and
        `binds` ({host dir: where}) in place; `groups`: supplementary groups it keeps; `devs`:
        a fixture host's dev/ whose nvidia nodes join the namespace's /dev (`node_mode`:
        "MODE:GROUP" for them there)."""
        pre = [f"mount --bind {shlex.quote(str(self.etc / f))} /etc/{f}" for f in ("passwd", "group", "subuid", "subgid")]
        # a /run of the namespace's own: the binds' mount points are made there, not on the host,
        # and the host's journald socket (if any) is out of sight unless one is bound in
        pre.append("mount -t tmpfs -o mode=0755 tmpfs /run")
        for src, dst in (binds or {}).items():
            pre.append(f"mkdir -p {shlex.quote(str(dst))} && mount --bind {shlex.quote(str(src))} {shlex.quote(str(dst))}")
        if readonly is not None:  # a directory bound read-only on itself, as a node's driver root may be
            q = shlex.quote(str(readonly))
            pre.append(f"mount --bind {q} {q} && mount -o remount,bind,ro {q} {q}")
        if devs is not None:
            pre.append(dev_script(devs, self.dir / "devns", node_mode))
        if cgroup2 and rb.host_cgroup_mode() != "v2":
            pre.append("mount -t cgroup2 none /sys/fs/cgroup")
        ids = [f"--reuid={self.uid}", f"--regid={self.gid}"]
        ids += [f"--groups={','.join(str(g) for g in groups)}"] if groups else ["--clear-groups"]
        e = {"PATH": SYSTEM_PATH, "HOME": str(self.home), "USER": self.name, "LOGNAME": self.name,
             "XDG_RUNTIME_DIR": str(self.runtime_dir), **(env or {})}
        script = " && ".join(pre) + ' || { echo "nvhook-test: namespace setup failed" >&2; exit 125; }; exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                "setpriv", *ids, "env", "-i", *(f"{k}={v}" for k, v in e.items()), *cmd]

    def close(self) -> None:
        """Kill the user's processes left behind (podman's pause process), remove the directory."""
        self.kill_pause(self.dir)
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill_pause(self, under: Path) -> None:
        """podman's rootless pause process (a pause.pid under `under`), when it is this user's."""
        for pid_file in under.rglob("pause.pid"):
            try:
                pid = int(pid_file.read_text())
                with open(f"/proc/{pid}/status") as f:
                    uid = next(int(ln.split()[2]) for ln in f if ln.startswith("Uid:"))
                if uid == self.uid:
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, StopIteration):
                pass


def dev_script(devs: Path | str, mnt: Path | str, node_mode: str | None) -> str:
    """Shell that gives the namespace a /dev of its own holding the host's entries (directories
    such as pts and shm bound, not copied) and copies of `devs`'s nvidia nodes: a rootless
    runtime binds each of a spec's nodes from the host's /dev at the node's container path,
    and the machine's own /dev is not written. Paths as the namespace sees them (a test node's
    too: tests/node/test_engine_podman_rootless.py); `mnt` is made there."""
    q = shlex.quote
    lines = [f"mkdir -p {q(str(mnt))}", f"mount -t tmpfs -o mode=0755 tmpfs {q(str(mnt))}",
             "for e in /dev/* /dev/.[!.]*; do { [ -e \"$e\" ] || [ -L \"$e\" ]; } || continue; n=${e#/dev/}; "
             f"if [ -d \"$e\" ] && [ ! -L \"$e\" ]; then mkdir {q(str(mnt))}/\"$n\" && "
             f"mount --rbind \"$e\" {q(str(mnt))}/\"$n\" || exit 1; "
             f"else cp -a \"$e\" {q(str(mnt))}/ || exit 1; fi; done",
             f"cp -a {q(str(devs))}/nvidia* {q(str(mnt))}/"]
    if node_mode:
        mode, group = node_mode.split(":")
        lines.append(f"chmod {mode} {q(str(mnt))}/nvidia[0-9]* {q(str(mnt))}/nvidiactl {q(str(mnt))}/nvidia-uvm* && "
                     f"chgrp {group} {q(str(mnt))}/nvidia[0-9]* {q(str(mnt))}/nvidiactl {q(str(mnt))}/nvidia-uvm*")
    lines.append(f"mount --move {q(str(mnt))} /dev")
    return " && ".join(lines)


def install_hook(user: User) -> Path:
    """nvhook for other users: this checkout's package (and pyelftools) under the user's
    directory, root's and readable by all, run by the distribution's python3."""
    import elftools

    d = user.dir / "nvhook"
    lib = d / "lib"
    shutil.copytree(REPO / "nvhook", lib / "nvhook", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(elftools.__file__).parent, lib / "elftools", ignore=shutil.ignore_patterns("__pycache__"))
    launcher = d / "bin" / "nvhook"
    launcher.parent.mkdir()
    launcher.write_text(f"#!{PY} -IS\nimport sys\nsys.path.insert(0, {str(lib)!r})\n"
                        "from nvhook.entry import main\nsys.exit(main())\n")
    # compiled now, as a package install is: the user cannot write __pycache__ there
    subprocess.run([PY, "-m", "compileall", "-q", str(lib)], check=True, capture_output=True, timeout=300)
    subprocess.run(["chmod", "-R", "a+rX", str(d)], check=True)
    launcher.chmod(0o755)
    return launcher


def node_log(user: User) -> tuple[Path, Path]:
    """(config, log file) as on a node: root's log in a root-only directory the user cannot
    write, root's cache dir and run dir (as /run/nvhook)."""
    d = user.dir / "node"
    for sub in ("log", "cache", "run"):
        (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / sub, 0o755 if sub == "log" else 0o700)
    log = d / "log" / "nvhook.jsonl"
    log.touch()
    log.chmod(0o640)
    config = rb.write_nvhook_config(d / "hook.toml", log_file=log, cache_dir=d / "cache")
    config.chmod(0o644)
    return config, log


def hooks_dir(user: User, hook: Path, config: Path, root: Path | None = None) -> Path:
    """The shipped oci-hooks.d/nvhook.json with its path, NVHOOK_CONFIG and NVHOOK_RUN_DIR
    pointed at this test's (and, with `root`, a config naming that host root)."""
    spec = json.loads(rb.SHIPPED_HOOK_JSON.read_text())
    spec["hook"]["path"] = str(hook)
    env = [e for e in spec["hook"].get("env", []) if not e.startswith("NVHOOK_CONFIG=")]
    spec["hook"]["env"] = env + [f"NVHOOK_CONFIG={config}", f"NVHOOK_RUN_DIR={user.dir / 'node' / 'run'}"]
    d = user.dir / "hooks.d"
    d.mkdir(exist_ok=True)
    (d / "nvhook.json").write_text(json.dumps(spec, indent=2))
    os.chmod(d, 0o755)
    (d / "nvhook.json").chmod(0o644)
    return d


class Podman:
    """Rootless podman (`runtime` runc or crun) for `user`, its state in the user's directory."""

    def __init__(self, user: User, runtime: str = "runc", hooks: Path | None = None):
        self.user = user
        self.runtime = runtime
        self.journal: Path | None = None  # a directory to put on /run/systemd/journal
        self.devs: Path | None = None  # a fixture host's dev/: its nvidia nodes on the namespace's /dev
        self.node_mode: str | None = None
        self.readonly: Path | None = None  # a directory read-only in the namespace (User.command)
        # Its own runtime dir, so its own pause process: rootless podman joins the user and mount
        # namespaces of the one it finds there, and each instance's namespace has its own binds.
        tag = uuid.uuid4().hex[:8]
        self.spec_dir = user.dir / f"cdi-{tag}"
        self.spec_dir.mkdir()
        os.chmod(self.spec_dir, 0o755)
        self.runtime_dir = user._own(user.dir / f"run-{tag}", 0o700)
        state = user.home / f"podman-{tag}"
        self.base = ["podman", "--root", str(state / "storage"), "--runroot", str(self.runtime_dir / "containers"),
                     "--tmpdir", str(self.runtime_dir / "libpod"), "--storage-driver", "vfs",
                     "--runtime", runtime, "--cgroup-manager", "cgroupfs", "--events-backend", "none"]
        if runtime == "crun":
            # crun refuses this machine's hybrid cgroups: cgroup2 in the namespace, its manager off
            self.base += ["--runtime-flag", "cgroup-manager=disabled"]
        if hooks is not None:
            self.base += ["--hooks-dir", str(hooks)]

    def _cmd(self, cmd: list[str], groups: tuple = ()) -> list[str]:
        binds: dict = {self.spec_dir: "/run/cdi"}
        if self.journal is not None:
            binds[self.journal] = "/run/systemd/journal"
        return self.user.command(cmd, binds=binds, cgroup2=self.runtime == "crun", groups=groups,
                                 devs=self.devs, node_mode=self.node_mode, readonly=self.readonly,
                                 env={"XDG_RUNTIME_DIR": str(self.runtime_dir)})

    def run(self, rootfs: Path, script: str, devices: tuple = (), env: dict | None = None,
            extra: tuple = (), groups: tuple = (), timeout: float = 120) -> subprocess.CompletedProcess:
        name = f"nvhook-rl-{uuid.uuid4().hex[:12]}"
        cmd = [*self.base, "run", "--rm", "--name", name, "--network", "none",
               "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
        for d in devices:
            cmd += ["--device", d]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += [*extra, "--rootfs", str(rootfs), "/bin/sh", "-c", script]
        try:
            return subprocess.run(self._cmd(cmd, groups), stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, errors="replace", timeout=timeout)
        finally:
            subprocess.run(self._cmd([*self.base, "rm", "--force", "--ignore", "--time", "0", name]),
                           capture_output=True, timeout=60)

    def close(self) -> None:
        self.user.kill_pause(self.runtime_dir)

    def leftovers(self) -> list[str]:
        proc = subprocess.run(self._cmd([*self.base, "ps", "--all", "--format", "{{.Names}}"]),
                              capture_output=True, text=True, timeout=60)
        return [n for n in proc.stdout.split() if n]


class Journal:
    """A stand-in for journald's native socket, in `directory` (bound on /run/systemd/journal in
    the user's namespace): each datagram kept, until `close()` sends the one that ends it."""

    def __init__(self, directory: Path):
        import socket
        import threading

        directory.mkdir(exist_ok=True)
        os.chmod(directory, 0o755)
        self.path = directory / "socket"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        os.chmod(self.path, 0o666)  # as journald's: open to every uid
        self.datagrams: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            d = self.sock.recv(1 << 20)
            if d == b"STOP":
                return
            self.datagrams.append(d)

    def close(self) -> None:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"STOP", str(self.path))
        self.thread.join(30)
        self.sock.close()

    def events(self) -> list[dict]:
        """nvhook's events in the datagrams, from their NVHOOK_JSON field."""
        return [json.loads(ln[len(b"NVHOOK_JSON="):]) for d in self.datagrams for ln in d.split(b"\n")
                if ln.startswith(b"NVHOOK_JSON=")]
