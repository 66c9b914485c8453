"""What `nvhook runtime configure` changed, kept so that `nvhook runtime unconfigure` can put each
file back byte for byte: for every file it wrote, the bytes and mode before its first change (or
that there was no file) and the sha256 of what it wrote last. The same idea as `node install`'s
record (nodehost.Record), for files an operator configured by hand.

The record is one JSON file, /var/lib/nvhook/runtime-configure.json by default (`--record`,
or the directory NVHOOK_STATE_DIR). A
file `node install` recorded (its node-install.json beside this record) is not recorded here:
`node uninstall` puts it back, and two records of one file would each undo the other's state.

Restoring refuses a file that changed since configure wrote it (someone edited it, or another
tool did): it is left alone, with one line saying so, rather than losing that edit.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat

from ..base.errors import HookError, show

RECORD = "/var/lib/nvhook/runtime-configure.json"
NODE_RECORD_NAME = "node-install.json"  # nodehost.RECORD's name, beside ours


def default_record() -> str:
    """RECORD, or runtime-configure.json in NVHOOK_STATE_DIR (the docs' runnable blocks: a
    test never writes the machine's /var/lib)."""
    state = os.environ.get("NVHOOK_STATE_DIR")
    return os.path.join(state, "runtime-configure.json") if state else RECORD


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: str) -> tuple[bytes, int] | None:
    """(bytes, mode) of the regular file at `path`, None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise HookError(f"{show(path)} is not a regular file")
        return f.read(), stat.S_IMODE(st.st_mode)


def _check_owner(path: str) -> None:
    """The record says which bytes go back into the engines' configs: one that another user
    could have written (not ours, or group/world-writable) is refused, not followed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise HookError(f"cannot read {show(path)}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise HookError(f"{show(path)} is not a private record of this user (a regular file of uid "
                        f"{os.geteuid()}, writable by it alone); not used: remove it, or give another --record")


class ConfigureRecord:
    """The record file: {"version": 1, "files": {path: {"engine", "before", "mode", "sha256"}}}."""

    def __init__(self, path: str = RECORD):
        self.path = path
        _check_owner(path)
        got = read_bytes(path)
        try:
            self.data: dict = json.loads(got[0]) if got else {"version": 1, "files": {}}
            if not isinstance(self.data.get("files"), dict):
                raise ValueError("no files table")
        except ValueError as e:
            raise HookError(f"{show(path)} is not a record nvhook wrote ({e}); "
                            "move it away to start a new one") from None

    @property
    def files(self) -> dict:
        return self.data["files"]

    def node_install_owns(self, path: str) -> bool:
        """Whether `node install`'s record (beside this one) keeps `path`: then it is uninstall's."""
        got = read_bytes(os.path.join(os.path.dirname(self.path), NODE_RECORD_NAME))
        try:
            return got is not None and path in json.loads(got[0]).get("paths", {})
        except (ValueError, AttributeError):
            return False

    def before_write(self, path: str, engine: str, old: tuple[bytes, int] | None) -> None:
        """Keep what `path` was before configure first changed it. A file changed since
        configure last wrote it gets its current bytes as the new 'before': the operator's
        edit is the state to come back to, not what was there before it."""
        entry = self.files.get(path)
        if entry is not None:
            current = None if old is None else sha256_hex(old[0])
            if current == entry.get("sha256"):
                return
        self.files[path] = {"engine": engine, "before": None if old is None else base64.b64encode(old[0]).decode(),
                            "mode": None if old is None else old[1], "sha256": None}

    def after_write(self, path: str, data: bytes) -> None:
        self.files[path]["sha256"] = sha256_hex(data)

    def forget(self, path: str) -> None:
        self.files.pop(path, None)

    def save(self) -> None:
        from ..base.files import replace_file

        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise HookError(f"cannot write {show(self.path)}: {e.strerror}") from None
        try:
            if not self.files:
                try:
                    os.unlink(os.path.basename(self.path), dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                return
            data = (json.dumps(self.data, indent=1, sort_keys=True) + "\n").encode()
            replace_file(dir_fd, os.path.basename(self.path), data, 0o600, show(self.path))
        finally:
            os.close(dir_fd)


def _mine(path: str, engine: str, entry: dict, config: str) -> bool:
    """Whether the record's `path` belongs to `engine` configured at `config`: the file itself
    (or the one its links name), or nvhook's drop-in beside it."""
    if entry.get("engine") != engine:
        return False
    here = os.path.dirname(os.path.abspath(config))
    return path in (config, os.path.realpath(config)) or os.path.dirname(path) == os.path.join(here, "conf.d")


def _restore(path: str, entry: dict) -> str:
    """Put `path` back as the record has it; the line saying what was done."""
    from .enginefiles import Change, write

    if entry.get("before") is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return f"removed {show(path)} (there was none before `runtime configure`)"
    data = base64.b64decode(entry["before"])
    write(Change(path, None, data.decode("utf-8"), "put back"))
    if entry.get("mode") is not None:
        os.chmod(path, entry["mode"])
    return f"put back {show(path)} as it was before `runtime configure`"


def unconfigure(engine: str, config: str, record_path: str | None = None, out=None) -> int:
    """`nvhook runtime unconfigure`: every file `runtime configure` wrote for `engine` at `config`
    put back byte for byte from the record; one changed since is left alone (exit 1)."""
    import sys

    out = out or sys.stdout
    record_path = record_path or default_record()
    record = ConfigureRecord(record_path)
    mine = {p: e for p, e in record.files.items() if _mine(p, engine, e, config)}
    if not mine:
        owner = " (`node install` wrote it: `nvhook node uninstall` puts it back)" if record.node_install_owns(config) \
            else ""
        out.write(f"{engine}: nothing to put back: {show(record_path)} has no record of `runtime configure` for "
                  f"{show(config)}{owner}\n")
        return 1
    status = 0
    for path, entry in sorted(mine.items()):
        got = read_bytes(path)
        if (None if got is None else sha256_hex(got[0])) != entry.get("sha256"):
            out.write(f"{engine}: left alone: {show(path)} changed since `runtime configure` wrote it; "
                      "put it back by hand (or run `runtime configure` again and then unconfigure)\n")
            status = 1
            continue
        out.write(f"{engine}: {_restore(path, entry)}\n")
        record.forget(path)
    record.save()
    if status == 0:
        out.write(f"{engine}: restart the service to apply (nvhook restarts nothing): systemctl restart "
                  f"{'crio' if engine == 'crio' else engine}\n")
    return status
