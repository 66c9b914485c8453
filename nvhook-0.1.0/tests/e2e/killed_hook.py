"""A prestart hook for the cgroup tests: nvhook's hook mode, SIGKILLed at its first
bpf(BPF_PROG_ATTACH), before the call reaches the kernel.

    <python> killed_hook.py REPORT NVHOOK-ARGS...

nvhook runs in a child process whose `nvhook.base.bpf.bpf_prog_attach` kills the process
itself (a real SIGKILL: no handler, no cleanup, as when a runtime's hook timeout or the OOM
killer strikes). This wrapper then writes the child's exit code (-9 when it was killed there)
to REPORT and exits 0, so that runc goes on starting the container: what the container can
open then is exactly what the killed hook left behind on its cgroup.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> int:
    report, hook_args = argv[0], argv[1:]
    pid = os.fork()
    if pid == 0:
        try:
            sys.path.insert(0, REPO)
            from nvhook.base import bpf
            from nvhook.entry import main as nvhook_main

            def attach(*args, **kwargs):
                os.kill(os.getpid(), 9)

            bpf.bpf_prog_attach = attach
            os._exit(nvhook_main(hook_args))
        finally:
            os._exit(70)
    _, status = os.waitpid(pid, 0)
    with open(report, "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
