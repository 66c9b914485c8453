"""The few foreign-function pieces `sandbox` and `bpf` need, built straight on `_ctypes`.

Why not `import ctypes`: on the start path (os and struct already loaded) it costs ~2.9 ms of
CPU per process on the test machine (its Python body: type aliases for every C type, size
checks, the CDLL/LibraryLoader machinery; plus `types` and `ctypes._endian`), this module with
`_ctypes` ~1.4 ms (medians of 100 interleaved runs), paid by every GPU start. `_ctypes`
already does the real work (argument conversion, errno capture, structure layout), so this
module only names what nvhook uses:

- the C types, as direct subclasses of `_ctypes._SimpleCData` (direct, so that `_ctypes`
  converts results, structure fields and array items to plain Python ints and bytes);
- `libc_function(name, restype, argtypes)`: a libc function looked up in the process's own
  symbol table, called with the cdecl convention and with errno captured after each call
  (`get_errno`), as `CDLL(None, use_errno=True)` would give;
- `char_buffer`, a zero-filled writable `char[n]` (optionally initialised from bytes).

Linux only, and 64-bit only (LP64: long and pointers are 8 bytes, int is 4), checked at import.
Not a ctypes replacement: add a type here only when a caller needs it.
"""

from __future__ import annotations

import _ctypes
from _ctypes import Array, Structure, addressof, byref, get_errno, sizeof

__all__ = ["Array", "Structure", "addressof", "byref", "char_buffer", "get_errno", "libc_function", "sizeof",
           "c_char", "c_char_p", "c_int", "c_long", "c_size_t", "c_uint", "c_uint32", "c_uint64", "c_ulong",
           "c_void_p"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    # The type checker is told these are ctypes' own classes: they have the same type codes and
    # so the same behaviour, and its ctypes support (c_char arrays' .raw and .value) applies.
    from ctypes import c_char, c_char_p, c_int, c_long, c_uint, c_ulong, c_void_p
else:
    # The one-letter codes are those of the `struct` module; `_ctypes` picks the C type and the
    # conversions from them (from_param of "z" takes bytes or None, of "P" ints, None, arrays
    # and byref() results).
    def _c_type(name: str, code: str) -> type:
        return type(name, (_ctypes._SimpleCData,), {"_type_": code})

    c_int, c_uint, c_long, c_ulong, c_char, c_char_p, c_void_p = (
        _c_type(name, code) for name, code in (("c_int", "i"), ("c_uint", "I"), ("c_long", "l"), ("c_ulong", "L"),
                                               ("c_char", "c"), ("c_char_p", "z"), ("c_void_p", "P")))


# Fixed-width names for struct fields, valid on the LP64 ABI checked below (one class less to
# create at import: each costs ~40 us).
c_uint32 = c_uint
c_uint64 = c_ulong
c_size_t = c_ulong

if sizeof(c_int) != 4 or sizeof(c_long) != 8 or sizeof(c_void_p) != 8:
    raise ImportError("nvhook.base.ffi supports 64-bit Linux (LP64) only")


class _LibcFunction(_ctypes.CFuncPtr):
    # cdecl, and errno swapped into _ctypes' per-thread copy right after the call, so that
    # get_errno() reads the call's errno even if Python ran other C code since.
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = c_int


# dlopen(NULL): the running program and the libraries it is linked with (libc among them).
_self = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)  # type: ignore[arg-type]  # the stub forgets NULL


def libc_function(name: str, restype: type[_ctypes._SimpleCData] | None,
                  argtypes: tuple[type[_ctypes._SimpleCData], ...] | None = None) -> _ctypes.CFuncPtr:
    """The libc function `name`. With `argtypes`, Python arguments are converted to those C
    types (a wrong type raises ctypes' ArgumentError); without, the function is variadic in
    practice and each argument must already be a C-typed value (an int passes as C int).
    `restype` None means void. A libc without `name` raises AttributeError, as ctypes does."""
    try:
        address = _ctypes.dlsym(_self, name)
    except OSError as e:
        raise AttributeError(str(e)) from None
    func = _LibcFunction(address)
    func.restype = restype
    if argtypes is not None:
        func.argtypes = argtypes
    return func


def char_buffer(size: int, init: bytes = b"") -> Array[c_char]:
    """A zero-filled `char[size]`, its first bytes set to `init` (which must fit)."""
    buf: Array[c_char] = (c_char * size)()
    if init:
        buf.raw = init  # copies len(init) bytes; ValueError if they do not fit
    return buf
