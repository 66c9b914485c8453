"""Fixtures of the apply-step tests."""

from __future__ import annotations

import os
import subprocess

import pytest
from waiting import wait_until


@pytest.fixture
def holder():
    """A process in a mount namespace of its own (a copy of the test's, private): a container's
    stand-in for the apply step's namespace handling. Killed after the test."""
    # sleeps far longer than any test (a loaded machine stretches them): killed at the end
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "3600"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{proc.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"),
                   "unshare -m to give the holder its own mount namespace")
        yield proc
    finally:
        proc.kill()
        proc.wait()
