"""Many containers starting at once, each through the real nvhook prestart hook under runc.

32 `runc run` in parallel (one thread each, one bundle and container id each) against ONE host
fixture (host-gpu8, read-only), ONE log file and ONE inventory cache directory that starts
empty, so the hooks race to build and store the cache. Each container asks for GPU i % 8 and
lists what it got. What must hold:

  - every container starts and sees exactly its own GPU: /dev/nvidia<minor> and
    /proc/driver/nvidia/gpus/<bus id> of GPU i % 8, no other;
  - the shared log holds every event of every hook as complete JSON lines: each line parses,
    one hook.start and one hook.done per container, from 32 different nvhook processes;
  - the cache ends up valid (one file, no temporary leftovers), and nothing is mounted on the host.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostfix import copy_host, fx, mf, private_dir, spec, write_config  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402

pytestmark = [pytest.mark.runc, pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")]

N = 32
HOST = "host-gpu8"
GPUS = spec(HOST).gpus
# The whole batch: on an idle 2-core machine it takes a few seconds; the bound is there for a
# deadlock (hooks waiting on each other for good), so it leaves room for a loaded machine.
TIME_LIMIT_S = 180

SCRIPT = "echo DEV $(ls /dev); echo GPUS $(ls /proc/driver/nvidia/gpus)"


def _check_started(results, wave: str) -> None:
    """Every container started and saw exactly its own GPU."""
    for i, (proc, _) in enumerate(results):
        assert proc.returncode == 0, (wave, i, proc.stderr)
        g = GPUS[i % len(GPUS)]
        out = dict(line.split(" ", 1) if " " in line else (line, "") for line in proc.stdout.splitlines())
        devs = out["DEV"].split()
        gpu_nodes = sorted(d for d in devs if d.startswith("nvidia") and d[6:].isdigit())
        assert gpu_nodes == [f"nvidia{g.minor}"], (wave, i, devs)
        assert "nvidiactl" in devs and "nvidia-uvm" in devs, (wave, i, devs)
        assert out["GPUS"].split() == [g.bus_id], (wave, i, out["GPUS"])


def _parse_log(log: Path) -> list[dict]:
    """Every line of the shared log must be one complete JSON event (none cut or interleaved)."""
    assert log.read_bytes().endswith(b"\n")
    evs = rb.read_events(log)
    for ev in evs:
        assert isinstance(ev, dict) and {"ts", "level", "event", "nvhook_pid"} <= ev.keys(), ev
    return evs


def test_32_containers_in_parallel_share_host_log_and_cache(fx, tmp_path):
    host = fx / HOST
    cache = private_dir(tmp_path / "cache")
    assert list(cache.iterdir()) == []  # the first hooks race to build the inventory
    log = tmp_path / "nvhook.log"
    conf = write_config(tmp_path / "hook.toml", cache_dir=cache, log_file=str(log), log_level="debug")
    state_root = tmp_path / "runc-state"

    bundles = []
    for i in range(N):
        rootfs = copy_host(fx, "container-debian", tmp_path / f"rootfs{i}")
        cfg = mf.oci_config(str(rootfs), [mf.BUNDLE_ENV[0], f"NVIDIA_VISIBLE_DEVICES={i % len(GPUS)}",
                                          "NVIDIA_DRIVER_CAPABILITIES=compute,utility"])
        cfg["process"]["args"] = ["sh", "-c", SCRIPT]
        bundles.append(rb.nvhook_bundle(tmp_path / f"bundle{i}", cfg,
                                        ["--config", str(conf), "--root", str(host)]))
    mounts_before = rb.mount_table()

    def wave(name: str) -> tuple[list, list[str], float]:
        cids = [f"nvhook-{name}-{os.getpid()}-{i}" for i in range(N)]

        def start(i: int):
            t = time.monotonic()
            proc = rb.runc_run(bundles[i], state_root, timeout=TIME_LIMIT_S, cid=cids[i])
            return proc, time.monotonic() - t

        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=N) as pool:  # all 32 at once: real parallelism
            results = list(pool.map(start, range(N)))
        elapsed = time.monotonic() - t0
        assert elapsed < TIME_LIMIT_S, f"{N} parallel starts ({name}) took {elapsed:.1f} s"
        _check_started(results, name)
        return results, cids, elapsed

    # Wave 1: empty cache, every hook may build and store the inventory at the same time.
    cold, cold_ids, cold_s = wave("cold")
    # Wave 2: the same bundles restarted (placeholders from wave 1 reused), cache now warm:
    # concurrent readers of the file the first wave raced to write.
    warm, warm_ids, warm_s = wave("warm")

    # -- the shared log: complete JSON lines, every event of every hook ------------------------
    evs = _parse_log(log)
    by_event = Counter(e["event"] for e in evs)
    assert by_event["hook.start"] == 2 * N and by_event["hook.done"] == 2 * N, by_event
    assert by_event["hook.failed"] == by_event["hook.crashed"] == 0, by_event
    by_pid: dict[int, list[dict]] = {}
    for e in evs:
        by_pid.setdefault(e["nvhook_pid"], []).append(e)
    assert len(by_pid) == 2 * N  # one nvhook process per container start
    for pid, mine in by_pid.items():
        names = [e["event"] for e in mine]
        # each hook's events land together and in order: collected, then flushed at the end
        assert names[0] == "hook.start" and names[-1] == "hook.done", (pid, names)
        assert names.count("hook.start") == names.count("hook.done") == names.count("apply.done") == 1
    for name, cids in (("cold", cold_ids), ("warm", warm_ids)):
        for i, cid in enumerate(cids):
            done = [e for e in evs if e["event"] == "hook.done" and e.get("container") == cid]
            assert len(done) == 1, (cid, len(done))
            gpu_nodes = [m for m in done[0]["mounted"] if m.startswith("/dev/nvidia") and m[11:].isdigit()]
            assert gpu_nodes == [f"/dev/nvidia{GPUS[i % len(GPUS)].minor}"], (cid, gpu_nodes)
            inv = [e["event"] for e in evs if e.get("container") == cid
                   and e["event"] in ("inventory.built", "inventory.cache_hit")]
            assert len(inv) == 1, (cid, inv)
            if name == "warm":
                assert inv == ["inventory.cache_hit"], (cid, inv)
    built = by_event["inventory.built"]
    assert 1 <= built <= N and by_event["inventory.cache_hit"] == 2 * N - built, by_event

    # -- the cache survived the race: one valid file, no temporary leftovers -----------------
    left = sorted(p.name for p in cache.iterdir())
    assert len(left) == 1 and not left[0].startswith("."), left
    from nvhook.observe.host import cache as cache_mod

    assert cache_mod.load(str(cache), str(host)) is not None

    # -- nothing mounted on the host ---------------------------------------------------------
    assert rb.leaked_mounts(mounts_before, tmp_path) == []
    print(f"{N} containers: cold cache {cold_s:.2f} s (inventory built {built}x), warm {warm_s:.2f} s; "
          f"slowest start {max(t for _, t in cold + warm):.2f} s; {len(evs)} log lines")
