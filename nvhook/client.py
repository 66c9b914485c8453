"""Hook mode as a client of nvhookd (resident mode, see nvhook/daemon.py and base/wire.py).

When `[daemon] mode` is not "off" and nvhookd's socket answers, the hook forwards the OCI
state, its options and descriptors naming the container process (a pidfd) and its own mount,
pid and cgroup namespaces, then prints the daemon's stderr lines and exits with its code: the
warm daemon does the hook's work in a child forked per container, with the hook's own code.

On the start path, so import-light: os, time, _socket and _json (through base.wire).

Fallback: a daemon that is absent, refuses, is not root, answers another protocol or nvhook
version, or does not say `ready` within `[daemon] timeout` seconds costs at most that long;
the hook then runs in-process and logs one `daemon.fallback` event (debug level when the
socket does not exist in mode "auto": a host without nvhookd; a warning otherwise). With mode
"required" that is a failed start instead. Once the daemon has said `ready` and the client
has said `go`, the client never falls back: a daemon that dies or stalls after that is a failed
start with one line, not a second run of the hook's work.
"""

from __future__ import annotations

import os
import time

from .base import wire
from .base.errors import HookError

# The namespaces the hook's work depends on: paths (bundle, rootfs, /proc/<pid>), the pid in
# the OCI state, the cgroup paths of /proc/<pid>/cgroup. nvhookd must share all three.
NAMESPACES = ("mnt", "pid", "cgroup")
# Beyond the daemon's own limits for NVML and the ldconfig program (the apply step's grace
# included), how long a committed client waits for the result.
RESULT_SLACK_S = 45.0


def result_limit(cfg: dict) -> float:
    return cfg["nvml"]["timeout"] + cfg["ldconfig"]["timeout"] + RESULT_SLACK_S


def serve(opts: dict, cfg: dict, state: bytes, version: str, fallback: dict) -> int | None:
    """The hook's exit code when nvhookd served this container (its stderr lines printed),
    None when the hook must run in-process; then `fallback` holds the fields of the
    daemon.fallback event to log, if any (its "level" included). Raises HookError for a
    failure after the daemon took the request, and for any unavailability with mode
    "required"."""
    daemon = cfg["daemon"]
    t0 = time.monotonic()
    pid = _state_pid(state)
    if pid is None:
        return None  # the in-process path reports what is wrong with the state
    fds: list[int] = []
    s = None
    try:
        try:
            s = wire.connect(daemon["socket"], daemon["timeout"])
        except FileNotFoundError:
            return _fallback(fallback, daemon, t0, "absent", "its socket does not exist")
        except ConnectionRefusedError:
            return _fallback(fallback, daemon, t0, "not-running", "nobody listens on its socket")
        except TimeoutError:
            return _fallback(fallback, daemon, t0, "busy", f"connecting took over {daemon['timeout']:g} s")
        except OSError as e:
            return _fallback(fallback, daemon, t0, "unreachable", f"cannot connect: {e.strerror or e}")
        _, uid = wire.peer_uid(s)
        if uid != 0:  # whoever answers gets our descriptors and decides our exit code
            return _fallback(fallback, daemon, t0, "not-root", f"its socket is served by uid {uid}, not root")
        try:
            fds.append(os.pidfd_open(pid))
            for ns in NAMESPACES:
                fds.append(os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None  # a process already gone: the in-process path says so in its words
        deadline = t0 + daemon["timeout"]
        try:
            wire.send(s, {"v": wire.PROTOCOL, "nvhook": version, "opts": _forwarded(opts),
                          "env_config": _abs(os.environ.get("NVHOOK_CONFIG")), "state": state.decode()},
                          fds)
            answer, _ = wire.recv(s, deadline, time.monotonic)
        except (OSError, wire.WireError) as e:
            return _fallback(fallback, daemon, t0, "no-answer", f"no ready within {daemon['timeout']:g} s ({e})")
        theirs = f"nvhookd {answer.get('nvhook')!s} (protocol {answer.get('v')!s})"
        if answer.get("v") != wire.PROTOCOL or answer.get("nvhook") != version:
            return _fallback(fallback, daemon, t0, "version", f"{theirs} does not match this hook, nvhook {version} "
                             f"(protocol {wire.PROTOCOL}): restart nvhookd", daemon_version=answer.get("nvhook"))
        if "refused" in answer:
            return _fallback(fallback, daemon, t0, "refused", f"{theirs} refused: {answer['refused']}")
        if answer.get("ready") is not True:
            return _fallback(fallback, daemon, t0, "protocol", f"{theirs} sent an unexpected answer")
        # Committed: from here on the daemon may be applying; a failure is this start's failure.
        try:
            try:
                wire.send(s, {"go": True})
            except OSError:
                pass  # a container with nothing to apply: nvhookd may have answered and closed already
            result, _ = wire.recv(s, time.monotonic() + result_limit(cfg), time.monotonic)
            code = result["code"]
            text = result.get("stderr") or ""
            if not isinstance(code, int) or not isinstance(text, str):
                raise wire.WireError("malformed result")
        except (OSError, wire.WireError, KeyError) as e:
            raise HookError(f"nvhookd failed while serving this container ({e}); not retried in-process, "
                            f"since it may have applied part of the driver (see nvhookd's log)") from None
        if text:
            _write_stderr(text)
        return code
    finally:
        if s is not None:
            s.close()
        for fd in fds:
            os.close(fd)


def asks_for_nothing(state: bytes, cfg: dict) -> bool:
    """True when the in-process hook answers this start at once: the container asks for no
    GPU (decide.request, the same rule nvhookd would apply) or its state or bundle is broken
    (reported in-process, in the same words). Such a start costs less here than a round trip
    to nvhookd; only containers that need the driver go there."""
    from .base.errors import HookError
    from .decide import request as request_mod
    from .observe import oci

    try:
        bundle = oci.load_bundle(oci.parse_state(state)["bundle"])
        req = request_mod.parse(bundle["env"], privileged=bundle["privileged"], mounts=bundle["mounts"],
                                config=cfg, annotations=bundle["annotations"])
    except HookError:
        return True
    return req["kind"] == "skip"


def _state_pid(state: bytes) -> int | None:
    """The container's pid, when the state is one nvhookd can serve exactly as the hook would:
    UTF-8 JSON with a pid and an absolute bundle path (a relative one would be resolved
    against the daemon's working directory, not the runtime's)."""
    from .base import jsonfast as json

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
    return out


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else path


def _fallback(out: dict, daemon: dict, t0: float, cause: str, why: str, **fields) -> int | None:
    """Describe the fallback in `out` (or fail with mode "required"); None: run in-process."""
    if daemon["mode"] == "required":
        raise HookError(f"nvhookd is required ([daemon] mode) but {why} (socket {daemon['socket']})")
    quiet = cause == "absent" and daemon["mode"] == "auto"  # a host without nvhookd: the usual case
    out.update(level="debug" if quiet else "warning", cause=cause, socket=daemon["socket"],
               reason=f"nvhookd not used: {why}; running in-process",
               waited_ms=round((time.monotonic() - t0) * 1000, 2), **fields)
    return None


def _write_stderr(text: str) -> None:
    import sys

    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        pass
