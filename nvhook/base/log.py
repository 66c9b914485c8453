"""Structured event log: one complete JSON line per event.

The hook's start path cannot afford structlog's import (about 50 ms on our CI machines, more
than the whole hook budget), so events are plain dicts collected by `EventLog` and written as
JSON lines with one O_APPEND write each: lines from many hooks running at once never
interleave. Interactive commands (`info`, `list`, `doctor`, `--dry-run`) may additionally
echo events to stderr through structlog's console renderer (see `console_sink`).

Each event carries: ts (RFC 3339 UTC), level, event (a dotted name), container (the OCI id;
null only before the state was read), message (a sentence for a person, made when the line is
written), nvhook_pid, plus the event's own fields.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from . import jsonfast as json
from .errors import clean, engine_safe, show

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from typing import Any

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


def _scrub(value: Any) -> Any:
    """`value` with control characters in every string it holds (list items, dict keys and
    values included) replaced by "?": container ids, link targets, ldconfig's output and image
    paths all come from someone else, and `jq -r` hands them to an operator's terminal. The
    same object when there is nothing to replace."""
    t = type(value)
    if t is str:
        return value if value.isprintable() else clean(value)
    if t is list or t is tuple:
        out = None
        for i, v in enumerate(value):
            s = _scrub(v)
            if s is not v:
                if out is None:
                    out = list(value)
                out[i] = s
        return value if out is None else out
    if t is dict:
        for k, v in value.items():
            if _scrub(k) is not k or _scrub(v) is not v:
                return {_scrub(k): _scrub(v) for k, v in value.items()}
    return value


def _shown(o: object) -> str:
    """Any other object in an event (an exception, a Path): its text, scrubbed too."""
    return clean(str(o))


def _timestamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class EventLog:
    """Collects events; `flush()` writes the ones at or above the configured level.

    Events are kept in memory until flush so that the hook pays for file I/O once, after the
    container's mounts are done; `flush` is called from a `finally`, so a failing run still
    writes everything it saw.
    """

    def __init__(self, level: str = "info", path: str | None = None):
        self.level = LEVELS.get(level, 20)
        self.path = path
        self.journal = False  # also send each event to the systemd journal (config log_journal)
        self.context: dict = {}
        self.events: list[dict] = []
        self.sinks: list = []  # callables(event_dict), e.g. a console renderer
        self.write_error: str | None = None
        self.lock_timed_out = False
        self.open_as: tuple | None = None  # (uid, gid) to open `path` as (base/userns.py log_target)

    def bind(self, **fields: object) -> None:
        self.context.update({k: _scrub(v) for k, v in fields.items()})

    def event(self, name: str, level: str = "info", **fields: object) -> dict:
        ev = {"ts": time.time(), "level": level, "event": name}
        if LEVELS.get(level, 20) < self.level and not self.sinks:
            return ev  # below the threshold and nobody watching: not kept, not written
        ev.update(self.context)
        for k, v in fields.items():
            ev[k] = _scrub(v)
        self.events.append(ev)
        for sink in self.sinks:
            sink(ev)
        return ev

    def debug(self, name: str, **fields: object) -> dict:
        return self.event(name, "debug", **fields)

    def info(self, name: str, **fields: object) -> dict:
        return self.event(name, "info", **fields)

    def warning(self, name: str, **fields: object) -> dict:
        return self.event(name, "warning", **fields)

    def error(self, name: str, **fields: object) -> dict:
        return self.event(name, "error", **fields)

    def warnings(self) -> list[dict]:
        return [e for e in self.events if e["level"] in ("warning", "error")]

    def lines(self) -> list[bytes]:
        pid = os.getpid()
        out = []
        for ev in self.events:
            if LEVELS.get(ev["level"], 20) < self.level:
                continue
            rec = dict(ev, ts=_timestamp(ev["ts"]), nvhook_pid=pid)
            rec.setdefault("container", None)
            if not rec.get("message"):
                rec["message"] = message(ev)
            out.append((json.dumps(rec, default=_shown, separators=(",", ":")) + "\n").encode())
        return out

    def flush(self) -> None:
        """Append pending events to the log file; never raises.

        A full disk or an unwritable path must not stop a container: the failure is kept in
        `write_error` for the caller to report on stderr.
        """
        if not self.path and not self.journal:
            self.events.clear()
            return
        lines = self.lines()
        self.events.clear()
        if not lines:
            return
        if self.journal:
            self.write_error = journal_send(lines)
        if not self.path:
            return
        try:
            fd = open_log(self.path) if self.open_as is None else _open_as(self.path, self.open_as)
        except OSError as e:
            self.write_error = f"cannot open log file {show(self.path)}: {e.strerror}"
            return
        data = b"".join(lines)
        try:
            # One write per flush, under an exclusive lock: lines from many hooks writing the
            # same file never interleave and one container's events stay together. Anyone who
            # can read the file can flock it, so the lock is waited for briefly; then the
            # events are written without it (O_APPEND still keeps each write whole) and
            # stderr says so. If the disk fills mid-write, the file is cut back to where this
            # write started, so no partial line is left for the next writer to append to.
            if not _lock(fd, 0 if self.lock_timed_out else LOCK_TIMEOUT):
                self.lock_timed_out = True  # the run's later flushes do not wait again
                self.write_error = (f"log file {show(self.path)} stayed locked by another process for "
                                    f"{LOCK_TIMEOUT * 1000:.0f} ms; events written without the lock")
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                while data:
                    n = os.write(fd, data)
                    if n <= 0:
                        raise OSError(28, "No space left on device")
                    data = data[n:]
            except OSError:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass
                raise
        except OSError as e:
            self.write_error = f"cannot write log file {show(self.path)}: {e.strerror or e}"
        finally:
            os.close(fd)


JOURNAL_SOCKET = "/run/systemd/journal/socket"
_PRIORITY = {"debug": b"7", "info": b"6", "warning": b"4", "error": b"3"}


def _journal_field(name: bytes, value: bytes) -> bytes:
    """journald's native protocol: NAME=value, or NAME, a 64-bit little-endian length and the
    bytes when the value holds a newline."""
    if b"\n" not in value:
        return name + b"=" + value + b"\n"
    return name + b"\n" + len(value).to_bytes(8, "little") + value + b"\n"


def journal_send(lines: list[bytes]) -> str | None:
    """Each JSON line as one journal entry; an error sentence, or None. _socket, not socket:
    `import socket` pulls in enum and selectors, and this runs in hook mode."""
    import _socket

    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
    except OSError as e:
        return f"cannot write to the journal: {e.strerror}"
    try:
        for line in lines:
            rec = json.loads(line)
            entry = b"".join((
                _journal_field(b"MESSAGE", str(rec.get("message") or rec.get("event")).encode()),
                _journal_field(b"PRIORITY", _PRIORITY.get(rec.get("level"), b"6")),
                _journal_field(b"SYSLOG_IDENTIFIER", b"nvhook"),
                _journal_field(b"NVHOOK_EVENT", str(rec.get("event")).encode()),
                _journal_field(b"NVHOOK_CONTAINER", str(rec.get("container") or "").encode()),
                _journal_field(b"NVHOOK_JSON", line.rstrip(b"\n")),
            ))
            sock.sendto(entry, JOURNAL_SOCKET)
    except OSError as e:
        return f"cannot write to the journal at {JOURNAL_SOCKET}: {e.strerror}"
    finally:
        sock.close()
    return None


class _Fields(dict):
    """Event fields for a message template: lists joined, absent fields shown as '?'."""

    def __missing__(self, key: str) -> str:
        return "?"

    def __getitem__(self, key: str) -> object:
        value = dict.__getitem__(self, key) if key in self else self.__missing__(key)
        if isinstance(value, (list, tuple)):
            return ", ".join(str(v) for v in value) or "none"
        return "?" if value is None else value


# One sentence per common event; other events fall back to their reason, error or name.
_MESSAGES = {
    "hook.start": "nvhook {nvhook_version} started as {stage} hook (host root {root})",
    "hook.done": "done: {n_mounted} mounts, {symlinks} symlinks ({symlinks_changed} created or replaced), "
                 "forward compat {compat}",
    "hook.failed": "container refused: {error}",
    "hook.crashed": "internal error: {error}",
    "config.unusable": "{error}; ignored: the container asks for no GPU",
    "request": "request: devices {devices}, capabilities {capabilities} (from {source})",
    "plan": "plan: {mounts} mounts, {symlinks} symlinks, {devices} device rules, GPUs {gpus}",
    "compat.decision": "forward compat: {decision}: {reason}",
    "library.missing": "{library} ({capability}) is not on the host",
    "binary.missing": "{binary} ({capability}) is not on the host",
    "device.missing": "{device} is not on the host",
    "ipc.missing": "{path} ({capability}) is not on the host",
    "firmware.missing": "no firmware directory {path} on the host",
    "library.skipped": "{library}: {where} not used: {reason}",
    "cgroups.allowed": "device access granted (cgroup {mode}): {rules}",
    "ldcache.written": "ld.so.cache written: {entries} entries",
    "ldcache.musl_path": "musl image: {added} added to its loader path file {file} (musl reads no ld.so.cache)",
    "ldconfig.done": "ldconfig ran",
    "inventory.built": "host inventory built: {libraries} libraries, {binaries} binaries, {devices} devices",
    "inventory.cache_hit": "host inventory from the cache in {cache_dir}",
    "gpus.procfs": "{count} GPUs in /proc/driver/nvidia",
    "nvml.unavailable": "NVML unavailable ({error}): GPU facts from procfs",
    "apply.done": "applied: {mounts} mounts, {symlinks} symlinks ({symlinks_changed} created or replaced), "
                  "{devices} device rules",
    "mount.done": "mounted {target}",
}


def message(ev: dict) -> str:
    """A sentence for a person reading the log at 3 a.m."""
    fields = _Fields(ev)
    if ev.get("event") == "hook.done":
        fields["n_mounted"] = len(ev.get("mounted") or ())
    fields.setdefault("where", ev.get("file") or ev.get("entry"))
    if ev.get("event") == "compat.decision" and ev.get("warnings"):
        return "; ".join(str(w) for w in ev["warnings"])
    if ev.get("event") == "request" and ev.get("kind") == "skip":
        return f"no GPU requested: {ev.get('reason')}"
    template = _MESSAGES.get(ev.get("event", ""))
    if template is not None:
        try:
            return template.format_map(fields)
        except (ValueError, IndexError, AttributeError):
            pass
    for key in ("reason", "error", "problem"):
        if ev.get(key):
            return f"{ev.get('event')}: {ev[key]}"
    return _from_fields(ev)


# Fields every event carries (or that say nothing by themselves): not part of a fallback sentence.
_COMMON = frozenset(("ts", "level", "event", "message", "container", "nvhook_pid", "interactive", "served_by",
                     "client_pid", "traceback"))


def _from_fields(ev: dict) -> str:
    """An event without a sentence of its own: its name in words and its fields, so that the
    message says what happened (`mount.skipped: target /x, why ...`), never only the name."""
    parts = []
    for k, v in ev.items():
        if k in _COMMON or v is None or v == "" or v == [] or v == {}:
            continue
        if k.endswith("_ms") and isinstance(v, (int, float)):
            v = f"{v} ms"
        elif isinstance(v, (list, tuple)):
            v = ", ".join(str(x) for x in v[:6]) + (f" (+{len(v) - 6} more)" if len(v) > 6 else "")
        elif isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in list(v.items())[:6])
        parts.append(f"{k.replace('_', ' ')} {v}")
        if len(parts) == 6:
            break
    name = str(ev.get("event")).replace(".", " ").replace("_", " ")
    return f"{name}: {'; '.join(parts)}" if parts else name
# How long a flush waits for the log's lock before writing without it.
LOCK_TIMEOUT = 0.2
_LOG_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def open_log(path: str) -> int:
    """The log file, opened for appending without following a link at its name (a planted one,
    even dangling, is neither followed nor created through) and without blocking (a FIFO there
    fails or is refused, never hangs a container start). It must be a regular file owned by
    root (or by whoever runs nvhook): one owned by someone else could be swapped, truncated or
    read by them. OSError otherwise."""
    fd = os.open(path, _LOG_FLAGS, 0o640)
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid not in (0, os.geteuid()):
        problem = f"owned by uid {st.st_uid}, not root"
    if problem is not None:
        os.close(fd)
        raise OSError(1, problem)
    return fd


def _open_as(path: str, owner: tuple) -> int:
    from .userns import As

    with As(owner):
        return open_log(path)


def _lock(fd: int, timeout: float) -> bool:
    """flock(LOCK_EX) for at most `timeout` seconds; False when it was not had."""
    import fcntl

    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def stderr_line(message: str) -> None:
    """The one line runc/podman show the user."""
    try:
        sys.stderr.write(f"nvhook: {clean(engine_safe(message))}\n")
        sys.stderr.flush()
    except OSError:
        pass
