"""Writing a CDI spec (nvhook.decide.cdimodel builds it): JSON or YAML text, and the file replaced
atomically so that a runtime reading the spec directory never sees half a spec.

YAML without a dependency: a spec is JSON data (objects, arrays, strings, integers), and every
JSON string is a valid YAML double-quoted scalar, so a small block-style emitter that quotes
every string as JSON does is exact; nothing else is needed (and nothing on the container-start
path imports this module).
"""

from __future__ import annotations

import os

from ..base.errors import HookError, show
from ..base.files import replace_file

try:
    from _json import encode_basestring_ascii as _quote
except ImportError:  # pragma: no cover - every CPython build we support has _json
    _quote = None  # type: ignore[assignment]


def to_json(spec: dict) -> bytes:
    """json.dumps(spec, indent=2, ensure_ascii=True) + newline, byte for byte, without the json
    package (which imports re, enum and the rest: a third of `cdi generate`'s imports)."""
    if _quote is None:  # pragma: no cover
        import json

        return (json.dumps(spec, indent=2, ensure_ascii=True) + "\n").encode()
    out: list[str] = []
    _json_value(spec, "\n", out)
    out.append("\n")
    return "".join(out).encode()


def _json_value(value: object, nl: str, out: list[str]) -> None:
    if isinstance(value, dict):
        if not value:
            out.append("{}")
            return
        inner = nl + "  "
        out.append("{")
        first = True
        for k, v in value.items():
            out.append(inner if first else "," + inner)
            first = False
            out.append(_scalar(str(k)))  # spec keys are strings
            out.append(": ")
            _json_value(v, inner, out)
        out.append(nl + "}")
    elif isinstance(value, (list, tuple)):
        if not value:
            out.append("[]")
            return
        inner = nl + "  "
        out.append("[")
        for i, v in enumerate(value):
            out.append(inner if i == 0 else "," + inner)
            _json_value(v, inner, out)
        out.append(nl + "]")
    else:
        out.append(_scalar(value))


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float) or _quote is None:
        import json

        return json.dumps(value if isinstance(value, float) else str(value), ensure_ascii=True)
    return _quote(str(value))


def _yaml(value: object, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            out[-1] += " {}"
            return
        for k, v in value.items():
            key = str(k) if _plain_key(str(k)) else _scalar(str(k))
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{key}:")
                _yaml(v, indent + 2, out)
            else:
                out.append(f"{pad}{key}: " + ("{}" if v == {} else "[]" if v == [] else _scalar(v)))
        return
    if isinstance(value, list):
        for item in value:
            if isinstance(item, dict) and item:
                sub: list[str] = []
                _yaml(item, indent + 2, sub)
                sub[0] = f"{pad}- " + sub[0][indent + 2:]
                out.extend(sub)
            elif isinstance(item, list) and item:
                out.append(f"{pad}-")
                _yaml(item, indent + 2, out)
            else:
                out.append(f"{pad}- " + ("{}" if item == {} else "[]" if item == [] else _scalar(item)))
        return
    out.append(pad + _scalar(value))


def to_yaml(spec: dict) -> bytes:
    out: list[str] = ["---"]
    _yaml(spec, 0, out)
    return ("\n".join(out) + "\n").encode()


def serialize(spec: dict, fmt: str) -> bytes:
    return to_yaml(spec) if fmt == "yaml" else to_json(spec)


def write_atomic(path: str, data: bytes, mode: int = 0o644) -> bool:
    """Replace `path` with `data`: a new file beside it (O_EXCL|O_NOFOLLOW: a planted file or
    link is never written through), fsync'ed, renamed over. False (nothing written) when the
    file already holds exactly `data`, so a regeneration that changes nothing changes no
    mtime and wakes no watcher. The directory is created (0755) when missing."""
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    try:
        with open(path, "rb") as f:
            if f.read(len(data) + 1) == data:
                return False
    except OSError:
        pass
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as e:
        raise HookError(f"cannot create {show(directory)}: {e.strerror}") from None
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot write {show(path)}: {e.strerror}") from None
    try:
        replace_file(dir_fd, name, data, mode, show(path))
    finally:
        os.close(dir_fd)
    return True


def read_spec(path: str) -> dict:
    """A CDI spec file written as JSON (nvhook's default) or as nvhook's YAML."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
    except OSError as e:
        raise HookError(f"cannot read CDI spec {show(path)}: {e.strerror}") from None
    text = raw.decode("utf-8", "replace")
    if text.lstrip().startswith("{"):
        try:
            import json

            spec = json.loads(text)
        except ValueError as e:
            raise HookError(f"CDI spec {show(path)} is not valid JSON: {e}") from None
    else:
        spec = from_yaml(text, path)
    if not isinstance(spec, dict) or not isinstance(spec.get("devices"), list):
        raise HookError(f"CDI spec {show(path)} has no device list")
    return spec


def from_yaml(text: str, path: str) -> dict:
    """Read back the YAML `to_yaml` writes (its subset only: block style, JSON scalars)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and ln.strip() != "---" and not ln.lstrip().startswith("#")]
    pos = 0

    def bad(msg: str) -> HookError:
        return HookError(f"CDI spec {show(path)}: not YAML that nvhook writes ({msg}); "
                         f"check it with `nvhook cdi check` only for specs nvhook generated")

    def indent_of(ln: str) -> int:
        return len(ln) - len(ln.lstrip(" "))

    def scalar(s: str) -> object:
        s = s.strip()
        if s == "{}":
            return {}
        if s == "[]":
            return []
        try:
            import json

            return json.loads(s)
        except ValueError:
            return s

    def block(ind: int) -> object:
        nonlocal pos
        if pos >= len(lines):
            raise bad("unexpected end")
        if lines[pos].lstrip().startswith("- ") or lines[pos].strip() == "-":
            items: list = []
            while pos < len(lines) and indent_of(lines[pos]) == ind and lines[pos].lstrip().startswith("-"):
                rest = lines[pos].strip()[1:].strip()
                if not rest:
                    pos += 1
                    items.append(block(ind + 2))
                elif _split_key(rest) is not None:
                    lines[pos] = " " * (ind + 2) + rest
                    items.append(block(ind + 2))
                else:
                    items.append(scalar(rest))
                    pos += 1
            return items
        obj: dict = {}
        while pos < len(lines) and indent_of(lines[pos]) == ind and not lines[pos].lstrip().startswith("- "):
            split = _split_key(lines[pos].strip())
            if split is None:
                raise bad(f"line {lines[pos].strip()[:60]!r} is not 'key: value'")
            key, rest = split
            pos += 1
            if rest.strip():
                obj[key] = scalar(rest)
            else:
                nxt = indent_of(lines[pos]) if pos < len(lines) else -1
                if nxt > ind or (nxt == ind and pos < len(lines) and lines[pos].lstrip().startswith("- ")):
                    obj[key] = block(nxt)
                else:
                    obj[key] = None
        return obj

    result = block(0)
    if not isinstance(result, dict):
        raise bad("the top level is not a mapping")
    return result


_YAML_WORDS = frozenset(("true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"))


def _plain_key(k: str) -> bool:
    """A key written unquoted: an identifier that no YAML reader takes for a bool, null or number."""
    return (bool(k) and (k[0].isalpha() or k[0] == "_") and k.isascii()
            and all(c.isalnum() or c == "_" for c in k) and k.lower() not in _YAML_WORDS)


def _split_key(s: str) -> tuple[str, str] | None:
    """("key", "rest after the colon") of a `key: value` line as to_yaml writes it, else None."""
    if s.startswith('"'):
        try:
            import json

            key, end = json.JSONDecoder().raw_decode(s)
        except ValueError:
            return None
        if not isinstance(key, str) or s[end:end + 1] != ":":
            return None
        return key, s[end + 1:]
    key, sep, rest = s.partition(":")
    return (key, rest) if sep and _plain_key(key) else None
