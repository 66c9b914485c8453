"""A prestart hook for the cgroup v2 tests that changes the container's BPF device programs
before nvhook runs (it is listed first), to set up what another runtime or tool could have left:

    <python> bpf_hook.py detach-all          # no program at all (a runtime whose policy is "allow all")
    <python> bpf_hook.py add-deny MAJ:MIN    # a second program (ALLOW_MULTI): deny c MAJ:MIN, allow the rest
    <python> bpf_hook.py record FILE         # write the attached program ids to FILE (JSON), change nothing

Reads the OCI state on stdin; works on /sys/fs/cgroup + the container's "0::" path, so it must
run where /sys/fs/cgroup is cgroup2 (runcbox.in_cgroup2).
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from nvhook.base import bpf  # noqa: E402


def deny_one(major: int, minor: int) -> bytes:
    return b"".join([
        bpf.ldx_w(2, 1, bpf.CTX_ACCESS_TYPE), bpf.and32_imm(2, 0xFFFF), bpf.ldx_w(4, 1, bpf.CTX_MAJOR),
        bpf.ldx_w(5, 1, bpf.CTX_MINOR),
        bpf.jne_imm(2, bpf.BPF_DEVCG_DEV_CHAR, 4), bpf.jne_imm(4, major, 3), bpf.jne_imm(5, minor, 2),
        bpf.mov64_imm(0, 0), bpf.exit_insn(),
        bpf.mov64_imm(0, 1), bpf.exit_insn()])


def main(argv: list[str]) -> int:
    state = json.loads(sys.stdin.read())
    with open(f"/proc/{state['pid']}/cgroup") as f:
        path = next(ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::"))
    cg = os.open("/sys/fs/cgroup" + path, os.O_RDONLY | os.O_DIRECTORY)
    if argv[0] == "record":
        with open(argv[1], "w") as f:
            json.dump(bpf.bpf_prog_query(cg)[1], f)
    elif argv[0] == "detach-all":
        _, ids = bpf.bpf_prog_query(cg)
        for i in ids:
            fd = bpf.bpf_prog_get_fd_by_id(i)
            bpf.bpf_prog_detach(cg, fd)
            os.close(fd)
    elif argv[0] == "add-deny":
        major, minor = (int(x) for x in argv[1].split(":"))
        fd = bpf.bpf_prog_load(bpf.BPF_PROG_TYPE_CGROUP_DEVICE, deny_one(major, minor), "GPL", name="test_deny",
                               expected_attach_type=bpf.BPF_CGROUP_DEVICE, log_size=1 << 14)
        bpf.bpf_prog_attach(cg, fd, bpf.BPF_CGROUP_DEVICE, bpf.BPF_F_ALLOW_MULTI)
    else:
        raise SystemExit(f"unknown action {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
