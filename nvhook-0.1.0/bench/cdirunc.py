"""CDI container starts under runc without podman (`bench.py --cdi-runc`): the part of a start
that differs between CDI specs, measured with less noise than `podman run` gives.

Each case is a config.json to which one CDI spec's edits for one device were applied by
`apply_cdi` below (a small, spec-conformant CDI apply, the same for every spec: what podman,
containerd and CRI-O do through the container-device-interface library), run with
`runc run` of /bin/true. Every run gets a fresh overlay over the image (as an engine's
container layer: links and caches a hook wrote are gone next time), mounted and removed
outside the timed part. CPU is the children's rusage around `runc run`: runc, its init, the
hooks and what they run (NVIDIA's update-ldcache runs ldconfig). The baseline is the same
config without a GPU; a case's cost is its figure less the baseline's in the same round.

The real-host path: two prestart hooks (bench/procdriver_hook.c) bind the fixture host's
proc/driver onto the container's /proc/driver and onto /proc/driver of the container's mount
namespace (the host's /proc seen from there, which NVIDIA's disable-device-node-modification
reads), in every case and the baseline, so both sides find a driver's /proc/driver/nvidia.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import time
from pathlib import Path


def _device_node(d: dict) -> tuple[dict, dict]:
    """(linux.devices entry, linux.resources.devices rule) for a CDI deviceNodes entry, the
    missing type/major/minor/mode filled from hostPath (or path) as the CDI library does."""
    host = d.get("hostPath") or d["path"]
    st = os.stat(host)
    kind = d.get("type") or ("c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else "p")
    major = d.get("major", os.major(st.st_rdev))
    minor = d.get("minor", os.minor(st.st_rdev))
    node = {"path": d["path"], "type": kind, "major": major, "minor": minor,
            "fileMode": d.get("fileMode", stat.S_IMODE(st.st_mode))}
    for k in ("uid", "gid"):
        if k in d:
            node[k] = d[k]
    rule = {"allow": True, "type": kind, "major": major, "minor": minor, "access": d.get("permissions") or "rwm"}
    return node, rule


def apply_cdi(config: dict, spec: dict, devices: list[str]) -> dict:
    """`config` with the spec-wide edits and those of the named devices applied (env replaced by
    name, device nodes and their cgroup rules, mounts (one per destination, then ordered by
    path depth, stable), hooks appended by stage), as container-device-interface's
    ContainerEdits.Apply does."""
    cfg = json.loads(json.dumps(config))
    by_name = {d["name"]: d for d in spec["devices"]}
    missing = [n for n in devices if n not in by_name]
    if missing:
        raise SystemExit(f"no device {missing} in the spec (it has {sorted(by_name)[:8]}...)")
    edits = [spec.get("containerEdits") or {}] + [by_name[n].get("containerEdits") or {} for n in devices]
    linux = cfg.setdefault("linux", {})
    for e in edits:
        env = cfg["process"].setdefault("env", [])
        for v in e.get("env") or []:
            name = v.split("=", 1)[0]
            env[:] = [x for x in env if x.split("=", 1)[0] != name] + [v]
        for d in e.get("deviceNodes") or []:
            node, rule = _device_node(d)
            linux["devices"] = [x for x in linux.get("devices", []) if x["path"] != node["path"]] + [node]
            linux.setdefault("resources", {}).setdefault("devices", []).append(rule)
        for m in e.get("mounts") or []:
            cfg["mounts"] = [x for x in cfg["mounts"] if x["destination"] != m["containerPath"]]
            cfg["mounts"].append({"destination": m["containerPath"], "source": m["hostPath"],
                                  "type": m.get("type") or "bind", "options": list(m.get("options") or [])})
        if e.get("mounts"):
            cfg["mounts"].sort(key=lambda x: len([p for p in x["destination"].split("/") if p]))
        for h in e.get("hooks") or []:
            entry = {"path": h["path"]}
            for k in ("args", "env", "timeout"):
                if k in h:
                    entry[k] = h[k]
            cfg.setdefault("hooks", {}).setdefault(h["hookName"], []).append(entry)
    return cfg


class Case:
    """One config.json in a bundle of its own whose rootfs is an overlay over `image`, fresh per run."""

    def __init__(self, work: Path, name: str, image: Path, config: dict):
        self.dir = work / name
        self.dir.mkdir(parents=True)
        self.image = image
        self.rootfs = self.dir / "rootfs"
        self.rootfs.mkdir()
        cfg = json.loads(json.dumps(config))
        cfg["root"] = {"path": str(self.rootfs), "readonly": False}
        (self.dir / "config.json").write_text(json.dumps(cfg))
        self.count = 0

    def mount(self) -> None:
        layer = self.dir / "layer"
        shutil.rmtree(layer, ignore_errors=True)
        (layer / "upper").mkdir(parents=True)
        (layer / "work").mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={self.image},upperdir={layer / 'upper'},workdir={layer / 'work'}",
                        str(self.rootfs)], check=True)

    def umount(self) -> None:
        subprocess.run(["umount", str(self.rootfs)], check=True)

    def run(self, cpu_of) -> tuple[float, float]:
        """(wall ms, CPU ms) of one `runc run`."""
        self.count += 1
        cid = f"cdib-{self.dir.name}-{os.getpid()}-{self.count}"
        self.mount()
        try:
            c = cpu_of()
            t = time.perf_counter()
            p = subprocess.run(["runc", "run", cid], cwd=self.dir, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            wall = (time.perf_counter() - t) * 1000
            cpu = cpu_of() - c
            if p.returncode:
                subprocess.run(["runc", "delete", "-f", cid], stderr=subprocess.DEVNULL)
                raise SystemExit(f"runc run failed for {self.dir.name} ({p.returncode}): {p.stderr.decode()[-2000:]}")
            return wall, cpu
        finally:
            self.umount()


def run_rounds(cases: dict[str, Case], n: int, cpu_of, seed: int = 17) -> dict:
    """Every case once per round, rounds shuffled; two warm rounds first."""
    order = list(cases)
    for _ in range(2):
        for k in order:
            cases[k].run(cpu_of)
    wall: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    shuffle = random.Random(seed).shuffle
    for _ in range(n):
        shuffle(order)
        for k in order:
            w, c = cases[k].run(cpu_of)
            wall[k].append(w)
            cpu[k].append(c)
    return {"wall": wall, "cpu": cpu}
