"""The group of nvidia-cdi-hook's set-group-ID stages, on every install path (the .deb's
postinst, `nvhook setup`, `nvhook node install`): docs/security.md, "The hook's group".

Executing the stages (copies of /bin/sh and python3, mode 2711) changes the effective gid, which
is what makes the kernel set AT_SECURE, so that the loader drops a container's LD_PRELOAD. They
are general programs, executable by everyone (a user-namespaced container's root is an
unprivileged host uid): any local user gets HOOK_GROUP as effective gid from them (`sh -p`) and
can make files set-group-ID to it anywhere they write. So that gid is worth exactly what "others"
is worth, always:
- it is never given to a group that owns a file, has a member or is someone's primary group
  (install refuses, in one line, to use an HOOK_GROUP that does, and makes a new one with a
  system gid that no file carries and no source of the host's name service knows: `known`);
- it is never freed: no install path deletes the group (another `groupadd` would give the gid,
  with every file made set-group-ID to it meanwhile, to a group that owns something). MARK
  records it as nvhook's, so that the next install uses it without looking again (files of
  that gid are then nvhook's copies, or ones users made through them: worth nothing).
"""

from __future__ import annotations

import grp
import os
import posixpath
import stat

from ..base.errors import HookError

HOOK_GROUP = "nvhook-hook"
# Where no group can be made (no groupadd on the node): the copies are root's only (mode 2710),
# and the overflow gid is as good as any other for the gid change, since no one else executes them.
FALLBACK_GID = 65534
MARK = "/var/lib/nvhook/hook-group"
# The stages of every install path: the files of HOOK_GROUP that are nvhook's own.
STAGE_DIRS = ("/usr/lib/nvhook/libexec", "/opt/nvhook/libexec", "/usr/local/lib/nvhook/libexec")
STAGE_COPIES = frozenset(f"{d}/{n}{s}" for d in STAGE_DIRS for n in ("sh", "python3") for s in ("", ".nvhook-new"))
# Not looked at for files of a gid: kernel and network filesystems (the first carry no one's files,
# the second can be the size of an organisation; their files are the server's business), and the
# engines' and kubelet's state, where image layers and pod volumes carry the images' own gids behind
# root-only directories (a local user reaches none of them, whatever their groups).
KERNEL_FS = frozenset(("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore", "bpf",
                       "configfs", "fusectl", "binfmt_misc", "autofs", "nsfs", "efivarfs", "rpc_pipefs", "nfsd",
                       "selinuxfs"))
NETWORK_FS = frozenset(("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p", "afs", "lustre", "gpfs"))
ENGINE_STATE = ("/proc", "/sys", "/var/lib/containerd", "/var/lib/docker", "/var/lib/containers",
                "/var/lib/kubelet", "/run/containerd", "/run/containers", "/run/docker")


def colon_file(host, path: str) -> list[list[str]]:
    got = host.read(path)
    if got is None:
        return []
    return [ln.split(":") for ln in got[0].decode("utf-8", "replace").splitlines() if ln and not ln.startswith("#")]


def group_state(host) -> tuple[int | None, str]:
    """HOOK_GROUP in the host's files: (gid, "") when nobody is in it (no members, no gshadow
    members or administrators, nobody's primary group, not gid 0), (gid, why not) when someone
    is, (None, "") when there is none."""
    for f in colon_file(host, "/etc/group"):
        if f[0] != HOOK_GROUP:
            continue
        if len(f) < 4 or not f[2].isdigit():
            return None, f"its /etc/group line is malformed: {':'.join(f)!r}"
        gid = int(f[2])
        if gid == 0:
            return gid, "it is gid 0"
        if f[3].strip():
            return gid, f"it has members ({f[3].strip()})"
        # another name for the same gid (groupadd -o): its members and files are that gid's too
        others = [g[0] for g in colon_file(host, "/etc/group") if len(g) > 2 and g[2] == f[2] and g[0] != HOOK_GROUP]
        if others:
            return gid, f"its gid {gid} is also the group {','.join(others)}'s"
        for g in colon_file(host, "/etc/gshadow"):
            if g[0] == HOOK_GROUP and len(g) >= 4 and (g[2].strip() or g[3].strip()):
                return gid, f"it has members or administrators in /etc/gshadow ({g[2].strip()}:{g[3].strip()})"
        users = [u[0] for u in colon_file(host, "/etc/passwd") if len(u) > 3 and u[3] == str(gid)]
        if users:
            return gid, f"it is the primary group of {','.join(users)}"
        return gid, ""
    return None, ""


def known(host, run, key: str) -> str | None:
    """The group line that the host's name service gives for `key` (a gid or a name), or None.
    A direct lookup asks every source that nsswitch.conf names, also those that cannot list
    their groups (LDAP, sssd with enumerate = false), which /etc/group and enumerating miss.
    On the machine nvhook runs on, this process asks; under a host root, its own NSS is not the
    node's, so the node's getent is run there (`run`: chrooted, as its groupadd is), with the
    node's nsswitch.conf and modules. None too where that getent cannot be run: then the node's
    groupadd, which asks its name service itself, is what refuses a gid or name it knows."""
    if host.root in ("", "/"):
        try:
            g = grp.getgrgid(int(key)) if key.isdigit() else grp.getgrnam(key)
        except (KeyError, OverflowError):
            return None
        return f"{g.gr_name}:{g.gr_passwd}:{g.gr_gid}:{','.join(g.gr_mem)}"
    try:
        r = run(host, ["getent", "group", key])
    except HookError:
        return None
    line = (r.stdout or "").splitlines()[:1] if r.returncode == 0 else []
    return line[0] if line else None


def _fs_types() -> dict[int, str]:
    """st_dev -> filesystem type of every mount this process sees."""
    out: dict[int, str] = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 3 or ":" not in fields[2]:
                    continue
                major, minor = fields[2].split(":")
                out[os.makedev(int(major), int(minor))] = line.split(" - ", 1)[1].split()[0]
    except (OSError, ValueError):
        pass
    return out


def file_gids(root: str, want: int | None = None) -> tuple[set[int], str | None]:
    """Every gid that a file under `root` carries (not followed through links, not into the
    filesystems and directories left out above), and the first file carrying `want` that is not
    one of nvhook's stages (its path inside `root`), if any."""
    types = _fs_types()
    skip = {rootjoin(root, p) for p in ENGINE_STATE}
    gids: set[int] = set()
    found: str | None = None
    stack = [rootjoin(root, "/")]
    while stack:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            gids.add(st.st_gid)
            inside = "/" + os.path.relpath(e.path, root) if root != "/" else e.path
            if want is not None and st.st_gid == want and found is None and inside not in STAGE_COPIES:
                found = inside
            if stat.S_ISDIR(st.st_mode) and e.path not in skip:
                fs = types.get(st.st_dev, "")
                if fs not in KERNEL_FS and fs not in NETWORK_FS and not fs.startswith("fuse."):
                    stack.append(e.path)
    return gids, found


def rootjoin(root: str, path: str) -> str:
    return "/" + path.lstrip("/") if root in ("", "/") else root.rstrip("/") + "/" + path.lstrip("/")


def _sys_gid_range(host) -> tuple[int, int]:
    """SYS_GID_MIN..SYS_GID_MAX of the host's login.defs (shadow-utils' defaults 100..999)."""
    lo, hi = 100, 999
    got = host.read("/etc/login.defs")
    for line in (got[0].decode("utf-8", "replace") if got else "").splitlines():
        f = line.split()
        if len(f) >= 2 and f[1].isdigit():
            if f[0] == "SYS_GID_MIN":
                lo = int(f[1])
            elif f[0] == "SYS_GID_MAX":
                hi = int(f[1])
    return lo, hi


def marked(host, gid: int) -> bool:
    """Whether MARK names `gid`: only a mark that root alone could have written (it lets install
    skip looking for the gid's files), so a mark a user put in a directory of theirs is none."""
    where = host.where(MARK)
    try:
        for p in (where, os.path.dirname(where)) if where else ():
            st = os.lstat(p)
            if st.st_uid != 0 or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
                return False
    except OSError:
        return False
    got = host.read(MARK)
    return got is not None and got[0].split(b"\n", 1)[0] == f"{HOOK_GROUP} {gid}".encode()


def mark(host, gid: int) -> None:
    if not marked(host, gid):
        host.write(MARK, f"{HOOK_GROUP} {gid}\n# The group of nvidia-cdi-hook's set-group-ID stages. Everyone can "
                   "have its gid (docs/security.md):\n# nvhook never deletes it, so that no other group is ever "
                   "given that gid. Keep it.\n".encode())


def ensure(host, run) -> tuple[int, str]:
    """The stages' group on the host: (gid, "") for HOOK_GROUP, made with the host's own
    groupadd (`run(host, argv)`: run as the host) where there is none; (FALLBACK_GID, why) where
    none can be made. Refuses (HookError, one line, before it changes anything) an HOOK_GROUP
    that someone is in, or whose gid a file carries that is not nvhook's."""
    gid, why = group_state(host)
    fix = f"give that group another name (groupmod -n NAME {HOOK_GROUP}), then install again"
    if why:
        raise HookError(f"the group {HOOK_GROUP} cannot be nvidia-cdi-hook's: {why}; its set-group-ID stages "
                        f"hand their group to every local user (docs/security.md): {fix}")
    if gid is not None:
        if not marked(host, gid):
            first = known(host, run, str(gid))  # a source before files (sss first) with that gid
            if first and first.split(":", 1)[0] != HOOK_GROUP:
                raise HookError(f"the group {HOOK_GROUP} cannot be nvidia-cdi-hook's: its gid {gid} is also the "
                                f"group {first.split(':', 1)[0]}'s in the host's name service; its set-group-ID "
                                f"stages hand their group to every local user (docs/security.md): {fix}")
            found = file_gids(host.root, gid)[1]
            if found:
                raise HookError(f"the group {HOOK_GROUP} (gid {gid}) owns {found}: nvidia-cdi-hook's set-group-ID "
                                f"stages hand their group to every local user (docs/security.md): {fix}")
            mark(host, gid)
        return gid, ""
    elsewhere = known(host, run, HOOK_GROUP)
    if elsewhere:
        raise HookError(f"the group {HOOK_GROUP} is not in /etc/group but the host's name service knows it "
                        f"({elsewhere}; LDAP, sssd or another source of nsswitch.conf): nvidia-cdi-hook's "
                        "set-group-ID stages would hand its gid, and what its members and files have, to every "
                        "local user (docs/security.md): rename or remove it there, then install again")
    lo, hi = _sys_gid_range(host)
    taken = file_gids(host.root)[0] | {int(f[2]) for f in colon_file(host, "/etc/group") if len(f) > 2
                                       and f[2].isdigit()}
    # known() last and lazily: one lookup per gid tried, usually one in all
    free = next((g for g in range(hi, lo - 1, -1) if g not in taken and known(host, run, str(g)) is None), None)
    if free is None:
        return FALLBACK_GID, f"no system gid ({lo}-{hi}) is free of groups and files"
    r = run(host, ["groupadd", "--system", "--gid", str(free), HOOK_GROUP])
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
        return FALLBACK_GID, f"groupadd --system {HOOK_GROUP} failed (exit {r.returncode}): {tail}"
    gid, why = group_state(host)
    if gid != free or why:
        return FALLBACK_GID, f"groupadd --system --gid {free} {HOOK_GROUP} left no such group in /etc/group"
    mark(host, gid)
    return gid, ""


def kept_note(host) -> list[dict]:
    """What uninstall says about the group it leaves."""
    gid, _ = group_state(host)
    if gid is None:
        return []
    return [{"action": "kept", "what": f"group {HOOK_GROUP} (gid {gid}), on purpose: files anyone made set-group-ID "
             "to it may remain, and deleting it would let another group get its gid (docs/security.md)",
             "path": posixpath.join("/etc", "group")}]
