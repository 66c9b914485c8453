"""`nvhook config set KEY=VALUE...`: change keys of nvhook's config file in place, its comments,
order and other keys kept (what `nvidia-ctk config --set ... --in-place` does for the toolkit's).

Each value is typed by its key's default (true/false, a number, a string), the edited text is
validated as `config check` would before anything is written, and the file is replaced
atomically with its owner and mode kept. A missing file is started from the shipped default
(`nvhook config default`), so that the keys set land among their explanations.
"""

from __future__ import annotations

import json
import os

from ..base import config as config_mod
from ..base.errors import HookError, show

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def parse_assignment(text: str) -> tuple[str, object]:
    """("section.key" or "key", the value typed by the key's default) from KEY=VALUE."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise HookError(f"{text!r} is not KEY=VALUE (e.g. daemon.mode=auto)")
    want = config_mod.TYPES.get(key)
    if want is None:
        raise HookError(f"unknown key {key!r}{config_mod.did_you_mean(key)} (nvhook config default lists every key)")
    raw = raw.strip()
    value: object
    if want is bool:
        if raw.lower() not in _TRUE + _FALSE:
            raise HookError(f"{key} must be true or false, not {raw!r}")
        value = raw.lower() in _TRUE
    elif want == (int, float):
        try:
            value = int(raw)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                raise HookError(f"{key} must be a number, not {raw!r}") from None
    else:
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            raw = raw[1:-1]  # KEY="value" as a shell would pass it quoted twice
        value = raw
    return key, value


def toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, ensure_ascii=False)


def _value_end(rest: str) -> int:
    """Where the value that starts `rest` (after `=` and blanks) ends: the rest is a comment."""
    if rest[:3] in ('"""', "'''"):
        return -1  # multi-line strings are not edited in place
    if rest[:1] == '"':
        i = 1
        while i < len(rest):
            if rest[i] == "\\":
                i += 2
                continue
            if rest[i] == '"':
                return i + 1
            i += 1
        return -1
    if rest[:1] == "'":
        end = rest.find("'", 1)
        return end + 1 if end > 0 else -1
    if rest[:1] in "[{":
        return -1
    hash_at = rest.find("#")
    return len(rest.rstrip("\n")) if hash_at < 0 else hash_at


def _header(line: str) -> str | None:
    s = line.strip()
    if s.startswith("[") and not s.startswith("[["):
        return s[1:].split("]", 1)[0].strip().strip("\"'")
    return None


def set_in_text(text: str, key: str, value: object) -> str:
    """`text` with `key` (dotted for a table's) set to `value`: the key's line edited in place
    (its indentation and trailing comment kept), or a line added at the end of its table (a
    top-level key: before the first table), or the table appended."""
    section, _, name = key.rpartition(".")
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    current = ""
    last_in_section = None  # the last key line of the section, to insert after
    section_start = None if section else -1
    for i, line in enumerate(lines):
        h = _header(line)
        if h is not None:
            current = h
            if h == section:
                section_start = i
            continue
        if current != section:
            continue
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#") or "=" not in stripped:
            continue
        k, _, rest = stripped.partition("=")
        last_in_section = i
        if k.strip().strip("\"'") != name:
            continue
        lead = rest[:len(rest) - len(rest.lstrip())]
        body = rest.lstrip()
        end = _value_end(body)
        if end < 0:
            raise HookError(f"{key} is written over several lines or as an array or table; edit it by hand")
        indent = line[:len(line) - len(stripped)]
        tail = body[end:].rstrip("\n")
        lines[i] = f"{indent}{k.rstrip()} ={lead or ' '}{toml_value(value)}{tail}\n"
        return "".join(lines)
    new = f"{name} = {toml_value(value)}\n"
    if section and section_start is None:
        return "".join(lines) + f"\n[{section}]\n{new}"
    if last_in_section is not None:
        lines.insert(last_in_section + 1, new)
    elif section:
        lines.insert((section_start or 0) + 1, new)
    else:
        first_table = next((i for i, ln in enumerate(lines) if _header(ln) is not None), len(lines))
        lines.insert(first_table, new)
    return "".join(lines)


def config_set(path: str, assignments: list[str], dry_run: bool = False) -> tuple[str, str | None]:
    """(the new text, the old one or None for a new file); written unless `dry_run`."""
    from ..base import tomlread as tomllib

    parsed = [parse_assignment(a) for a in assignments]
    from ..base.configscan import NotAConfigFile, read_config

    try:
        old: str | None = read_config(path).decode()
    except FileNotFoundError:
        old = None
    except NotAConfigFile as e:
        raise HookError(f"config {show(path)}{config_mod.link_note(path)} {e}: {e.hint}; nothing written") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HookError(f"cannot read config {show(path)}: {getattr(e, 'strerror', None) or e}") from None
    if old is not None:
        try:
            tomllib.loads(old)
        except tomllib.TOMLDecodeError as e:
            raise HookError(f"config {show(path)} is not valid TOML ({e}); fix it first, nothing written") from None
    from .setup import data

    text = old if old is not None else data("hook.toml")
    for key, value in parsed:
        text = set_in_text(text, key, value)
    try:
        config_mod.merge(tomllib.loads(text), show(path))
    except tomllib.TOMLDecodeError as e:  # pragma: no cover - a bug of set_in_text
        raise HookError(f"internal error: the edited config is not valid TOML ({e}); nothing written") from None
    if not dry_run and text != old:
        _write(path, text)
    return text, old


def _write(path: str, text: str) -> None:
    from ..base.files import replace_file

    path = os.path.realpath(path)  # a linked config stays linked: its target is replaced
    directory = os.path.dirname(os.path.abspath(path))
    try:
        try:
            st = os.stat(path)
            mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
        except FileNotFoundError:
            mode, owner = 0o644, None
            os.makedirs(directory, mode=0o755, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot write {show(path)}: {e.strerror}") from None
    try:
        replace_file(dir_fd, os.path.basename(path), text.encode("utf-8"), mode, show(path), owner=owner)
    finally:
        os.close(dir_fd)
