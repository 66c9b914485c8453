"""Helpers for the tests that start private container engines (test_docker, test_containerd)."""

from __future__ import annotations

import os
from pathlib import Path

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


