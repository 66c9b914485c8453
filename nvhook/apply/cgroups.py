"""Device cgroup access for the container, granted from the host side.

Which cgroup version governs the container is decided the way runc and crun decide it: by the
filesystem type of /sys/fs/cgroup as this process sees it (statfs: CGROUP2_SUPER_MAGIC means
the unified hierarchy, anything else the v1 controllers). The lines of /proc/<pid>/cgroup do not
tell: a hybrid host lists both a "0::" line and v1 lines, and a runtime in v2 mode on such a
host (a private mount namespace with cgroup2 on /sys/fs/cgroup) uses only the first.

cgroup v1: the devices controller's mount is found in the hook's own /proc/self/mountinfo (the
host's view, read before anything enters the container's namespaces), the container's cgroup in
/proc/<pid>/cgroup (`N:devices:/path`, relative to the mount's root), and each rule
`c MAJ:MIN rw` is written with its own write(2) to `<mount>/<path>/devices.allow` (the kernel
parses one rule per write).

cgroup v2: device access is a BPF_CGROUP_DEVICE program the runtime attached to the
container's cgroup from config.json `linux.resources.devices`. Every program attached there
(they are ANDed) is replaced by a copy that first allows exactly the planned devices and
otherwise runs the original instructions unchanged, so the runtime's rules (/dev/null allowed,
everything else it denies) still hold. The copy is built from the kernel's own dump of the
program (its xlated instructions): nvhook's prefix never writes r1, so the original starts with
the context pointer where it expects it, and its jumps are relative, so appending it needs no
relocation. The swap is one BPF_PROG_ATTACH with BPF_F_REPLACE: at no moment is the cgroup
without the original rules, and a hook killed before that call leaves the runtime's program in
place. With no program attached (a runtime whose default is "allow all") one that allows the
planned devices and then everything (the kernel's default) is attached, which changes nothing
but makes the grant visible. All of it is done before the hook returns, so before the
container's first instruction runs.

Either way one `cgroups.allowed` event lists the mode, the rules and (v2) the program ids
before and after. A plan with no devices_cgroup entries touches nothing here.

A hook in a user namespace (a rootless engine: rootless podman's runc or crun run their hooks
in the namespace podman made, base/userns.py) writes no rule: it can open no devices.allow
of the host's and load no device program, and the rootless runtime gave the container no
device cgroup of its own to narrow (the nodes' file modes decide what the container can open).
It logs one `cgroups.skipped` warning and carries on, as NVIDIA's toolkit does with
`no-cgroups = true`, without a setting: a rootful engine's hook (the host's root) is never in
one, so it still refuses a container whose devices it cannot allow.
"""

from __future__ import annotations

import os

from ..base import sandbox, userns
from ..base.errors import HookError

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from ..decide.types import CgroupModeName

CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP2_SUPER_MAGIC = 0x63677270
CGROUP_SUPER_MAGIC = 0x27E0EB

# What nvhook does about device access in each mode (`info`, `doctor`, the dry-run plan).
ACTIONS = {
    "v1": "writes one 'c MAJ:MIN rw' rule per planned device to the container's devices.allow "
          "(v1 devices controller)",
    "v2": "replaces the container cgroup's BPF device program with one that allows the planned devices "
          "first and then runs the runtime's own rules",
    "none": "grants nothing (no cgroup filesystem at /sys/fs/cgroup: the runtime's policy decides)",
}
ROOTLESS = ("this hook runs in a user namespace (a rootless engine, host uid {uid}), which can write no "
            "device cgroup: none written; the rootless runtime gave the container no device cgroup, so "
            "the device nodes' modes decide what it can open (docs/podman-crio-cdi.md, 'Rootless')")


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_mounts(mountinfo: str) -> tuple[tuple[str, str] | None, str | None]:
    """((root, mount point) of the v1 devices controller or None, a cgroup2 mount point or None)."""
    devices = None
    unified = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        post_f = post.split(" ")
        if len(post_f) < 3:
            continue
        fstype = post_f[0]
        if fstype == "cgroup":
            if "devices" in post_f[2].split(","):
                f = pre.split(" ")
                devices = (unescape(f[3]), unescape(f[4]))
        elif fstype == "cgroup2" and unified is None:
            unified = unescape(pre.split(" ")[4])
    return devices, unified


def container_cgroup(pid: int, pidfd: int | None = None) -> tuple[str | None, str | None]:
    """(v1 devices cgroup path, v2 path) of process `pid`, from /proc/<pid>/cgroup; with the
    process's `pidfd` (nvhookd), only while that process lives: once it has exited, the pid and
    so the cgroup read may be another process's, whose container would get the devices."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except FileNotFoundError:
        raise HookError(f"container process {pid} is gone") from None
    if pidfd is not None and _exited(pidfd):
        raise HookError(f"container process {pid} exited before its device access could be granted")
    v1 = v2 = None
    for line in text.splitlines():
        num, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if num == "0" and controllers == "":
            v2 = path
        elif "devices" in controllers.split(","):
            v1 = path
    return v1, v2



def _exited(pidfd: int) -> bool:
    from ..base import process  # only nvhookd passes a pidfd: not imported by the hook

    return process.exited(pidfd)

def rule_text(rule: dict) -> str:
    kind = rule.get("type", "c")
    access = rule.get("access", "rw")
    major, minor = rule.get("major"), rule.get("minor")
    if kind not in ("c", "b", "a") or not access or set(access) - set("rwm") or major is None or minor is None:
        raise HookError(f"invalid device cgroup rule in the plan: {rule}")
    return f"{kind} {major}:{minor} {access}"




def cgroup_mode(cgroup_root: str = CGROUP_ROOT) -> CgroupModeName:
    """"v2" (unified), "v1" (legacy or hybrid: the runtime uses the v1 controllers) or "none",
    from the filesystem type of `cgroup_root` as this process sees it (what runc and crun test)."""
    try:
        fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return "none"
    try:
        magic = sandbox.fstatfs_type(fd)
    finally:
        os.close(fd)
    if magic == CGROUP2_SUPER_MAGIC:
        return "v2"
    return "v1"


def cgroup2_mount_root(mountinfo: str, mount_point: str) -> str | None:
    """The root (within the hierarchy) of the topmost cgroup2 mount at `mount_point`: a hook in a
    cgroup namespace sees the hierarchy from below its top."""
    root = None
    for line in mountinfo.splitlines():
        pre, sep, post = line.partition(" - ")
        f = pre.split(" ")
        if not sep or len(f) < 5 or unescape(f[4]) != mount_point:
            continue
        # A later line at the same point is mounted over the earlier ones.
        root = unescape(f[3]) if post.split(" ")[0] == "cgroup2" else None
    return root


def apply_devices(rules: list, pid: int, log, mountinfo_path: str = "/proc/self/mountinfo",
                  cgroup_root: str = CGROUP_ROOT, pidfd: int | None = None) -> int:
    """Allow `rules` for the container's cgroup; returns how many were granted."""
    if not rules:
        return 0
    texts = [rule_text(r) for r in rules]
    if userns.namespaced():
        log.warning("cgroups.skipped", rules=texts, reason=ROOTLESS.format(uid=userns.outside_uid()))
        return 0
    mode = cgroup_mode(cgroup_root)
    with open(mountinfo_path) as f:
        mountinfo = f.read()
    if mode == "v2":
        return _apply_v2(rules, texts, pid, log, mountinfo, cgroup_root, pidfd)
    devices, _ = find_mounts(mountinfo)
    v1_path, _ = container_cgroup(pid, pidfd)
    if devices is None or v1_path is None:
        log.warning("cgroups.not_found", mode=mode, rules=texts,
                    reason="no devices cgroup controller found for the container; "
                           "nvhook wrote no device rules")
        return 0
    mount_root, mount_point = devices
    rel = v1_path
    if mount_root != "/" and (rel == mount_root or rel.startswith(mount_root + "/")):
        rel = rel[len(mount_root):]
    directory = (mount_point.rstrip("/") + "/" + rel.strip("/")).rstrip("/") or "/"
    allow = directory.rstrip("/") + "/devices.allow"
    try:
        fd = os.open(allow, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open {allow} to allow the GPU devices: {e.strerror}") from None
    done = 0
    try:
        for text in texts:
            os.write(fd, text.encode())
            done += 1
    except OSError as e:
        raise HookError(f"cannot allow '{texts[done]}' in {allow}: {e.strerror} "
                        f"({done} of {len(texts)} rules written)") from None
    finally:
        os.close(fd)
        # One event for all rules: a MIG container has over a hundred, and a line each made
        # the log's biggest part. A failure still says which rules made it in.
        if done:
            log.info("cgroups.allowed", mode="v1", rules=texts[:done], cgroup=directory)
    return done


# -- cgroup v2 --------------------------------------------------------------------------------

_MAX_DEV = (1 << 20) - 1  # a minor has 20 bits, a major 12: anything above is not a device number


def _number(value, rule: dict):
    if value == "*":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_DEV:
        raise HookError(f"invalid device cgroup rule in the plan: {rule}")
    return value


def device_filter(rules: list, fall_through: bytes | None) -> bytes:
    """A BPF_PROG_TYPE_CGROUP_DEVICE program: allow each of `rules`, then run `fall_through`
    (another program's instructions, unchanged), or allow everything when it is None.

    Registers: r2 = device type, r3 = requested access, r4 = major, r5 = minor, r0 scratch
    (the context's access_type is `access << 16 | type`).
    r1 (the context) is never written, so the fall-through code finds it as at its own entry;
    whatever it reads from r2-r5 it must have written first (the verifier refused it otherwise),
    so the values left there do not matter to it."""
    from ..base import bpf

    code = [bpf.ldx_w(2, 1, bpf.CTX_ACCESS_TYPE), bpf.mov32_reg(3, 2), bpf.rsh32_imm(3, 16),
            bpf.and32_imm(2, 0xFFFF), bpf.ldx_w(4, 1, bpf.CTX_MAJOR), bpf.ldx_w(5, 1, bpf.CTX_MINOR)]
    for rule in rules:
        kind, access = rule.get("type", "c"), rule.get("access", "rw")
        major, minor = _number(rule.get("major"), rule), _number(rule.get("minor"), rule)
        mask = (("r" in access and bpf.BPF_DEVCG_ACC_READ) | ("w" in access and bpf.BPF_DEVCG_ACC_WRITE)
                | ("m" in access and bpf.BPF_DEVCG_ACC_MKNOD))
        checks = []  # (register, value): each a jump to the next rule when it differs
        if kind != "a":
            checks.append((2, bpf.BPF_DEVCG_DEV_CHAR if kind == "c" else bpf.BPF_DEVCG_DEV_BLOCK))
        if major is not None:
            checks.append((4, major))
        if minor is not None:
            checks.append((5, minor))
        # block: the checks, r0 = access & ~mask, if r0 != 0 skip, r0 = 1, exit
        size = len(checks) + 5
        block = [bpf.jne_imm(reg, value, size - i - 1) for i, (reg, value) in enumerate(checks)]
        n = len(block)
        block += [bpf.mov32_reg(0, 3), bpf.and32_imm(0, 0xFFFF & ~mask), bpf.jne_imm(0, 0, size - n - 3),
                  bpf.mov64_imm(0, 1), bpf.exit_insn()]
        code += block
    if fall_through is None:
        code += [bpf.mov64_imm(0, 1), bpf.exit_insn()]
    else:
        code.append(fall_through)
    return b"".join(code)


def _open_cgroup2(cgroup_root: str, rel: str) -> int:
    """An fd of the container's cgroup directory, `rel` resolved beneath the cgroup2 mount
    without following links or leaving the mount."""
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise HookError(f"unexpected cgroup path {rel!r} for the container")
    root_fd = os.open(cgroup_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if not parts:
            return os.dup(root_fd)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = sandbox.openat2(root_fd, "/".join(parts), flags, 0,
                                 sandbox.RESOLVE_BENEATH | sandbox.RESOLVE_NO_SYMLINKS
                                 | sandbox.RESOLVE_NO_XDEV | sandbox.RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno != 38:  # ENOSYS: before 5.6; the path came from the kernel's own procfs
                raise
            fd = os.open("/".join(parts), flags | os.O_NOFOLLOW, dir_fd=root_fd)
    finally:
        os.close(root_fd)
    if sandbox.fstatfs_type(fd) != CGROUP2_SUPER_MAGIC:
        os.close(fd)
        raise HookError(f"{cgroup_root}/{rel.strip('/')} is not a cgroup2 directory")
    return fd


def _load(code: bytes) -> int:
    from ..base import bpf

    def load(log_size: int = 0) -> int:
        return bpf.bpf_prog_load(bpf.BPF_PROG_TYPE_CGROUP_DEVICE, code, "GPL", name="nvhook_devices",
                                 expected_attach_type=bpf.BPF_CGROUP_DEVICE, log_size=log_size)

    try:
        return load()  # without the verifier's log: writing it triples the load time
    except OSError as e:
        if e.errno != 1:
            return load(1 << 16)  # refused: again, for the verifier's reason in the message
    # Kernels before 5.11 charge BPF programs to RLIMIT_MEMLOCK (64 KiB by default); EPERM there
    # means the limit, not a missing privilege. Raise it and try once more.
    import resource

    resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return load(1 << 16)


def _apply_v2(rules: list, texts: list[str], pid: int, log, mountinfo: str, cgroup_root: str,
              pidfd: int | None = None) -> int:
    from ..base import bpf

    _, v2_path = container_cgroup(pid, pidfd)
    if v2_path is None:
        raise HookError(f"container process {pid} has no cgroup v2 path in /proc/{pid}/cgroup")
    root = cgroup2_mount_root(mountinfo, cgroup_root) or "/"
    rel = v2_path
    if root != "/":
        if not (rel == root or rel.startswith(root + "/")):
            raise HookError(f"the container's cgroup {v2_path} is outside the cgroup2 mount at {cgroup_root}")
        rel = rel[len(root):]
    directory = (cgroup_root.rstrip("/") + "/" + rel.strip("/")).rstrip("/")
    if not rel.strip("/"):
        # A program on the hierarchy's root would filter every process below it: the whole host.
        log.warning("cgroups.root_cgroup", mode="v2", rules=texts, cgroup=cgroup_root,
                    reason="the container runs in the root cgroup, which no device program restricts; "
                           "nvhook attaches nothing there")
        return 0
    where = f"cgroup {directory}"
    old_ids: list[int] = []
    new_ids: list[int] = []
    fds: list[int] = []
    try:
        cg = _open_cgroup2(cgroup_root, rel)
        fds.append(cg)
        flags, old_ids = bpf.bpf_prog_query(cg, what=where)
        if not old_ids:
            new = _load(device_filter(rules, None))
            fds.append(new)
            # ALLOW_MULTI as runc and crun attach: a runtime update later can still attach its own.
            bpf.bpf_prog_attach(cg, new, bpf.BPF_CGROUP_DEVICE, bpf.BPF_F_ALLOW_MULTI, what=where)
            new_ids.append(bpf.bpf_obj_get_info_by_fd(new)["id"])
        for old_id in old_ids:
            old = bpf.bpf_prog_get_fd_by_id(old_id)
            fds.append(old)
            info = bpf.bpf_obj_get_info_by_fd(old, what=f"program {old_id}")
            if info["type"] != bpf.BPF_PROG_TYPE_CGROUP_DEVICE or info["nr_map_ids"] or not info["xlated"] \
                    or info["xlated_len"] % bpf.INSN_SIZE:
                raise HookError(f"cannot extend device program {old_id} on {where}: it uses BPF maps or its "
                                f"instructions cannot be read (list the GPU devices in config.json "
                                f"linux.resources.devices instead)")
            new = _load(device_filter(rules, info["xlated"]))
            fds.append(new)
            _swap(cg, old, new, flags, where)
            new_ids.append(bpf.bpf_obj_get_info_by_fd(new)["id"])
    except OSError as e:
        raise HookError(f"cannot allow the GPU devices in {where}: {e.strerror}") from None
    finally:
        for fd in fds:
            os.close(fd)
    log.info("cgroups.allowed", mode="v2", rules=texts, cgroup=directory, programs_old=old_ids,
             programs_new=new_ids)
    return len(texts)


def _swap(cg: int, old: int, new: int, flags: int, where: str) -> None:
    """Put program `new` in the place of `old` on the cgroup, atomically where the kernel can."""
    from ..base import bpf

    if not flags & bpf.BPF_F_ALLOW_MULTI:
        # One program per cgroup (flags NONE or OVERRIDE): attaching with the same flags
        # replaces it in one step.
        bpf.bpf_prog_attach(cg, new, bpf.BPF_CGROUP_DEVICE, flags, what=where)
        return
    try:
        bpf.bpf_prog_attach(cg, new, bpf.BPF_CGROUP_DEVICE, bpf.BPF_F_ALLOW_MULTI | bpf.BPF_F_REPLACE, old,
                            what=where)
        return
    except OSError as e:
        if e.errno != 22:  # EINVAL: a kernel before 5.6 without BPF_F_REPLACE
            raise
    # Both attached for a moment: programs are ANDed, so that moment grants nothing new.
    bpf.bpf_prog_attach(cg, new, bpf.BPF_CGROUP_DEVICE, bpf.BPF_F_ALLOW_MULTI, what=where)
    bpf.bpf_prog_detach(cg, old, bpf.BPF_CGROUP_DEVICE, what=where)
