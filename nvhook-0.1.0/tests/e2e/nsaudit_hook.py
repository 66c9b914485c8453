"""A prestart hook for the security tests: nvhook's hook mode as bin/nvhook starts it (the
start-path bundle's finder first), under a Python audit hook that reports, as JSON lines to
REPORT, every import and every path-based file operation made while the process is in a mount
namespace other than the one it started in (the container's, entered by the in-process apply
step), and how the run left the process.

    <python> nsaudit_hook.py REPORT [--fail-in-container WHAT] [--grace S] NVHOOK-ARGS...

--fail-in-container raises, inside the container's namespace, in the mount step: "hook" a
HookError, "oserror" an OSError, "bug" a ValueError (nvhook's crash path); or "alarm": the
apply step's time limit (SIGALRM) is reached as the return to nvhook's own namespace begins
(the signal is raised just before that setns). --grace sets the apply step's grace periods (past
ldconfig's timeout; past that before SIGKILL) to S seconds.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WATCHED = {"import", "open", "os.listdir", "os.scandir", "os.chdir", "os.mkdir", "os.rename", "os.remove",
           "os.symlink", "os.link", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.rmdir",
           "socket.sendto", "socket.connect", "shutil.copyfile", "os.exec", "os.posix_spawn", "subprocess.Popen"}


def main(argv: list[str]) -> int:
    report = os.open(argv[0], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    args = argv[1:]
    fail = grace = None
    while args[:1] in (["--fail-in-container"], ["--grace"]):
        if args[0] == "--grace":
            grace = int(args[1])
        else:
            fail = args[1]
        args = args[2:]
    home = os.stat("/proc/self/ns/mnt").st_ino
    busy = [False]

    def out(obj: dict) -> None:
        import json  # imported below, before anything runs: never here for the first time

        os.write(report, (json.dumps(obj, default=repr) + "\n").encode())

    def audit(event: str, eargs: tuple) -> None:
        if busy[0] or event not in WATCHED:
            return
        busy[0] = True
        try:
            if os.stat("/proc/self/ns/mnt").st_ino != home:
                what = eargs[0] if eargs else None
                if event == "open" and not isinstance(what, (str, bytes)):
                    return  # an fd (os.fdopen): no path resolved
                out({"event": event, "arg": what if isinstance(what, (str, bytes, int)) else repr(what)})
        finally:
            busy[0] = False

    import json  # noqa: F401 - loaded for out()

    sys.path.insert(0, REPO)
    import nvhook
    from nvhook.base import modbundle

    modbundle.install(nvhook.__path__[0])
    if grace is not None:
        from nvhook import apply

        apply.CHILD_GRACE_S = apply.KILL_GRACE_S = grace
    if fail is not None:
        from nvhook.apply import child
        from nvhook.base import sandbox
        from nvhook.base.errors import HookError

        real_setns = sandbox.setns

        def setns(fd: int, nstype: int, *, what: str = "namespace") -> None:
            if what == "nvhook's own mnt":
                os.kill(os.getpid(), 14)  # SIGALRM: its Python handler runs as this call returns
            real_setns(fd, nstype, what=what)

        def failing(*a, **k):
            if fail == "hook":
                raise HookError("injected failure in the container's namespace")
            if fail == "oserror":
                raise OSError(5, "Input/output error")
            raise ValueError("injected bug in the container's namespace")

        if fail == "alarm":
            sandbox.setns = setns
        elif fail in ("hook", "oserror", "bug"):
            child.apply_mounts = failing
        else:
            raise AssertionError(fail)
    sys.addaudithook(audit)
    sys.argv = ["nvhook", *args]
    from nvhook.entry import main as entry_main

    real_exit = os._exit

    def exit_(code: int) -> None:  # hook mode ends in os._exit: the last record first
        busy[0] = True
        out({"exit": code, "home": os.stat("/proc/self/ns/mnt").st_ino == home})
        real_exit(code)

    os._exit = exit_
    return entry_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
