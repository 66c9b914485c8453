"""The eBPF instruction encoder (nvhook.base.bpf) against known encodings, and the shape of
the device filter nvhook builds from it (nvhook.apply.cgroups.device_filter).

The expected bytes are struct bpf_insn as the kernel documents it (opcode; dst in the low,
src in the high nibble; 16-bit little-endian offset; 32-bit little-endian immediate), the same
bytes `llvm-objdump -d` shows beside `r0 = 1`, `exit`, `r2 = *(u32 *)(r1 + 0)` and so on.
Whether the kernel accepts and enforces the result is tests/test_cgroup_devices.py's job.
"""

from __future__ import annotations

import struct

import pytest

from nvhook.apply import cgroups
from nvhook.base import bpf
from nvhook.base.errors import HookError

KNOWN = [
    (bpf.mov64_imm(0, 1), "b7 00 00 00 01 00 00 00"),        # r0 = 1
    (bpf.mov64_imm(0, 0), "b7 00 00 00 00 00 00 00"),        # r0 = 0
    (bpf.exit_insn(), "95 00 00 00 00 00 00 00"),            # exit
    (bpf.ldx_w(2, 1, 0), "61 12 00 00 00 00 00 00"),         # r2 = *(u32 *)(r1 + 0)
    (bpf.ldx_w(4, 1, 4), "61 14 04 00 00 00 00 00"),         # r4 = *(u32 *)(r1 + 4)
    (bpf.ldx_w(5, 1, 8), "61 15 08 00 00 00 00 00"),         # r5 = *(u32 *)(r1 + 8)
    (bpf.mov32_reg(3, 2), "bc 23 00 00 00 00 00 00"),        # w3 = w2
    (bpf.rsh32_imm(3, 16), "74 03 00 00 10 00 00 00"),       # w3 >>= 16
    (bpf.and32_imm(2, 0xFFFF), "54 02 00 00 ff ff 00 00"),   # w2 &= 0xffff
    (bpf.jne_imm(3, 2, 5), "55 03 05 00 02 00 00 00"),       # if r3 != 0x2 goto +5
    (bpf.jne_imm(4, 195, 300), "55 04 2c 01 c3 00 00 00"),   # if r4 != 0xc3 goto +300
    (bpf.jne_imm(0, 0, -1), "55 00 ff ff 00 00 00 00"),      # if r0 != 0x0 goto -1
    (bpf.and32_imm(0, -8), "54 00 00 00 f8 ff ff ff"),       # w0 &= -8
]


@pytest.mark.parametrize("code,expected", KNOWN, ids=[e for _, e in KNOWN])
def test_known_encodings(code, expected):
    assert code.hex(" ") == expected


def _decode(code: bytes) -> list[tuple[int, int, int, int, int]]:
    out = []
    for i in range(0, len(code), 8):
        op, regs, off, imm = struct.unpack_from("<BBhi", code, i)
        out.append((op, regs & 0xF, regs >> 4, off, imm))
    return out


RULES = [{"type": "c", "major": 195, "minor": 255, "access": "rw"},
         {"type": "c", "major": 508, "minor": "*", "access": "rwm"},
         {"type": "b", "major": 7, "minor": 1, "access": "r"},
         {"type": "a", "major": 1, "minor": 3, "access": "w"}]


@pytest.mark.parametrize("tail", [None, bpf.mov64_imm(0, 0) + bpf.exit_insn()], ids=["alone", "fall-through"])
def test_device_filter_shape(tail):
    code = cgroups.device_filter(RULES, tail)
    insns = _decode(code)
    jumps = {bpf.BPF_JMP | bpf.BPF_JNE | bpf.BPF_K, bpf.BPF_JMP | bpf.BPF_EXIT}
    # r1 (the context the fall-through code expects) is never written
    assert not [i for i in insns if i[0] not in jumps and i[1] == 1]
    # every rule's checks jump to the start of the next rule (or of the tail), never past it
    starts, i = [], 6
    for r in RULES:
        n = (r["type"] != "a") + (r["major"] != "*") + (r["minor"] != "*")
        starts.append(i)
        i += n + 5
    ends = starts[1:] + [i]
    for s, e in zip(starts, ends):
        for pc in range(s, e):
            op, _, _, off, _ = insns[pc]
            if op == bpf.BPF_JMP | bpf.BPF_JNE | bpf.BPF_K:
                assert pc + 1 + off == e, (pc, off, e)
        assert insns[e - 2][0] == bpf.BPF_ALU64 | bpf.BPF_MOV | bpf.BPF_K and insns[e - 2][4] == 1  # r0 = 1
        assert insns[e - 1][0] == bpf.BPF_JMP | bpf.BPF_EXIT
    # the access check: what is asked (the high half of access_type, in r3), minus what the
    # rule allows, must be nothing
    assert insns[6][:3] == (bpf.BPF_JMP | bpf.BPF_JNE | bpf.BPF_K, 2, 0)
    assert [insns[e - 5][:3] for e in ends] == [(bpf.BPF_ALU | bpf.BPF_MOV | bpf.BPF_X, 0, 3)] * len(ends)
    masks = [insns[e - 4][4] & 0xFFFF for e in ends]
    assert masks == [0xFFFF & ~6, 0xFFFF & ~7, 0xFFFF & ~2, 0xFFFF & ~4]
    # the type/major/minor compared, in that order; wildcards compare nothing
    first = [(insns[pc][1], insns[pc][4]) for pc in range(starts[1], starts[1] + 2)]
    assert first == [(2, bpf.BPF_DEVCG_DEV_CHAR), (4, 508)]
    assert (insns[starts[2]][1], insns[starts[2]][4]) == (2, bpf.BPF_DEVCG_DEV_BLOCK)
    assert (insns[starts[3]][1], insns[starts[3]][4]) == (4, 1)  # "a": no type check
    # then the tail, unchanged, or "allow" (the kernel's default without a program)
    assert code[i * 8:] == (tail if tail is not None else bpf.mov64_imm(0, 1) + bpf.exit_insn())


@pytest.mark.parametrize("bad", [{"type": "c", "major": -1, "minor": 0}, {"type": "c", "major": 1 << 20, "minor": 0},
                                 {"type": "c", "major": "195", "minor": 0}, {"type": "c", "major": True, "minor": 0}])
def test_device_filter_refuses_numbers_that_are_not_devices(bad):
    with pytest.raises(HookError, match="invalid device cgroup rule"):
        cgroups.device_filter([bad], None)


HYBRID_UNDER_V2 = """\
25 1 254:0 / / rw - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
36 31 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
90 31 0:38 /kube/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw
"""


def test_cgroup2_mount_root_is_the_topmost_mount():
    assert cgroups.cgroup2_mount_root(HYBRID_UNDER_V2, "/sys/fs/cgroup") == "/kube/pod1"
    # the tmpfs of a hybrid host is on top: no cgroup2 there
    assert cgroups.cgroup2_mount_root(HYBRID_UNDER_V2.rsplit("90 ", 1)[0], "/sys/fs/cgroup") is None
    assert cgroups.cgroup2_mount_root(HYBRID_UNDER_V2, "/sys/fs/cgroup/unified") == "/"
