"""The one exception type that ends a run with a one-line message.

Anything that should stop a container (or a CLI command) raises HookError with a sentence that
names the problem and the offending value; the entry points print it as a single stderr line
and exit with its code. Any other exception is a bug, and is also reported on one line.
"""


class HookError(Exception):
    """A failure the user must see: one line, no traceback."""

    def __init__(self, message: str, *, code: int = 1):
        super().__init__(message)
        self.code = code

    @property
    def message(self) -> str:
        return str(self)


class UsageError(HookError):
    """Bad command-line usage: exit code 2, like click's own usage errors."""

    def __init__(self, message: str):
        super().__init__(message, code=2)
