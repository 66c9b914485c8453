"""JSON through CPython's C accelerators (_json), without importing the json package.

`import json` costs ~7 ms on our CI machines (json.decoder and json.encoder pull in `re` and
its compiler), a sixth of the hook's whole budget, while the parsing and encoding themselves
are done by the C module `_json` that the interpreter already has. This module drives that C
scanner and encoder directly; results and errors match `json.loads`/`json.dumps` for what
nvhook reads and writes (a test checks that on generated documents). Anything unusual
(indent, sort_keys, a Python without _json) goes to the json package itself.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # the start path never imports typing
    from collections.abc import Callable
    from typing import IO, Any

try:
    import _json
except ImportError:  # pragma: no cover - every CPython build we support has it
    _json = None  # type: ignore[assignment]

_WS = " \t\n\r"
_CONSTANTS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class _Context:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = _CONSTANTS.__getitem__
    memo: dict = {}


# The C scanner reads only these attributes of its argument (json.JSONDecoder's, by duck typing).
_scan = _json.make_scanner(_Context()) if _json else None  # type: ignore[arg-type]


def _error(msg: str, doc: str, pos: int) -> ValueError:
    from json import JSONDecodeError  # only on bad input

    return JSONDecodeError(msg, doc, pos)


def loads(s: str | bytes | bytearray) -> Any:
    if _scan is None:
        import json

        return json.loads(s)
    if isinstance(s, (bytes, bytearray)):
        s = bytes(s).decode("utf-8")  # UnicodeDecodeError is a ValueError, like json's
    elif not isinstance(s, str):
        raise TypeError(f"the JSON object must be str or bytes, not {type(s).__name__}")
    if s.startswith("\ufeff"):
        raise _error("Unexpected UTF-8 BOM (decode using utf-8-sig)", s, 0)
    idx = len(s) - len(s.lstrip(_WS))
    try:
        obj, end = _scan(s, idx)
    except StopIteration as e:
        raise _error("Expecting value", s, e.value) from None
    except SystemError:
        # The C scanner builds its error from json.decoder, looked up in sys.modules only;
        # before that module is imported it fails without an exception. Bad input is the
        # rare path: let the json package parse it again and raise its own error.
        import json

        return json.loads(s)
    finally:
        _Context.memo.clear()
    rest = len(s) - len(s.rstrip(_WS))
    if end != len(s) - rest:
        raise _error("Extra data", s, end)
    return obj


def dumps(obj: object, *, default: Callable[[Any], Any] | None = None,
          separators: tuple[str, str] | None = None, **kwargs: Any) -> str:
    if _json is None or kwargs:
        import json

        return json.dumps(obj, default=default, separators=separators, **kwargs)
    item_sep, key_sep = separators or (", ", ": ")

    def _default(o: object) -> Any:
        if default is None:
            raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
        return default(o)

    encode = _json.make_encoder({}, _default, _json.encode_basestring_ascii, None,
                                key_sep, item_sep, False, False, True)
    return "".join(encode(obj, 0))


def dump(obj: object, fp: IO[str], **kwargs: Any) -> None:
    fp.write(dumps(obj, **kwargs))
