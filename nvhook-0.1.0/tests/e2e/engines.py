"""Helpers for the tests that start private container engines (test_docker, test_containerd):
the recorder runtimes, the wait for a daemon to answer, and its stop that leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable

import runcbox as rb

# Runs in place of nvhook-runtime (Docker's runtime "nvhook-rec", ctr's --runc-binary): saves config.json as the engine
# wrote it (before/) and as nvhook-runtime left it (after/, through NVHOOK_RUNTIME), so that a
# test can compare the two bytes for bytes.
RECORDER = """#!/bin/sh
prev=; bundle=; cmd=
for a in "$@"; do
  [ "$prev" = --bundle ] && bundle=$a
  case $a in create|run) [ -z "$cmd" ] && cmd=$a;; esac
  prev=$a
done
if [ -n "$cmd" ] && [ -n "$bundle" ]; then cp "$bundle/config.json" "{rec}/{stage}/$(basename "$bundle")"; fi
{tail}
"""


def pids_using(path: Path) -> list[int]:
    """Processes whose command line names `path`: what an engine started from our temp dir."""
    out = []
    needle = str(path).encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if needle in f.read():
                    out.append(int(d))
        except OSError:
            pass
    return out




def write_recorders(rec: Path, before: Path, after: Path, wrapper: Path) -> None:
    """`before` (the engine's runtime) saves config.json to rec/before/ and runs `wrapper`
    (nvhook-runtime) with `after` as its runtime, which saves it to rec/after/ and runs runc."""
    for stage in ("before", "after"):
        (rec / stage).mkdir(parents=True)
    after.write_text(RECORDER.format(rec=rec, stage="after", tail='exec runc "$@"'))
    before.write_text(RECORDER.format(rec=rec, stage="before", tail=f'NVHOOK_RUNTIME={after} exec {wrapper} "$@"'))
    after.chmod(0o755)
    before.chmod(0o755)


def recorded(rec: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """What the recorders saved, by bundle name: config.json as the engine wrote it, and as
    nvhook-runtime handed it to runc."""
    before, after = ({f.name: f.read_bytes() for f in (rec / stage).iterdir()} for stage in ("before", "after"))
    return before, after


def wait_answering(name: str, proc: subprocess.Popen, answers: Callable[[], bool], log: Path,
                   timeout: float = 180) -> None:
    """Until the daemon `proc` answers (its start is slow on a loaded machine: a generous
    deadline); its log's tail if it exits first or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited: {log.read_text()[-2000:]}")
        try:
            if answers():
                return
        except subprocess.TimeoutExpired:
            pass  # listening, not answering yet
        time.sleep(0.2)
    raise AssertionError(f"{name} not ready after {timeout:g} s: {log.read_text()[-2000:]}")


def stop_daemon(proc: subprocess.Popen, out: IO[bytes], tmp: Path) -> None:
    """SIGTERM the daemon (its process group SIGKILLed after 30 s), then SIGKILL whatever still
    runs from `tmp` (shims, containers: ours) and unmount what is left under it, deepest first."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    out.close()
    for pid in pids_using(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for m in sorted(rb.host_mounts_under(tmp), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], capture_output=True, timeout=30)


@contextmanager
def engine_dir(prefix: str) -> Iterator[Path]:
    """A private /tmp/<prefix>-XXXXXXXX for one engine (short: unix socket paths are limited);
    afterwards no process may run from it and nothing stay mounted under it, and it is removed."""
    tmp = Path(f"/tmp/{prefix}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
    finally:
        leftovers = pids_using(tmp), rb.host_mounts_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert leftovers == ([], []), leftovers
