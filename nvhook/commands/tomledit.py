"""Line edits of an engine's TOML config that keep the operator's comments and layout: TOML is
never round-tripped through a dumper (that drops comments). Each edit is checked by parsing its
result (`verify`): the old configuration plus exactly the keys meant, or nothing is written."""

from __future__ import annotations

import json

from ..base.errors import HookError, show


def toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a TOML basic string for any path


def parse_toml(text: str, path: str) -> dict:
    from ..base import tomlread

    try:
        return tomlread.loads(text)
    except tomlread.TOMLDecodeError as e:
        raise HookError(f"{show(path)} is not valid TOML ({e}); nothing written") from None


def key_text(k: str) -> str:
    bare = k and all(c.isalnum() or c in "-_" for c in k)
    return k if bare else toml_str(k)


def table_text(table: tuple) -> str:
    return ".".join(key_text(k) for k in table)


def _header_end(s: str) -> int:
    quote = None
    for i, c in enumerate(s):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "]":
            return i
    return -1


def header_path(line: str) -> tuple | None:
    """The key path of a `[a."b.c".d]` header line (not an array of tables), else None."""
    s = line.strip()
    if not s.startswith("[") or s.startswith("[["):
        return None
    end = _header_end(s)
    if end < 0:
        return None
    parts, cur, quote = [], "", None
    for c in s[1:end]:
        if quote:
            if c == quote:
                quote = None
            else:
                cur += c
        elif c in "\"'":
            quote = c
        elif c == ".":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += c
    parts.append(cur.strip())
    return tuple(parts)


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def set_keys(text: str, table: tuple, values: dict) -> str:
    """`text` with `values` (TOML value texts) set in `table`: each key's line replaced or
    inserted under the table's header, or a new table appended. The caller verifies the result."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    start = next((i for i, ln in enumerate(lines) if header_path(ln) == table), None)
    if start is None:
        block = ("\n" if lines else "") + "[" + table_text(table) + "]\n"
        block += "".join(f"  {key_text(k)} = {v}\n" for k, v in values.items())
        return "".join(lines) + block
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    for key, value in values.items():
        for i in range(start + 1, end):
            name = lines[i].split("=", 1)[0].strip().strip("\"'") if "=" in lines[i] else None
            if name == key and not lines[i].lstrip().startswith("#"):
                lines[i] = f"{_indent(lines[i])}{key_text(key)} = {value}\n"
                break
        else:
            body = [ln for ln in lines[start + 1:end] if ln.strip() and not ln.lstrip().startswith("#")]
            indent = _indent(body[0]) if body else _indent(lines[start]) + "  "
            lines.insert(start + 1, f"{indent}{key_text(key)} = {value}\n")
            end += 1
    return "".join(lines)


def set_imports(text: str, parsed: dict, dropin: str) -> str:
    """`text` with `dropin` added to its top-level `imports` (a new key after `version`)."""
    lines = text.splitlines(keepends=True)
    first_table = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")), len(lines))
    current = parsed.get("imports")
    if current is None:
        at = next((i + 1 for i in range(first_table) if lines[i].split("=", 1)[0].strip() == "version"), 0)
        lines.insert(at, f"imports = [{toml_str(dropin)}]\n")
        return "".join(lines)
    if not isinstance(current, list):
        raise HookError("`imports` in the containerd config is not a list; nothing written")
    start = next((i for i in range(first_table) if lines[i].split("=", 1)[0].strip() == "imports"), None)
    if start is None:
        raise HookError("cannot find the `imports` line of the containerd config; add "
                        f"{toml_str(dropin)} to it by hand")
    end = start
    while "]" not in lines[end].split("#", 1)[0] and end + 1 < first_table:
        end += 1
    items = ", ".join(toml_str(x) for x in [*current, dropin])
    lines[start:end + 1] = [f"imports = [{items}]\n"]
    return "".join(lines)


def deep_set(d: dict, table: tuple, values: dict) -> None:
    for k in table:
        d = d.setdefault(k, {})
    d.update(values)


def get_path(d, table: tuple):
    for k in table:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def verify(text: str, before: dict, wanted: list, path: str, extra_import: str | None = None) -> None:
    """The edited config must parse to the old one plus exactly what nvhook sets."""
    from ..base import tomlread

    expect = json.loads(json.dumps(before))
    for table, vals in wanted:
        deep_set(expect, table, vals)
    if extra_import:
        expect["imports"] = [*expect.get("imports", []), extra_import]
    try:
        ok = tomlread.loads(text) == expect
    except tomlread.TOMLDecodeError:
        ok = False
    if not ok:
        lines = "; ".join(f"[{table_text(t)}] " + ", ".join(f"{k} = {toml_str(v)}" for k, v in vals.items())
                          for t, vals in wanted) or f"imports += {toml_str(extra_import or '')}"
        raise HookError(f"cannot edit {show(path)} safely (its layout is unusual); nothing written; "
                        f"add by hand: {lines}")
