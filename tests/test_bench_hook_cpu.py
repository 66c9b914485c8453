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


def _run_bench(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    bench = subprocess.Popen([sys.executable, str(REPO / "bench" / "bench.py"), "--hook-cpu", "-n", "2", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = bench.communicate(timeout=600)
    finally:
        bench.kill()
        bench.wait()
    return subprocess.CompletedProcess(bench.args, bench.returncode, stdout, stderr), bench.pid


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare starts the stand-in container")
def test_hook_cpu_compare_runs_the_other_tree_in_the_same_rounds(tmp_path):
    """--hook-cpu --compare TREE: the other checkout's hook runs in every round beside this
    one's, and each case gets its ratio with an interval."""
    out = tmp_path / "out.json"
    p, pid = _run_bench("--compare", str(REPO), "--json", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert [c[3] for c in data["cases"]] == [f"compare: {name}" for name in CASES]
    for name in CASES:
        assert len(data["cpu"][f"compare: {name}"]) == 2 and all(x > 1 for x in data["cpu"][f"compare: {name}"])
        s = data["summary"][name]
        assert s["compare_ci95"][0] <= s["compare_ratio"] <= s["compare_ci95"][1]
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(f"  {name} "))
        assert " compare " in line and " ratio " in line
    assert _bench_cgroups(pid) == []


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare starts the stand-in container")
def test_hook_cpu_compare_runs_that_trees_code(tmp_path):
    """The B side is the other checkout's code, not this tree's: a checkout whose hook exits
    3 stops the bench with that exit and its message."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "bin", tree / "bin")
    shutil.copytree(REPO / "nvhook", tree / "nvhook", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "nvhook" / "entry.py").write_text(
        "import sys\n\n\ndef main(argv=None):\n    sys.stderr.write('the other tree ran\\n')\n    return 3\n")
    p, pid = _run_bench("--compare", str(tree))
    assert p.returncode != 0
    assert "compare-nvhook: exit 3: the other tree ran" in p.stderr
    assert _bench_cgroups(pid) == []
