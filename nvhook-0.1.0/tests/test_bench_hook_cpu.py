"""`make bench BENCH_ARGS=--hook-cpu` (bench/bench.py): the hook-alone measure runs nvhook for
real against a stand-in container (a process in a private mount namespace and a device cgroup
of its own), reports every case, and leaves no cgroup behind. The side by side with NVIDIA's
hook needs its build (--reference), which CI does not have."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CASES = ["1 GPU, compute,utility", "8 GPUs, compute,utility", "8 GPUs, all capabilities",
         "8x7 MIG (112 cap devices), compute,utility", "not a GPU container"]


def _bench_cgroups(pid: int) -> list[Path]:
    """The cgroups bench.py made as process `pid` (its own: other sessions may bench meanwhile)."""
    roots = [Path("/sys/fs/cgroup/devices"), Path("/sys/fs/cgroup")]
    return [r / f"nvhook-bench-{pid}" for r in roots if (r / f"nvhook-bench-{pid}").exists()]


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare starts the stand-in container")
def test_hook_cpu_mode_measures_every_case_and_cleans_up(tmp_path):
    out = tmp_path / "out.json"
    bench = subprocess.Popen([sys.executable, str(REPO / "bench" / "bench.py"), "--hook-cpu", "-n", "2", "--json",
                              str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=600)
    finally:
        bench.kill()
        bench.wait()
    p = subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert [c[0] for c in data["cases"]] == CASES
    for name in CASES:
        xs = data["cpu"][f"nvhook: {name}"]
        assert len(xs) == 2 and all(x > 1 for x in xs)  # a real interpreter start each, at least
        assert f"  {name}" in p.stdout
    # a GPU start costs more than the early return of a container that asks for none
    assert min(data["cpu"]["nvhook: 1 GPU, compute,utility"]) > max(data["cpu"]["nvhook: not a GPU container"])
    assert "112 MIG cap devices / 1 GPU" in p.stdout
    assert _bench_cgroups(bench.pid) == []
