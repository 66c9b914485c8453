"""Reading nvhook's config file: its bytes, only from a regular file of bounded size
(`read_config`), and one key of it without a TOML parser (`scan_key`): for the runtime wrapper's
pass-through (every runtime call the engine makes, where parsing the config would cost more
than the call) and for what can still be learnt from a config that does not parse.

A FIFO named as the config would block the hook (and every runtime call through the wrapper)
on open until a writer came; /dev/zero would be read until memory ran out. So the path is
stat()ed first and opened only when it is a regular file (a device is never opened: opening
some has effects), then with O_NONBLOCK and checked again on the open file (a swap in between
blocks nothing), and at most MAX_BYTES are read.
"""

import os
import stat

# A config is a few KiB (the commented default one is ~12 KiB).
MAX_BYTES = 1 << 20


class NotAConfigFile(ValueError):
    """The config path names no regular file of at most MAX_BYTES: str() is what it is
    instead ("is a FIFO, not a regular file"), `hint` what to do."""

    def __init__(self, what: str, hint: str):
        super().__init__(what)
        self.hint = hint


def _check(st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        from .rootpath import kind_name

        raise NotAConfigFile(f"is a {kind_name(st.st_mode)}, not a regular file",
                             "name nvhook's TOML config, a regular file (`nvhook config default` prints one)")
    if st.st_size > MAX_BYTES:
        raise _too_long(f"is {st.st_size} bytes long")


def _too_long(what: str) -> NotAConfigFile:
    return NotAConfigFile(f"{what}, more than a config's {MAX_BYTES >> 20} MiB",
                          "is it nvhook's config? (`nvhook config default` prints one: a few KiB)")


def read_config(path: str, stdin_ok: bool = False) -> bytes:
    """The bytes of the config file `path` (links followed). OSError when it cannot be read,
    NotAConfigFile when it is no regular file or longer than MAX_BYTES. `stdin_ok` (the
    operator's `config check` and `config import`, never a start path): a pipe that is this
    process's own standard input (`nvhook config default | nvhook config check /dev/stdin`) is
    read to its end, once (a second read gets the same bytes); a FIFO anyone planted at a path
    is not that, and is still refused."""
    st = os.stat(path)
    if stdin_ok and stat.S_ISFIFO(st.st_mode) and _is_stdin(st):
        return _stdin()
    _check(st)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check(os.fstat(fd))
        return _read_bounded(fd, "grew while read")  # past MAX_BYTES: it grew after the fstat
    finally:
        os.close(fd)


def _read_bounded(fd: int, too_long: str) -> bytes:
    """`fd` read to its end, at most MAX_BYTES (NotAConfigFile saying `too_long` past it)."""
    chunks, size = [], 0
    while size <= MAX_BYTES:
        chunk = os.read(fd, MAX_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > MAX_BYTES:
        raise _too_long(too_long)
    return b"".join(chunks)


_stdin_read: "bytes | None" = None


def _is_stdin(st: os.stat_result) -> bool:
    try:
        mine = os.fstat(0)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _stdin() -> bytes:
    global _stdin_read
    if _stdin_read is None:
        _stdin_read = _read_bounded(0, "standard input is longer")
    return _stdin_read


def scan_key(path: str, section: str, key: str) -> "str | None":
    """`[section] key = "..."` (a one-line basic string without escapes) read from the config
    file without a TOML parser, or None; section "" for a top-level key. Also what is known of
    a config that does not parse (start/pipeline.py permissive_config)."""
    try:
        data = read_config(path)
    except (OSError, ValueError):
        return None
    want = f"[{section}]".encode() if section else b""
    if want and want not in data:
        return None
    name = key.encode()
    current = b""
    found = None
    for line in data.split(b"\n"):
        s = line.strip()
        if s[:1] == b"[":
            current = s.split(b"#", 1)[0].strip()
            continue
        if current != want or not s.startswith(name):
            continue
        k, eq, value = s.partition(b"=")
        value = value.strip()
        if k.strip() != name or not eq or value[:1] != b'"':
            continue
        end = value.find(b'"', 1)
        if end > 0 and b"\\" not in value[:end]:
            found = value[1:end].decode("utf-8", "replace")
    return found
