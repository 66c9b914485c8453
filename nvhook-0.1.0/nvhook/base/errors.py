"""The one exception type that ends a run with a one-line message.

Anything that should stop a container (or a CLI command) raises HookError with a sentence that
names the problem and the offending value; the entry points print it as a single stderr line
and exit with its code. Any other exception is a bug, and is also reported on one line.
"""


class HookError(Exception):
    """A failure the user must see: one line, no traceback."""

    def __init__(self, message: str, *, code: int = 1):
        # Messages often quote the image (paths, link targets) or a program's output: no
        # control character reaches the log or the terminal (podman prints hook stderr raw).
        message = engine_safe(str(message))
        super().__init__(message if message.isprintable() else clean(message))
        self.code = code

    @property
    def message(self) -> str:
        return str(self)


class UsageError(HookError):
    """Bad command-line usage: exit code 2, like click's own usage errors."""

    def __init__(self, message: str):
        super().__init__(message, code=2)


# Phrases that container engines match in a runtime's or a hook's error text and then explain
# as something else: podman reads "no such file or directory" as "the OCI runtime was not
# found"; Docker adds "Are you trying to mount a directory onto a file (or vice-versa)?" to
# anything saying "not a directory". nvhook's own lines say the same in other words.
_ENGINE_PHRASES = (("no such file or directory", "does not exist"),
                   ("is not a directory", "isn't a directory"),
                   ("not a directory", "a component of the path isn't a directory"))


def engine_safe(text: str) -> str:
    """`text` without the phrases that engines misread (_ENGINE_PHRASES), case ignored."""
    low = text.lower()
    if "directory" not in low:
        return text
    for phrase, instead in _ENGINE_PHRASES:
        i = low.find(phrase)
        while i >= 0:
            text = text[:i] + instead + text[i + len(phrase):]
            low = text.lower()
            i = low.find(phrase, i + len(instead))
    return text


# C0 controls, DEL and C1 controls -> "?" (tab and newline too: every message is one line).
_CONTROLS = {c: "?" for c in (*range(0x20), *range(0x7F, 0xA0))}


def clean(text: str) -> str:
    """`text` without control characters (escape sequences that would drive a terminal,
    carriage returns that would overwrite a line), each replaced by "?"."""
    return text.translate(_CONTROLS)


def show(text: str) -> str:
    """A path or name inside a one-line message: as is, or quoted with escapes when it holds a
    newline or another unprintable character (paths come from runtimes, images and users)."""
    return text if text.isprintable() else repr(text)


def short(value: object) -> str:
    """repr() of an offending value for a one-line message, cut to a readable length (deeply
    nested JSON and integers too long for str() cannot be shown at all)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):
        text = f"<{type(value).__name__} too long to show>"
    return text if len(text) <= 200 else text[:200] + "..."
