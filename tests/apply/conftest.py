"""Fixtures of the apply-step tests."""

from __future__ import annotations

import os
import subprocess
import time

import pytest


@pytest.fixture
def holder():
    """A process in a mount namespace of its own (a copy of the test's, private): a container's
    stand-in for the apply step's namespace handling. Killed after the test."""
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "30"])
    try:
        for _ in range(200):  # unshare has exec'd sleep: the holder is in its own namespace now
            if os.readlink(f"/proc/{proc.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("unshare -m did not give the holder its own mount namespace")
        yield proc
    finally:
        proc.kill()
        proc.wait()
