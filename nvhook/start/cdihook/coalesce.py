"""One process for a run of nvidia-cdi-hook entries (docs/cdi-hook.md, "One process for a run
of hooks").

A spec written by NVIDIA's tools gives a container three to five createContainer hook entries
with the same path (create-symlinks, enable-cuda-compat, update-ldcache, ...), which runc runs
one after the other. Behind the shell first stage (nvhook/data/nvidia-cdi-hook.sh) the first of
them does the work of the entries that follow it with the same path, in their order, in this one
Python process, and writes a marker that lets each of those entries' own runs exit in the shell,
without a Python start. What the container gets is what running them one by one gives it; a
step that fails is left to its own entry, which runs it again and fails as NVIDIA's would.

The marker: MARKS/<container id>.<ppid>, root's (the parent's pid in the name too: two
containers of one id, in two runtime roots, may start at once), one line `<ppid> <its start time>` (the process that
runs this container's hooks: runc's init, crun; another container or a reused pid has another
pair, checked by the shell against its own parent in /proc), then one line per entry done, in
order: the number of its arguments and the length in bytes of them joined by spaces (what the
shell computes from "$@" cheaply). The shell takes the first line off for its own entry when
it matches. Markers with no entry left, or whose process is gone, are removed here when a new
one is written (the shell has no builtin that removes a file).
"""

from __future__ import annotations

import os
import time

from .hookargs import Out, Unsupported, UsageError, parse

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .hookstate import Entry

# The characters the shell accepts in a marker's name (runc's own rule for ids, less "." first);
# no `re` here: it costs the start path ~3 ms of imports (enum, functools, collections).
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+-")
_TRUE = ("1", "t", "T", "true", "TRUE", "True")


class Step:
    """A later entry of the run: its arguments and how it was parsed, its own output switches."""

    def __init__(self, args: list[str], sub: str, opts: dict, out: Out, warning: str | None = None):
        self.args = args
        self.sub = sub
        self.opts = opts
        self.out = out
        self.warning = warning


def _switches(env: list) -> tuple[bool, bool]:
    vals = dict(e.split("=", 1) for e in env if isinstance(e, str) and "=" in e)
    debug = any(vals.get(k, "") in _TRUE for k in ("NVIDIA_CTK_DEBUG", "NVIDIA_CDI_DEBUG"))
    quiet = any(vals.get(k, "") in _TRUE for k in ("NVIDIA_CTK_QUIET", "NVIDIA_CDI_QUIET"))
    return debug, quiet


def shell_id(raw: bytes) -> str | None:
    """The container id as the shell first stage reads it from the state: after the first
    `"id":` and any spaces, a quote and up to the next one (runc's state begins with
    ociVersion and id)."""
    text = raw.decode("utf-8", "replace")
    _head, sep, rest = text.partition('"id":')
    rest = rest.lstrip(" ")
    if not sep or not rest.startswith('"'):
        return None
    return rest[1:].split('"', 1)[0]


def plan(spec: dict, hook_path: str, argv: list[str], config_path: str | None) -> list[Step] | None:
    """The entries after this one that this process does too, in order (possibly none), or None
    when this run is not to be coalesced: this entry is not exactly one of the bundle's
    createContainer entries, or has a timeout."""
    hooks = (spec.get("hooks") or {}).get("createContainer") if isinstance(spec.get("hooks"), dict) else None
    if not isinstance(hooks, list):
        return None
    mine = [i for i, h in enumerate(hooks) if _same(h, hook_path) and _args(h) == argv]
    if len(mine) != 1 or "timeout" in hooks[mine[0]]:
        return None
    process_env = (spec.get("process") or {}).get("env") or []
    steps: list[Step] = []
    for h in hooks[mine[0] + 1:]:
        if not _same(h, hook_path) or "timeout" in h:
            break
        args = _args(h)
        if args is None:
            break
        env = h.get("env") if isinstance(h.get("env"), list) else process_env
        debug, quiet = _switches(env)
        try:
            glob, sub, opts = parse(args)
        except Unsupported as u:
            text = f"Unsupported CDI hook: {u.args[0]}" if u.args[0] else "No CDI hook specified"
            steps.append(Step(args, "", {}, Out(debug, quiet), warning=text))
            continue
        except UsageError:
            break  # its own run gives the error and exit 1
        if glob.get("nvhook-config") != config_path or "container-spec" in opts:
            break
        if any(glob.get(k) for k in ("help", "h", "version", "v")) or opts.get("help") or opts.get("h"):
            break
        steps.append(Step(args, sub, opts, Out(bool(glob.get("debug") or glob.get("d") or debug) and not quiet,
                                               bool(glob.get("quiet") or quiet))))
    return steps


def _same(h: object, hook_path: str) -> bool:
    return isinstance(h, dict) and h.get("path") == hook_path


def _args(h: dict) -> list[str] | None:
    """The arguments after argv[0], as the shell's "$@" has them."""
    args = h.get("args") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return None
    return args[1:]


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            s = f.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    return s[s.rfind(") ") + 2:].split()


def parent_key() -> str | None:
    """`<ppid> <start time>` of this process's parent, in /proc's pid namespace, as the shell
    reads it."""
    me = _stat_fields("self")
    if not me or len(me) < 2:
        return None
    parent = _stat_fields(me[1])
    if not parent or len(parent) < 20:
        return None
    return f"{me[1]} {parent[19]}"


def user_namespaced() -> bool:
    """Whether this process's root is not the host's: a user namespace that maps uid 0 elsewhere
    (runc runs a user-namespaced container's createContainer entries there)."""
    try:
        with open("/proc/self/uid_map", "rb") as f:
            first = f.readline().split()
    except OSError:
        return False
    return first[:2] != [b"0", b"0"]


def marks_dir(path: str) -> int | None:
    """The marker directory, made if missing (root's, 0700), as an fd; None where it cannot be
    trusted (not a directory of root's that only root can write) or made."""
    if not path.startswith("/"):
        return None
    try:
        os.makedirs(path, 0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        return None
    return fd


def write_marker(dfd: int, cid: str, key: str, steps: list[list[str]], log) -> bool:
    """MARKS/<cid>.<ppid> for the entries done (after the one running), written under a temporary name
    and renamed; markers of processes that are gone removed."""
    _prune(dfd, log)
    name = f"{cid}.{key.split()[0]}"  # as the shell names it: the id and its parent pid
    tmp = f".{name}.{os.getpid()}"
    body = key + "\n" + "".join(f"{shape(a)}\n" for a in steps)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.write(fd, body.encode())
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        return True
    except OSError as e:
        log.warning("cdi_hook.marker_failed", error=e.strerror or str(e))
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return False


def shape(args: list[str]) -> str:
    """An entry's line in the marker: as the shell's `$# ${#a}` with a=$* (LC_ALL=C: bytes)."""
    return f"{len(args)} {len(' '.join(args).encode())}"


def _prune(dfd: int, log) -> None:
    try:
        names = os.listdir(dfd)
    except OSError:
        return
    alive: dict[str, str | None] = {}
    for name in names:
        try:
            with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd),
                      "rb") as f:
                lines = f.read(4096).decode("ascii", "replace").splitlines()
        except OSError:
            lines = []
        head = lines[0].split() if lines else []
        # every entry taken off: nothing will read it again (a new run of the same container
        # renames a new marker over it); the process is alive as long as its container runs
        if len(head) == 2 and any(lines[1:]):
            if head[0] not in alive:
                fields = _stat_fields(head[0]) if head[0].isdigit() else None
                alive[head[0]] = fields[19] if fields and len(fields) >= 20 else None
            if alive[head[0]] == head[1]:
                continue
        elif (name.startswith(".") or not lines) and len(names) < 64:
            # another hook's marker being written (renamed in a moment), or being rewritten by
            # a shell stage (truncated, then written through its open file: python never
            # writes an empty one); removed, that container's later entries did their work again
            continue
        try:
            os.unlink(name, dir_fd=dfd)
            log.debug("cdi_hook.marker_pruned", marker=name)
        except OSError:
            pass


def marker_name(state: dict, raw: bytes) -> str | None:
    """The marker's name: the container id, when the shell finds the same one in the state."""
    cid = state.get("id")
    if not isinstance(cid, str) or not cid or len(cid) > 200 or cid[0] == "." or not _ID_CHARS.issuperset(cid):
        return None
    return cid if shell_id(raw) == cid else None


def run_after(first: tuple[str, str], spec: dict, raw: bytes, argv: list[str], config_path: str | None,
              entry: Entry) -> None:
    """The entries after this one with the same hook path, done here in their order, and the
    marker that lets their own runs end in the shell first stage (this module's docstring).
    The first that fails is left to its own run (which does it again, and fails with NVIDIA's
    message and exit code there); so is everything after it."""
    from ...base.errors import HookError
    from .dispatch import step

    state, log = entry.state, entry.log
    marks, hook_path = first
    # createContainer entries run from the container's init, whose pid the state carries (runc:
    # as the container's pid namespace numbers it, which is this process's too; crun: 0). The
    # same entry named in prestart or createRuntime runs from the runtime itself: doing the
    # createContainer entries there would do them a phase early, in the runtime's namespaces.
    if state.get("pid") not in (0, os.getppid()):
        log.debug("cdi_hook.not_coalesced", reason="not run from the container's init (another phase's entry)")
        return
    steps = plan(spec, hook_path, argv, config_path)
    if not steps:
        return
    cid = marker_name(state, raw)
    key = parent_key()
    if cid is None or key is None:
        log.debug("cdi_hook.not_coalesced", reason="no container id or parent process the first stage can check")
        return
    dfd = marks_dir(marks)
    if dfd is None and user_namespaced():
        # the container's root is an unprivileged host uid: root's marker directory is not its
        # to write (nor to trust), so each entry runs itself, as NVIDIA's hook does
        log.debug("cdi_hook.not_coalesced", reason="in a user namespace whose root is not the host's: each entry "
                  "runs in its own process")
        return
    if dfd is None:
        log.warning("cdi_hook.not_coalesced", reason=f"{marks} is not a directory only root can write")
        return
    done: list[list[str]] = []
    try:
        for st in steps:
            t0 = time.perf_counter()
            log.bind(cdi_hook=st.sub or "unsupported")
            if st.warning is not None:
                st.out.say("warning", st.warning)
            else:
                try:
                    step(st.sub, st.opts, entry, st.out)
                except HookError as e:
                    log.info("cdi_hook.left_to_its_entry", error=e.message)
                    break
                except Exception as e:  # its own run reports it (a crash there too, if it is one)
                    log.info("cdi_hook.left_to_its_entry", error=f"{type(e).__name__}: {e}")
                    break
            done.append(st.args)
            log.info("cdi_hook.done", root=entry.rootfs, ms=round((time.perf_counter() - t0) * 1000, 2),
                     coalesced=True)
        if done:
            write_marker(dfd, cid, key, done, log)
    finally:
        os.close(dfd)
