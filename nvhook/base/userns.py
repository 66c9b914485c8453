"""Whether this process's root is the host's: a rootless engine (rootless podman, its runc or
crun) runs its OCI hooks inside the user namespace it made, where uid 0 is the user who ran it
and everything of the host's root shows as the overflow uid (65534). Such a hook can mount in
the container's mount namespace (the engine made it in the same user namespace) and bind the
host's device nodes there, but it can write no device cgroup, no root-owned log file and no
root-owned cache: the callers skip or redirect those (docs/podman-crio-cdi.md, "Rootless").

The answer is read from /proc/self/uid_map: the host's (initial) namespace maps all 2^32 - 1
ids onto themselves, "0 0 4294967295"; any other map is a user namespace.

Where such a hook's record and cache go instead: `log_target` (the journal, else the user's
~/.local/state/nvhook/hook.log, opened as the user under keep-id: `engine_user`, `As`) and
`cache_dir` (~/.cache/nvhook); `overflow_uid` is what config.cache_problem accepts above it.
"""

import os  # no `from __future__`: every hook start imports this, a no-GPU one nothing more (tests/test_e2e_runc.py)

_FULL = [b"0", b"0", b"4294967295"]


def _map() -> list[list[bytes]]:
    try:
        with open("/proc/self/uid_map", "rb") as f:
            return [ln.split() for ln in f.read().splitlines() if ln.strip()]
    except OSError:  # no /proc: nothing says we are not the host's root
        return [_FULL]


def namespaced() -> bool:
    """True in any user namespace but the host's."""
    lines = _map()
    return not (len(lines) == 1 and lines[0] == _FULL)


def outside_uid(uid: "int | None" = None) -> "int | None":
    """The uid that `uid` (default: this process's effective uid) is in the parent namespace
    (the host's, for a rootless engine's namespace): the user who ran the engine, for its root.
    None where the map has no line for it."""
    uid = os.geteuid() if uid is None else uid
    for line in _map():
        try:
            inside, outside, count = (int(x) for x in line[:3])
        except ValueError:
            continue
        if inside <= uid < inside + count:
            return outside + (uid - inside)
    return None


def log_target(path: "str | None") -> "tuple[str | None, bool, tuple[int, int] | None]":
    """(log file, journal, the (uid, gid) to open the file as or None) for a hook in a user
    namespace that cannot append to the configured log file `path` (root's, on a node): the
    node's journal where its socket is there (open to every uid; journalctl shows the events
    with SYSLOG_IDENTIFIER=nvhook), otherwise a log of the user's own,
    $XDG_STATE_HOME/nvhook/hook.log (~/.local/state/nvhook/hook.log), where the engine's user
    can read it: as this process where the home is its own (a rootless engine's namespace), as
    the user where this is a container's root mapped elsewhere and the user is mapped too
    (podman's --userns=keep-id). Unchanged where the file can be written or no user is known
    (its failure is then the stderr line it always was)."""
    from .log import JOURNAL_SOCKET

    if not path or os.access(path, os.W_OK):
        return path, False, None
    if os.access(JOURNAL_SOCKET, os.W_OK):
        return None, True, None
    owner = None
    state = _user_dir("XDG_STATE_HOME", ".local/state")
    if state is None:
        owner = engine_user()
        if owner is not None:
            state = _user_dir("XDG_STATE_HOME", ".local/state", owner[0])
    if state is None:
        return path, False, None
    try:
        with As(owner):
            os.makedirs(state + "/nvhook", 0o700, exist_ok=True)
    except OSError:
        return path, False, None
    return state + "/nvhook/hook.log", False, owner


def engine_user() -> "tuple[int, int] | None":
    """(uid, gid) in this namespace of the parent namespace's root, where that is not this
    process: under podman's --userns=keep-id a CDI hook is the container's root and the
    rootless user (podman's namespace root) is mapped at their own uid. None elsewhere."""
    ids = []
    for which in ("uid", "gid"):
        try:
            with open(f"/proc/self/{which}_map", "rb") as f:
                lines = [ln.split() for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return None
        found = None
        for line in lines:
            try:
                inside, outside, count = (int(x) for x in line[:3])
            except ValueError:
                continue
            if outside <= 0 < outside + count:
                found = inside - outside
        if found is None:
            return None
        ids.append(found)
    if ids[0] == os.geteuid() or [ids[0], ids[1]] == [0, 0]:
        return None
    return ids[0], ids[1]


class As:
    """Effective ids `owner` (uid, gid) for the block, or nothing where None: the files a
    keep-id CDI hook makes in the user's home are the user's."""

    def __init__(self, owner: "tuple[int, int] | None"):
        self.owner = owner

    def __enter__(self) -> None:
        if self.owner is not None:
            self.saved = (os.geteuid(), os.getegid())
            os.setegid(self.owner[1])
            try:
                os.seteuid(self.owner[0])
            except OSError:
                os.setegid(self.saved[1])
                raise

    def __exit__(self, *exc: object) -> None:
        if self.owner is not None:
            os.seteuid(self.saved[0])  # first: setegid needs the privilege back
            os.setegid(self.saved[1])


def cache_dir(configured: str) -> str:
    """The inventory cache of a hook in a user namespace: $XDG_CACHE_HOME/nvhook
    (~/.cache/nvhook) of the engine's user, whose own containers are all it serves. ""
    where caches are off (`configured` is ""); `configured` where the user has no home (the
    start then says why it cannot use that one)."""
    if not configured:
        return ""
    base = _user_dir("XDG_CACHE_HOME", ".cache")
    return base + "/nvhook" if base else configured


def _user_dir(variable: str, default: str, inside: "int | None" = None) -> "str | None":
    """$`variable` (a hook's environment is its hooks file's: rarely set), else ~/`default` of
    the host user this namespace's root is (or of uid `inside` of this namespace, whose home
    must then be its own); None without a home."""
    value = os.environ.get(variable)
    if value and value.startswith("/"):
        return value
    uid = outside_uid() if inside is None else inside
    me = os.geteuid() if inside is None else inside
    try:
        import pwd

        home = pwd.getpwuid(uid).pw_dir if uid is not None else ""
    except (KeyError, OSError):
        home = ""
    if not home.startswith("/") or home == "/":
        return None
    try:
        # the home must be this process's own in the namespace: under --userns=keep-id a CDI
        # hook runs as the container's root, a subordinate uid whose map names another user
        if os.stat(home).st_uid != me:
            return None
    except OSError:
        return None
    return home.rstrip("/") + "/" + default


def overflow_uid() -> "int | None":
    """The uid a user namespace shows for every owner it does not map (the host root's files
    above a rootless user's home); None outside one."""
    if not namespaced():
        return None
    try:
        with open("/proc/sys/kernel/overflowuid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534
