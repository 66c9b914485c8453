"""One key of nvhook's config file read without a TOML parser: for the runtime wrapper's
pass-through (every runtime call the engine makes, where parsing the config would cost more
than the call) and for what can still be learnt from a config that does not parse."""


def scan_key(path: str, section: str, key: str) -> "str | None":
    """`[section] key = "..."` (a one-line basic string without escapes) read from the config
    file without a TOML parser, or None; section "" for a top-level key. Also what is known of
    a config that does not parse (start/pipeline.py permissive_config)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except OSError:
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
