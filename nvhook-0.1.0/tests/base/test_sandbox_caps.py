"""The ctypes calls that replaced python-prctl (nvhook.base.sandbox), checked by what the kernel
reports in /proc/self/status of a forked child: capability sets, bounding set, no_new_privs;
and the parent-death signal, which every fsuid change clears, re-armed by setfsids."""

from __future__ import annotations

import ctypes
import os

import pytest
from hostfix import in_fork

from nvhook.base import sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (capabilities, setfsuid)")

PR_GET_PDEATHSIG = 2


def _status() -> dict:
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _pdeathsig() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    assert libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0) == 0
    return sig.value


def test_capabilities_bounding_set_and_no_new_privs():
    def child() -> str:
        keep = 1 << sandbox.CAP_DAC_OVERRIDE
        sandbox.drop_bounding_set(keep)
        sandbox.capset(keep, keep, 0)
        sandbox.set_no_new_privs()
        st = _status()
        return " ".join(f"{k}={st[k]}" for k in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb", "NoNewPrivs"))

    out = in_fork(child)
    assert out == ("CapEff=0000000000000002 CapPrm=0000000000000002 CapInh=0000000000000000 "
                   "CapBnd=0000000000000002 CapAmb=0000000000000000 NoNewPrivs=1"), out


def test_capset_cannot_raise_what_was_dropped():
    def child() -> str:
        sandbox.capset(0, 0, 0)
        try:
            sandbox.capset(1 << sandbox.CAP_DAC_OVERRIDE, 1 << sandbox.CAP_DAC_OVERRIDE, 0)
        except OSError as e:
            return f"refused {e.errno}"
        return "raised"

    assert in_fork(child) == "refused 1"  # EPERM


def test_setfsids_rearms_the_parent_death_signal():
    """The kernel clears PR_SET_PDEATHSIG on every fsuid/fsgid change: a child that changed
    them (to create files as a user-namespaced container's root) would outlive the hook."""
    def child() -> str:
        sandbox.set_pdeathsig(sandbox.SIGKILL)
        before = _pdeathsig()
        sandbox.setfsids(100000, 100000)
        as_owner = _pdeathsig()
        sandbox.setfsids(0, 0)
        return f"{before} {as_owner} {_pdeathsig()}"

    assert in_fork(child) == "9 9 9"
