"""bpf(2) through `ffi` (not ctypes: see `ffi`), and the few eBPF instructions a device-cgroup program needs.

Same contract as `sandbox`: one function per bpf() command, named after it, raising
`OSError(errno, "bpf <COMMAND> <what>: <strerror>")`. Nothing here decides policy;
`apply.cgroups` does. Only `os`, `struct` and `ffi` are imported (this loads on the start
path of a GPU container on a cgroup v2 host).

The encoder writes `struct bpf_insn` (8 bytes: opcode, dst|src<<4 registers, 16-bit offset,
32-bit immediate, little-endian as on every architecture nvhook supports); only the opcodes
the device filter uses are named.
"""

from __future__ import annotations

import os
import struct

from . import ffi

# bpf(2) commands (linux/bpf.h enum bpf_cmd)
BPF_PROG_LOAD = 5
BPF_PROG_ATTACH = 8
BPF_PROG_DETACH = 9
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_PROG_QUERY = 16

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6  # enum bpf_attach_type

# attach flags
BPF_F_ALLOW_OVERRIDE = 1
BPF_F_ALLOW_MULTI = 2
BPF_F_REPLACE = 4

# struct bpf_cgroup_dev_ctx: access_type = (access << 16) | device type
BPF_DEVCG_ACC_MKNOD = 1
BPF_DEVCG_ACC_READ = 2
BPF_DEVCG_ACC_WRITE = 4
BPF_DEVCG_DEV_BLOCK = 1
BPF_DEVCG_DEV_CHAR = 2
CTX_ACCESS_TYPE, CTX_MAJOR, CTX_MINOR = 0, 4, 8  # offsets of the ctx's three u32 fields

# bpf() has a different number per architecture (it predates the unified table)
_NR_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}

_ATTR_SIZE = 144  # >= every union bpf_attr member used here; the kernel wants the tail zeroed
_INFO_SIZE = 80   # struct bpf_prog_info up to and including name[16]

_syscall = ffi.libc_function("syscall", ffi.c_long)  # variadic: arguments go in as C-typed values

_COMMANDS = {BPF_PROG_LOAD: "BPF_PROG_LOAD", BPF_PROG_ATTACH: "BPF_PROG_ATTACH",
             BPF_PROG_DETACH: "BPF_PROG_DETACH", BPF_PROG_GET_FD_BY_ID: "BPF_PROG_GET_FD_BY_ID",
             BPF_OBJ_GET_INFO_BY_FD: "BPF_OBJ_GET_INFO_BY_FD", BPF_PROG_QUERY: "BPF_PROG_QUERY"}


def _bpf(cmd: int, attr: ffi.Array[ffi.c_char], what: str) -> int:
    nr = _NR_BPF.get(os.uname().machine)
    if nr is None:
        raise OSError(38, f"bpf {_COMMANDS[cmd]} {what}: no bpf() syscall number known for {os.uname().machine}")
    ret = _syscall(ffi.c_long(nr), ffi.c_int(cmd), attr, ffi.c_uint(len(attr)))
    if ret < 0:
        err = ffi.get_errno()
        raise OSError(err, f"bpf {_COMMANDS[cmd]} {what}: {os.strerror(err)}")
    return int(ret)


def _attr(fmt: str, *values: int | bytes) -> ffi.Array[ffi.c_char]:
    buf = ffi.char_buffer(_ATTR_SIZE)
    struct.pack_into(fmt, buf, 0, *values)
    return buf


def _addr(buf: ffi.Array[ffi.c_char] | ffi.Array[ffi.c_uint32] | None) -> int:
    return ffi.addressof(buf) if buf is not None else 0


def bpf_prog_query(cgroup_fd: int, attach_type: int = BPF_CGROUP_DEVICE, *,
                   what: str = "cgroup") -> tuple[int, list[int]]:
    """(attach flags, ids of the programs attached directly to the cgroup)."""
    cap = 64
    while True:
        ids = (ffi.c_uint32 * cap)()
        # target_fd, attach_type, query_flags, attach_flags (out), prog_ids, prog_cnt (in/out)
        attr = _attr("=IIIIQI", cgroup_fd, attach_type, 0, 0, _addr(ids), cap)
        try:
            _bpf(BPF_PROG_QUERY, attr, what)
        except OSError as e:
            if e.errno == 28 and cap < 4096:  # ENOSPC: more programs than room; prog_cnt says how many
                cap = struct.unpack_from("=I", attr, 24)[0] or cap * 2
                continue
            raise
        flags, = struct.unpack_from("=I", attr, 12)
        count, = struct.unpack_from("=I", attr, 24)
        return flags, list(ids[:count])


def bpf_prog_get_fd_by_id(prog_id: int) -> int:
    return _bpf(BPF_PROG_GET_FD_BY_ID, _attr("=I", prog_id), f"program {prog_id}")


def bpf_obj_get_info_by_fd(prog_fd: int, *, what: str = "program") -> dict:
    """type, id, nr_map_ids and the xlated (post-verifier, reloadable) instructions of a program."""
    info = ffi.char_buffer(_INFO_SIZE)
    _bpf(BPF_OBJ_GET_INFO_BY_FD, _attr("=IIQ", prog_fd, _INFO_SIZE, _addr(info)), what)
    xlated_len, = struct.unpack_from("=I", info, 20)
    insns = ffi.char_buffer(xlated_len) if xlated_len else None
    # The second call asks for the instructions into a buffer of the size the first reported.
    info = ffi.char_buffer(_INFO_SIZE)
    struct.pack_into("=I", info, 20, xlated_len)
    struct.pack_into("=Q", info, 32, _addr(insns))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, _attr("=IIQ", prog_fd, _INFO_SIZE, _addr(info)), what)
    prog_type, prog_id = struct.unpack_from("=II", info, 0)
    got_len, = struct.unpack_from("=I", info, 20)
    nr_map_ids, = struct.unpack_from("=I", info, 52)
    code = insns.raw[:min(got_len, xlated_len)] if insns is not None else b""
    return {"type": prog_type, "id": prog_id, "nr_map_ids": nr_map_ids, "xlated": code,
            "xlated_len": got_len}


def bpf_prog_load(prog_type: int, insns: bytes, license: str = "GPL", *, name: str = "",
                  expected_attach_type: int = 0, log_size: int = 0) -> int:
    """Load a program; returns its fd. With `log_size`, the verifier's log is added to the
    error message (why a program was refused)."""
    code = ffi.char_buffer(len(insns), insns)
    lic = ffi.char_buffer(len(license.encode()) + 1, license.encode())  # NUL-terminated
    log = ffi.char_buffer(log_size) if log_size else None
    attr = _attr("=IIQQIIQII16sII", prog_type, len(insns) // 8, _addr(code), _addr(lic),
                 1 if log else 0, log_size, _addr(log), 0, 0, name.encode()[:15], 0, expected_attach_type)
    try:
        return _bpf(BPF_PROG_LOAD, attr, name or "program")
    except OSError as e:
        text = log.value.decode(errors="replace").strip() if log is not None else ""
        if text:
            raise OSError(e.errno, f"{e.strerror} (verifier: {' | '.join(text.splitlines()[-3:])})") from None
        raise


def bpf_prog_attach(cgroup_fd: int, prog_fd: int, attach_type: int = BPF_CGROUP_DEVICE, flags: int = 0,
                    replace_fd: int = 0, *, what: str = "cgroup") -> None:
    """Attach `prog_fd` to the cgroup; with BPF_F_REPLACE, atomically in place of `replace_fd`."""
    _bpf(BPF_PROG_ATTACH, _attr("=IIIII", cgroup_fd, prog_fd, attach_type, flags, replace_fd), what)


def bpf_prog_detach(cgroup_fd: int, prog_fd: int, attach_type: int = BPF_CGROUP_DEVICE, *,
                    what: str = "cgroup") -> None:
    _bpf(BPF_PROG_DETACH, _attr("=IIII", cgroup_fd, prog_fd, attach_type, 0), what)


# -- instructions ---------------------------------------------------------------------------

# classes, sizes, operations, sources (linux/bpf_common.h, linux/bpf.h)
BPF_LDX, BPF_ALU, BPF_JMP, BPF_ALU64 = 0x01, 0x04, 0x05, 0x07
BPF_W, BPF_MEM = 0x00, 0x60
BPF_K, BPF_X = 0x00, 0x08
BPF_AND, BPF_RSH, BPF_MOV = 0x50, 0x70, 0xB0
BPF_JEQ, BPF_JNE, BPF_EXIT = 0x10, 0x50, 0x90

INSN_SIZE = 8


def insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def ldx_w(dst: int, src: int, off: int) -> bytes:
    """dst = *(u32 *)(src + off)"""
    return insn(BPF_LDX | BPF_MEM | BPF_W, dst, src, off)


def mov32_reg(dst: int, src: int) -> bytes:
    return insn(BPF_ALU | BPF_MOV | BPF_X, dst, src)


def mov64_imm(dst: int, imm: int) -> bytes:
    return insn(BPF_ALU64 | BPF_MOV | BPF_K, dst, 0, 0, imm)


def and32_imm(dst: int, imm: int) -> bytes:
    return insn(BPF_ALU | BPF_AND | BPF_K, dst, 0, 0, imm)


def rsh32_imm(dst: int, imm: int) -> bytes:
    return insn(BPF_ALU | BPF_RSH | BPF_K, dst, 0, 0, imm)


def jne_imm(dst: int, imm: int, off: int) -> bytes:
    """if dst != imm goto pc + 1 + off (the 64-bit compare: imm is sign-extended, so only
    values below 2**31 are meant)"""
    return insn(BPF_JMP | BPF_JNE | BPF_K, dst, 0, off, imm)


def exit_insn() -> bytes:
    return insn(BPF_JMP | BPF_EXIT)
