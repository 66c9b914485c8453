"""nvhookd keeps nvhook's CDI spec ([cdi] spec) current while idle, as nvhook-cdi.path and
nvhook-cdi.timer do without a daemon: the spec is regenerated (start/cdispecs.py) when it no
longer matches the host.
"""

from __future__ import annotations

import os
import time

from ...base.errors import HookError
from ...base.log import EventLog

# The CDI spec is compared with the host in full at least this often (as nvhook-cdi.timer
# does), for the changes the driver identity does not see (a library deleted by hand).
CDI_FULL_CHECK_S = 600.0


class CdiRefresh:
    """When to look at the spec again, and what the last look saw."""

    def __init__(self, cfg: dict, root: str, log: EventLog):
        self.cfg = cfg
        self.root = root
        self.log = log
        self.interval = float(cfg["daemon"]["cdi_refresh_interval"])  # 0: never
        self.checked = 0.0  # monotonic time of the last look; 0: look once idle after start
        self.driver: list | None = None  # cdispecs.driver_identity at the last spec refresh
        self.full = 0.0  # monotonic time of the last full comparison of spec and host

    def due(self) -> bool:
        return bool(self.interval) and time.monotonic() - self.checked > self.interval

    def check(self) -> None:
        """Regenerate the spec if it no longer matches the host: looked at when the driver
        identity (a few reads) differs from the last refresh's, at the first look after start,
        and every CDI_FULL_CHECK_S. Runs while idle; the spares already forked keep serving
        container starts meanwhile. A failure is logged and tried again at the next change,
        never fatal to the daemon. The caller writes the events out."""
        self.checked = time.monotonic()
        path = self.cfg["cdi"]["spec"]
        if not path or not os.path.isfile(path):
            return  # no spec: not even the CDI code is loaded
        from .. import cdispecs
        identity = cdispecs.driver_identity(self.root)
        if identity == self.driver and time.monotonic() - self.full < CDI_FULL_CHECK_S:
            return
        self.full = time.monotonic()
        t = time.perf_counter()
        try:
            r = cdispecs.refresh(self.cfg, self.root, self.log, path)
        except Exception as e:  # a spec edited into a shape nvhook never writes, too: never fatal
            self.driver = identity  # the same failure would repeat every interval
            error = e.message if isinstance(e, HookError) else f"not a spec nvhook writes ({type(e).__name__}: {e})"
            self.log.error("daemon.cdi_refresh_failed", spec=path, error=error,
                           message=f"CDI spec {path} could not be regenerated: {error}")
            return
        self.driver = identity
        ms = round((time.perf_counter() - t) * 1000, 2)
        if r is None:
            self.log.debug("daemon.cdi_not_ours", spec=path, reason="not written by nvhook: left alone")
        elif r["changed"]:
            self.log.info("daemon.cdi_refreshed", spec=path, devices=r["devices"], differences=r["differences"],
                          refresh_ms=ms, message=f"CDI spec {path} regenerated: the host changed "
                                                f"({len(r['differences'])} differences; {r['devices']} devices)")
        else:
            self.log.debug("daemon.cdi_current", spec=path, devices=r["devices"], refresh_ms=ms)
