"""Hook mode as a client of nvhookd (resident mode, see nvhook/start/daemon/ and base/residentwire.py).

bin/nvhook enters here (`main`). When `[daemon] mode` is not "off" and nvhookd's socket
exists, the hook forwards the OCI state, its options and descriptors naming the container
process (a pidfd) and its own mount, pid and cgroup namespaces, then prints the daemon's stderr
lines and exits with its code: the warm daemon does all of the hook's work (the bundle, the
request rules, a container that asks for no GPU included) in a child forked per container, with
the hook's own code, and validates everything again there. Every other start continues in
nvhook.start.hook, handed what was learnt on the way (the config, the state read from stdin, why
nvhookd did not serve it).

So a start nvhookd serves imports only this module, base.config (to read the config's cache
entry: the socket, the mode, the timeout), base.errors, base.jsonfast and base.residentwire (os, time,
_socket, _json, stat); not nvhook.start.hook, the log, observe or decide (a test reads Python's import
log of a real start). A config that is not cached yet (its first start, a changed or broken
file, cache_dir = "") is read by nvhook.start.hook, which then asks nvhookd through `attempt` too.

Fallback: a daemon that is absent, refuses, is not root, answers another protocol or nvhook
version, or does not say `ready` within `[daemon] timeout` seconds costs at most that long;
the hook then runs in-process and logs one `daemon.fallback` event (debug level when the
socket does not exist in mode "auto": a host without nvhookd; a warning otherwise). With mode
"required" that is a failed start instead, unless the container asks for no GPU (it starts,
in-process, with the warning). Once the daemon has said `ready` and the client has said `go`,
the client never falls back: a daemon that dies or stalls after that is a failed start with one
line, not a second run of the hook's work. A hook in a user namespace (a rootless engine's),
which nvhookd never serves (its socket and peer are the host's root's), falls back at debug
level in every mode, "required" included.
"""

import os
import sys
import time

# The namespaces the hook's work depends on: paths (bundle, rootfs, /proc/<pid>), the pid in
# the OCI state, the cgroup paths of /proc/<pid>/cgroup. nvhookd must share all three.
NAMESPACES = ("mnt", "pid", "cgroup")
# Beyond the daemon's own limits for NVML and the ldconfig program (the apply step's grace
# included), how long a committed client waits for the result.
RESULT_SLACK_S = 45.0
# Hook mode's command line (nvhook.start.hook parses it with the same function): global options, an
# optional stage, --in-container-only (set by nvhook-runtime in the hook it writes into
# config.json: the runtime has already made the device nodes, their cgroup rules and the
# driver binds, so the hook does only what must happen inside the container) and --cdi CAPS
# (set by `nvhook cdi generate` in the spec's hook: the GPUs are the nodes the runtime put into
# config.json, and only the in-container part is done). nvhookd serves the SERVED_STAGES
# without --cdi; anything else is nvhook.start.hook's. LEVEL_NAMES are base.log.LEVELS' keys (a test
# keeps them equal; base.log is not imported here).
GLOBAL_OPTIONS = ("--config", "--root", "--log-file", "--log-level")
STAGES = ("prestart", "createRuntime", "createContainer")
SERVED_STAGES = ("prestart", "createRuntime")
IN_CONTAINER_ONLY = "--in-container-only"
CDI = "--cdi"
LEVEL_NAMES = ("debug", "info", "warning", "error")


def serve(opts: dict) -> tuple:
    """(exit code, None) when nvhookd served this start, else (None, what hook.run is to be
    handed). Called by nvhook.entry for the hook-mode forms nvhookd can serve (`servable`)."""
    try:
        return _try_daemon(opts)
    except KeyboardInterrupt:
        sys.stderr.write("nvhook: interrupted\n")
        return 130, None
    except Exception as e:  # a bug: one line, as start/hook.py's hook.crashed (no log here)
        sys.stderr.write(f"nvhook: internal error in the resident client: {type(e).__name__}: {e}\n")
        return 1, None


def servable(opts: dict) -> bool:
    """Whether nvhookd can stand in for this start: not the CDI hook (--cdi), not
    createContainer (both run in the container's namespaces, which the protocol does not carry)."""
    return opts["stage"] in SERVED_STAGES and "cdi" not in opts


def parse_hook_argv(argv: list, served: bool = False) -> "dict | None":
    """Hook mode's options; None when this is not hook mode (click reports what is wrong), and
    with `served`, also for the forms nvhookd cannot serve (--cdi, createContainer)."""
    opts: dict = {"stage": "prestart"}
    stage_seen = False
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a == IN_CONTAINER_ONLY:
            opts["in_container_only"] = True
        elif name in GLOBAL_OPTIONS or name == CDI:
            if served and name == CDI:
                return None  # a createContainer hook runs in the container's namespaces
            if not eq:
                if i + 1 >= len(argv):
                    return None
                value = argv[i + 1]
                i += 1
            if name == CDI:
                opts["cdi"] = value
                opts["in_container_only"] = True
            elif name == "--log-level" and value not in LEVEL_NAMES:
                return None
            else:
                opts[name[2:].replace("-", "_")] = value
        elif a in (SERVED_STAGES if served else STAGES) and not stage_seen:
            opts["stage"] = a
            stage_seen = True
        else:
            return None
        i += 1
    return opts


def _try_daemon(opts: dict) -> tuple:
    """(exit code, None) when nvhookd served this start; else (None, what nvhook.start.hook is to
    be handed: the config, the state once read, nvhookd's outcome once asked; or None)."""
    if sys.stdin is None or os.isatty(0):
        return None, None  # no stdin, or a person typed `nvhook`: nvhook.start.hook says what is wrong
    from ..base import config as config_mod

    cfg = config_mod.load_cached(opts.get("config"))
    if cfg is None:
        return None, None  # nvhook.start.hook reads the file (and caches it for the next start)
    handoff: dict = {"cfg": cfg}
    daemon = cfg["daemon"]
    if daemon["mode"] == "off" or daemon["mode"] == "auto" and not os.path.exists(daemon["socket"]):
        return None, handoff  # the in-process hook (which logs the debug-level fallback)
    state = sys.stdin.buffer.read(1 << 20)
    handoff["state"] = state
    outcome = attempt(opts, cfg, state)
    if outcome[0] == "served":
        return outcome[1], None
    handoff["daemon"] = outcome
    return None, handoff


def result_limit(cfg: dict) -> float:
    return float(cfg["nvml"]["timeout"] + cfg["ldconfig"]["timeout"] + RESULT_SLACK_S)


def attempt(opts: dict, cfg: dict, state: bytes) -> tuple:
    """Ask nvhookd to serve this start. One of:
      ("served", code)              it did: its stderr lines are printed, `code` is the hook's;
      ("unservable",)               the state names no live process, or no absolute bundle:
                                    the in-process hook reports it, in its words;
      ("fallback", fields)          not available: run in-process, log daemon.fallback with
                                    `fields` ("level" included);
      ("required", message, fields) not available with mode "required";
      ("failed", message, why)      it failed after `go`: a failed start, never retried (but
                                    for a container that asks for no GPU: see `settle`).
    """
    from .. import __version__

    daemon = cfg["daemon"]
    t0 = time.monotonic()
    pid = state_pid(state)
    if pid is None:
        return ("unservable",)
    fds: list = []
    s = None
    try:
        # Everything the request needs is ready before connecting: the daemon's child waits
        # for it from accept() on.
        try:
            fds.append(os.pidfd_open(pid))
            for ns in NAMESPACES:
                fds.append(os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
        except (OSError, OverflowError):  # a process already gone; a pid past pid_t
            return ("unservable",)
        from ..base import residentwire

        request = residentwire.encode({"v": residentwire.PROTOCOL, "nvhook": __version__, "opts": _forwarded(opts),
                               "env_config": _abs(os.environ.get("NVHOOK_CONFIG")), "state": state.decode()})
        try:
            s = residentwire.connect(daemon["socket"], daemon["timeout"])
        except FileNotFoundError:
            return _fallback(daemon, t0, "absent", "its socket does not exist")
        except ConnectionRefusedError:
            return _fallback(daemon, t0, "not-running", "nobody listens on its socket")
        except TimeoutError:
            return _fallback(daemon, t0, "busy", f"connecting took over {daemon['timeout']:g} s")
        except OSError as e:
            return _fallback(daemon, t0, "unreachable", f"cannot connect: {e.strerror or e}")
        _, uid = residentwire.peer_uid(s)
        if uid != 0:  # whoever answers gets our descriptors and decides our exit code
            return _fallback(daemon, t0, "not-root", f"its socket is served by uid {uid}, not root")
        deadline = t0 + daemon["timeout"]
        try:
            residentwire.send(s, request, fds)
            answer, _ = residentwire.recv(s, deadline, time.monotonic)
        except (OSError, residentwire.ResidentWireError) as e:
            return _fallback(daemon, t0, "no-answer", f"no ready within {daemon['timeout']:g} s ({e})")
        theirs = f"nvhookd {answer.get('nvhook')!s} (protocol {answer.get('v')!s})"
        if answer.get("v") != residentwire.PROTOCOL or answer.get("nvhook") != __version__:
            return _fallback(daemon, t0, "version", f"{theirs} does not match this hook, nvhook {__version__} "
                             f"(protocol {residentwire.PROTOCOL}): restart nvhookd",
                             daemon_version=answer.get("nvhook"))
        if "refused" in answer:
            return _fallback(daemon, t0, "refused", f"{theirs} refused: {answer['refused']}")
        if answer.get("ready") is not True:
            return _fallback(daemon, t0, "protocol", f"{theirs} sent an unexpected answer")
        return _go(s, cfg, t0)
    finally:
        if s is not None:
            s.close()
        for fd in fds:
            os.close(fd)


def _go(s, cfg: dict, t0: float) -> tuple:
    """nvhookd said `ready`: tell it to go, and wait for its result (attempt's "served" or
    "failed"). Committed: from here on the daemon may be applying; a failure is this start's
    failure."""
    from ..base import residentwire

    daemon = cfg["daemon"]
    try:
        try:
            residentwire.send(s, {"go": True})
        except OSError:
            pass  # a container with nothing to apply: nvhookd may have answered and closed already
        result, _ = residentwire.recv(s, time.monotonic() + result_limit(cfg), time.monotonic)
        code = result["code"]
        text = result.get("stderr") or ""
        if not isinstance(code, int) or not isinstance(text, str):
            raise residentwire.ResidentWireError("malformed result")
    except (OSError, residentwire.ResidentWireError, KeyError) as e:
        why = f"nvhookd failed while serving this container ({e})"
        return ("failed", f"{why}; not retried in-process, since it may have applied part of the driver "
                          f"(see nvhookd's log)",
                {"level": "warning", "cause": "failed", "socket": daemon["socket"],
                 "waited_ms": round((time.monotonic() - t0) * 1000, 2),
                 "reason": f"{why}; the container asks for no GPU, so it runs in-process"})
    if text:
        _write_stderr(text)
    return ("served", code)


def settle(outcome: tuple, state: bytes, cfg: dict, fallback: dict) -> "int | None":
    """In nvhook.start.hook: the hook's exit code when nvhookd served the start; None when the hook
    runs in-process (with the fields of the daemon.fallback event to log in `fallback`, if
    any). Raises HookError for a failure after `go` and for mode "required", unless the
    container asks for no GPU: such a start always starts, and nvhookd applies nothing for it
    (no mount, no device node), so running it in-process cannot apply anything twice."""
    from ..base.errors import HookError

    kind = outcome[0]
    if kind == "served":
        code: int = outcome[1]
        return code
    if kind == "fallback":
        fallback.update(outcome[1])
    elif kind == "failed":
        if not asks_for_nothing(state, cfg):
            raise HookError(outcome[1])
        fallback.update(outcome[2])
    elif kind == "required":
        if not asks_for_nothing(state, cfg):
            raise HookError(outcome[1])
        fallback.update(outcome[2], reason=f"{outcome[1]}; the container asks for no GPU, so it runs in-process")
    return None


def asks_for_nothing(state: bytes, cfg: dict) -> bool:
    """True when the container asks for no GPU (decide.request, the rule nvhookd applies) or its
    state or bundle is broken (the in-process hook reports that in its own words)."""
    from ..base.errors import HookError
    from ..decide import request as request_mod
    from ..observe import oci

    try:
        bundle = oci.load_bundle(oci.parse_state(state)["bundle"])
        req = request_mod.parse(bundle["env"], privileged=bundle["privileged"], mounts=bundle["mounts"],
                                config=cfg, annotations=bundle["annotations"])
    except HookError:
        return True
    return req["kind"] == "skip"


def state_pid(state: bytes) -> "int | None":
    """The container's pid, when the state is one nvhookd can serve exactly as the hook would:
    UTF-8 JSON with a pid and an absolute bundle path (a relative one would be resolved
    against the daemon's working directory, not the runtime's)."""
    from ..base import jsonfast as json

    try:  # bytes that are not UTF-8 JSON: the in-process path reports them
        data = json.loads(state)
        pid = data.get("pid")
        bundle = data.get("bundle") or data.get("bundlePath") or data.get("root")
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        return None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None


def _forwarded(opts: dict) -> dict:
    """The hook's own command line, as nvhookd's child will run it: paths made absolute here,
    where a relative one means what the runtime meant (the daemon has another directory)."""
    out = {k: opts[k] for k in ("log_level", "stage", "in_container_only") if k in opts}
    for k in ("config", "root", "log_file"):
        if k in opts:
            out[k] = os.path.abspath(opts[k]) if opts[k] else opts[k]
    if out.get("root") == "":
        del out["root"]  # `--root=` means the config's root (pipeline.root_from), as no --root does
    return out


def _abs(path: "str | None") -> "str | None":
    return os.path.abspath(path) if path else path


def _fallback(daemon: dict, t0: float, cause: str, why: str, **fields) -> tuple:
    from ..base import userns  # here, not on the path nvhookd serves

    # A rootless engine's hook: nvhookd serves the host's root only (its socket is root's, its
    # peer must be uid 0), so whatever the mode says this is no fault to warn about or refuse.
    rootless = userns.namespaced()
    quiet = rootless or (cause == "absent" and daemon["mode"] == "auto")  # absent: a host without nvhookd
    if rootless:
        why = f"this hook runs in a user namespace (a rootless engine), which nvhookd does not serve ({why})"
    out = dict(level="debug" if quiet else "warning", cause=cause, socket=daemon["socket"],
               reason=f"nvhookd not used: {why}; running in-process",
               waited_ms=round((time.monotonic() - t0) * 1000, 2), **fields)
    if daemon["mode"] == "required" and not rootless:
        return ("required", f"nvhookd is required ([daemon] mode) but {why} (socket {daemon['socket']})", out)
    return ("fallback", out)


def _write_stderr(text: str) -> None:
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        pass
