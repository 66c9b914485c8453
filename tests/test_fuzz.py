"""Property-based fuzzing of everything nvhook reads, with a bounded budget.

Inputs: the OCI state on stdin, the bundle's config.json (with every environment variable
nvhook reads, mounts and capabilities), config/hook.toml, ld.so.cache bytes, procfs files, ELF
compat libraries and hostile image layouts (symlinked library/CUDA/compat directories, compat
files that are links to /etc/shadow, FIFOs, ...).

The property, for every input: nvhook either returns a plan that keeps every invariant below,
or fails with a HookError whose message is one non-empty line. Any other exception, or a hang,
is a bug. Plan invariants (check_plan):
  - the schema of nvhook/plan.py's docstring, JSON-serialisable, renderable as text;
  - every mount target is absolute, normalised, without "..", of a known kind; every source
    except tmpfs and compat lies inside the host root, every compat source is a regular file
    inside the container's rootfs (os.path.realpath);
  - device mounts: only control devices the capabilities need, /dev/nvidia<minor> of requested
    GPUs, MIG capability nodes of requested MIG devices (and config/monitor only when asked by a
    privileged container); `none` gets no GPU node; devices_cgroup is exactly the mounted
    nodes' major:minor;
  - gpus: only requested GPUs; for index lists exactly those indices; a skipped container gets
    nothing at all;
  - libraries, binaries, IPC, firmware only for requested capabilities (video implies compute,
    display implies graphics, 32-bit libraries only with compat32);
  - symlinks live in the library directories and point to a plain file name.
"What was requested" is read from the generated config.json by a small oracle in this file,
not by nvhook.decide.request.

Budget: the whole file runs in well under a minute on a 2-core machine (max_examples below;
NVHOOK_FUZZ_SCALE=10 multiplies them for a longer local run). With CI set in the environment
the "ci" profile is used: derandomize=True (the same examples every run) and no example
database. Every test has a wall-clock guard (SIGALRM): one example that takes longer than
EXAMPLE_LIMIT fails as a Hang (and is shrunk); a test that exceeds TEST_LIMIT is aborted.

Regression corpus: tests/fuzz_corpus/<area>/<name>.* holds every failure found so far, reduced
(formats in tests/fuzz_corpus/README.md); test_corpus_* replays each file through the same
property. KNOWN_BUGS.json lists corpus files whose bug lives in a module this suite's authors
could not fix yet: they run as strict xfail, so the fix makes them XPASS and fail until the
entry is removed. To collect a new failure, run with NVHOOK_FUZZ_SAVE=DIR: the last (shrunk)
failing input of each property is written to
DIR/<area>/last.<ext>, ready to be moved into the corpus.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from nvhook.base import catalog, config
from nvhook.base.errors import HookError
from nvhook.base.log import EventLog
from nvhook.commands import render
from nvhook.decide import compat
from nvhook.decide import plan as plan_mod
from nvhook.decide.sources import Host, OciBundle
from nvhook.observe import image, oci
from nvhook.observe.host import inventory, ldcache, procfs
from nvhook.start import pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import make_fixtures as mf  # noqa: E402
from fuzzscale import SCALE, examples  # noqa: E402
from waiting import cpu_seconds  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
KNOWN_BUGS: dict[str, str] = json.loads((CORPUS / "KNOWN_BUGS.json").read_text()) \
    if (CORPUS / "KNOWN_BUGS.json").exists() else {}

# --- budget -------------------------------------------------------------------------------------

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
          HealthCheck.function_scoped_fixture, HealthCheck.large_base_example]
settings.register_profile("nvhook-fuzz", deadline=None, suppress_health_check=_QUIET, print_blob=True)
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=_QUIET, print_blob=True)
# Applied per test (not settings.load_profile): loading a profile here would change the
# settings of every other test module collected after this one.
PROFILE = settings.get_profile("ci" if os.environ.get("CI") else "nvhook-fuzz")


def budget(n: int) -> settings:
    return settings(PROFILE, max_examples=examples(n))


# Wall-clock guards against hangs (a blocked read does not use CPU): far above what the code
# takes even on a loaded shared machine, which can stretch wall time tenfold.
EXAMPLE_LIMIT = 30.0   # seconds for one example (they take < 0.5 s): more is a hang
TEST_LIMIT = 600.0 * max(1.0, SCALE)  # seconds for one whole test


class Hang(Exception):
    """One example ran too long. An ordinary failure: hypothesis shrinks it. Deliberately not
    an OSError/ValueError/TimeoutError, which the code under test catches."""


class BudgetExceeded(BaseException):
    """A whole test ran past TEST_LIMIT: a BaseException, so hypothesis stops at once."""


@pytest.fixture(autouse=True)
def _hang_guard():
    def on_alarm(signum, frame):
        raise BudgetExceeded(f"test ran longer than {TEST_LIMIT:g} s (a hang?)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TEST_LIMIT, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raise Hang when the block runs longer than `seconds` (re-raised every 0.5 s after, in
    case the code under test swallows the first one with a broad except)."""
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_handler = signal.getsignal(signal.SIGALRM)

    def on_alarm(signum, frame):
        raise Hang(f"{what} did not finish within {seconds:g} s")

    t0 = time.monotonic()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.5)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - t0), 0.001), 1.0)


def _note(text: str) -> None:
    """hypothesis.note() when running under @given (the replay tests are plain tests)."""
    try:
        note(text)
    except InvalidArgument:
        pass


def _save(area: str, ext: str, data: bytes | str) -> None:
    """With NVHOOK_FUZZ_SAVE=DIR, keep the failing input (the last one written is the shrunk one)."""
    d = os.environ.get("NVHOOK_FUZZ_SAVE")
    if not d:
        return
    p = Path(d) / area / f"last.{ext}"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass"))


@contextlib.contextmanager
def saved_on_failure(area: str, ext: str, data: bytes | str):
    try:
        yield
    except BaseException:
        _save(area, ext, data)
        raise


def corpus(area: str) -> list:
    files = sorted(p for p in (CORPUS / area).glob("*") if p.is_file()) if (CORPUS / area).is_dir() else []
    out = []
    for p in files:
        rel = f"{area}/{p.name}"
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[rel])] if rel in KNOWN_BUGS else []
        out.append(pytest.param(p, id=p.name, marks=marks))
    return out


# --- the error property -------------------------------------------------------------------------

def check_error(e: HookError) -> None:
    msg = e.message
    assert isinstance(msg, str) and msg.strip(), f"empty HookError message: {msg!r}"
    assert len(msg.splitlines()) == 1, f"HookError message is not one line: {msg!r}"
    assert isinstance(e.code, int) and e.code != 0


# --- fixture hosts and what they contain (from make_fixtures' specs, not from nvhook) ------------

FUZZ_HOSTS = ("host-gpu8", "host-gpu1", "host-debian", "host-broken")
FUZZ_CONTAINERS = ("container-debian", "container-rhel", "container-cuda113", "container-cuda113-nonote")
LIBDIRS64 = {"/usr/lib/x86_64-linux-gnu", "/usr/lib64"}
LIBDIRS32 = {"/usr/lib/i386-linux-gnu", "/usr/lib"}
CONTROL = {"/dev/nvidiactl": None, "/dev/nvidia-uvm": "compute", "/dev/nvidia-uvm-tools": "compute",
           "/dev/nvidia-modeset": "display"}
CAPS = ("compute", "compat32", "graphics", "utility", "video", "display", "ngx")
MODES = ("auto", "image", "host")
NEW_COMPAT = "550.54.15"  # newer than every fuzzed host driver
NEW_NOTE = {"Format": 1, "CUDA Version": "12.4", "Driver": [535, 550], "Device": mf.DATACENTER_DEVICES}


def norm_bus(token: str) -> str:
    bus = token.lower()
    dom, sep, rest = bus.partition(":")
    if sep and rest.count(":") == 1:
        return dom[-4:].rjust(4, "0") + ":" + rest
    return "0000:" + bus


def _sysfs_dev(root: str, bus: str, name: str) -> int | None:
    """The device number sysfs gives DRM node `name` of PCI device `bus` under `root`."""
    try:
        with open(os.path.join(root, "sys/bus/pci/devices", bus, "drm", name, "dev")) as f:
            ma, mi = f.read().strip().split(":")
        return os.makedev(int(ma), int(mi))
    except (OSError, ValueError):
        return None


class GpuFacts:
    """A host's GPUs as the oracle knows them: from make_fixtures' spec of an untouched fixture
    host, or (when a test rewrites the host's procfs) from what procfs.gpus() lists."""

    def __init__(self, gpus: list):
        self.gpus = gpus  # objects with index, minor, uuid, bus_id, migs (slot, gi, ci, uuid)

    @classmethod
    def of_host(cls, name: str) -> GpuFacts:
        return cls(list(mf.HOSTS[name].gpus))

    @classmethod
    def of_procfs(cls, root: str) -> GpuFacts:
        from types import SimpleNamespace

        # MIG devices as the driver's capability tree lists them (what `all` selects).
        cis = [n.split("/") for n in procfs.mig_instances(root) if n.count("/") == 2]

        def migs(minor: int) -> tuple:
            return tuple(SimpleNamespace(gi=int(gi[2:]), ci=int(ci[2:]), uuid="", slot=None)
                         for gpu, gi, ci in cis if gpu == f"gpu{minor}")

        return cls([SimpleNamespace(index=g["index"], minor=g["minor"], uuid=g["uuid"], bus_id=g["bus_id"],
                                    migs=migs(g["minor"]), proc_name=g["proc_dir"].rsplit("/", 1)[1])
                    for g in procfs.gpus(root)[0]])

    @staticmethod
    def proc_name(g) -> str:
        return getattr(g, "proc_name", g.bus_id)

    def resolve(self, token: str) -> tuple[str, object] | None:
        """("gpu", gpu) or ("mig", (gpu, mig)) that a NVIDIA_VISIBLE_DEVICES token names, or None."""
        low = token.lower()
        for g in self.gpus:
            for m in g.migs:
                if low in (m.uuid.lower(), f"{g.index}:{m.slot}"):
                    return "mig", (g, m)
        for g in self.gpus:
            if (token == str(g.index) or (g.uuid and low == g.uuid.lower())
                    or (":" in token and norm_bus(token) == g.bus_id)):
                return "gpu", g
        return None


def lib_capability(fname: str) -> str | None:
    best = None
    for cap, names in catalog.LIBRARIES.items():
        for name in names:
            if fname.startswith(name + ".") and (best is None or len(name) > len(best[1])):
                best = (cap, name)
    return best and best[0]


class Expect:
    """What the container asked for, read from the config.json we generated (independently of
    nvhook.observe.oci/nvhook.decide.request). must_fail: nvhook cannot accept this bundle at all."""

    def __init__(self, spec_text: bytes | None, bundle: str | None, cfg: dict, host: GpuFacts):
        self.must_fail = True
        self.skip = True
        try:
            spec = json.loads(spec_text) if spec_text is not None else None
        except (ValueError, RecursionError):
            return
        if not isinstance(spec, dict) or bundle is None:
            return
        root = spec.get("root")
        if not isinstance(root, dict) or not isinstance(root.get("path"), str) or not root["path"]:
            return
        if not os.path.isdir(os.path.normpath(os.path.join(os.path.abspath(bundle), root["path"]))):
            return
        process = spec.get("process") or {}
        if not isinstance(process, dict):
            return
        env_list = process.get("env") or []
        if not isinstance(env_list, list) or not all(isinstance(i, str) for i in env_list):
            return
        mounts = spec.get("mounts") or []
        if not isinstance(mounts, list):
            return
        self.must_fail = False
        env = {}
        for item in env_list:
            k, sep, v = item.partition("=")
            if sep and k:
                env[k] = v
        caps = process.get("capabilities") or {}
        bounding = caps.get("bounding") if isinstance(caps, dict) else caps  # pre-1.0: a plain array
        self.privileged = isinstance(bounding, list) and "CAP_SYS_ADMIN" in bounding
        self.env = env

        raw = None
        dev = cfg["devices"]
        if dev["accept_volume_mounts"]:
            prefix = dev["volume_mounts_root"].rstrip("/") + "/"
            ids = [m["destination"][len(prefix):].strip("/") for m in mounts
                   if isinstance(m, dict) and isinstance(m.get("destination"), str)
                   and m["destination"].startswith(prefix) and m.get("source") in ("/dev/null", None)]
            ids = [i for i in ids if i and not i.startswith("imex/")]  # imex/<n>: IMEX channels
            if ids:
                raw = ",".join(ids)
        # Issue 14: a legacy image needs non-empty CUDA_VERSION and empty NVIDIA_REQUIRE_CUDA, and
        # its implied `all` is an environment request like NVIDIA_VISIBLE_DEVICES.
        legacy = bool(env.get("CUDA_VERSION")) and not env.get("NVIDIA_REQUIRE_CUDA")
        env_ok = self.privileged or dev["accept_envvar_unprivileged"]
        if raw is None and "NVIDIA_VISIBLE_DEVICES" in env:
            if env_ok:
                raw = env["NVIDIA_VISIBLE_DEVICES"]
        elif raw is None and legacy and env_ok:
            raw = "all"
        tokens = [t.strip() for t in (raw or "").split(",") if t.strip()]
        keywords = [t.lower() for t in tokens]
        if not tokens or "void" in keywords:  # void anywhere: nothing
            return
        self.skip = False
        self.tokens = tokens
        self.none = "none" in keywords
        self.all = "all" in keywords and not self.none  # all with ids: all
        self.index_only = all(t.isascii() and t.isdigit() for t in tokens)

        value = env.get("NVIDIA_DRIVER_CAPABILITIES")
        if value is None or not value.strip():
            ctoks = list(CAPS) if legacy else ["utility", "compute"]
        else:
            ctoks = [t.strip().lower() for t in value.split(",") if t.strip()]
            if "all" in ctoks:
                ctoks = list(CAPS)
        self.caps_known = all(t in CAPS for t in ctoks)
        caps = set(ctoks)
        if "video" in caps:
            caps.add("compute")
        if "display" in caps:
            caps.add("graphics")
        self.caps = caps

        self.unknown = []
        self.gpus: set[int] = set()
        self.migs: list = []
        if self.all:
            self.gpus = {g.index for g in host.gpus}
        elif not self.none:
            for t in tokens:
                hit = host.resolve(t)
                if hit is None:
                    self.unknown.append(t)
                elif hit[0] == "gpu":
                    self.gpus.add(hit[1].index)
                else:
                    self.migs.append(hit[1])
        self.mig_config = bool(env.get("NVIDIA_MIG_CONFIG_DEVICES", "").strip())
        self.mig_monitor = bool(env.get("NVIDIA_MIG_MONITOR_DEVICES", "").strip())
        self.imex = bool(env.get("NVIDIA_IMEX_CHANNELS", "").strip())
        if self.all or self.mig_config or self.mig_monitor:
            # `all` brings every MIG device; MIG management a GPU's every MIG capability.
            whole = self.gpus if not self.all else {g.index for g in host.gpus}
            self.migs += [(g, m) for g in host.gpus if g.index in whole for m in g.migs
                          if (g, m) not in self.migs]

        by_index = {g.index: g for g in host.gpus}
        parents = set(self.gpus) | {g.index for g, _ in self.migs}
        allowed = {p for p, cap in CONTROL.items() if cap is None or cap in caps}
        allowed |= {f"/dev/nvidia{by_index[i].minor}" for i in parents}
        self.allowed_mig_procfs = set()  # /proc/driver/nvidia/capabilities/... files
        for g, m in self.migs:
            allowed.add(f"/dev/nvidia-caps/nvidia-cap{mf.mig_minor(g.minor, m.gi)}")
            allowed.add(f"/dev/nvidia-caps/nvidia-cap{mf.mig_minor(g.minor, m.gi, m.ci)}")
            self.allowed_mig_procfs |= {f"gpu{g.minor}/mig/gi{m.gi}/access",
                                        f"gpu{g.minor}/mig/gi{m.gi}/ci{m.ci}/access"}
        if self.mig_config:
            self.allowed_mig_procfs.add("mig/config")
        if self.mig_monitor:
            self.allowed_mig_procfs.add("mig/monitor")
        if self.mig_config:
            allowed.add(f"/dev/nvidia-caps/nvidia-cap{mf.MIG_CONFIG_MINOR}")
        if self.mig_monitor:
            allowed.add(f"/dev/nvidia-caps/nvidia-cap{mf.MIG_MONITOR_MINOR}")
        self.allowed_devices = allowed
        self.allowed_gpus = parents
        self.allowed_proc = {host.proc_name(by_index[i]) for i in parents}
        self.gpu_minors = [g.minor for g in host.gpus]


# --- the plan property --------------------------------------------------------------------------

TOP_KEYS = {"container", "request", "driver", "gpus", "mounts", "symlinks", "devices_cgroup", "compat", "ldconfig"}


def _inside(path: str, top: str) -> bool:
    top = os.path.realpath(top)
    return os.path.realpath(path).startswith(top.rstrip("/") + "/")


def check_plan(plan: dict, root: str, rootfs: str | None, exp: Expect | None) -> None:
    # schema
    top = TOP_KEYS | ({"app_profile"} if "app_profile" in plan else set())
    assert set(plan) == (top | {"cgroup"} if plan["devices_cgroup"] else top), sorted(plan)
    # the application profile: exactly for graphics or display with GPU nodes, their minors' bits
    from nvhook.decide import appprofile

    nodes = [(m["target"], True, m["node"]["minor"]) for m in plan["mounts"] if m["kind"] == "device" and "node" in m]
    assert plan.get("app_profile") == appprofile.for_container(plan["request"]["capabilities"], nodes)[0]
    assert set(plan["container"]) == {"id", "pid", "rootfs"}
    assert set(plan["request"]) == {"devices", "capabilities", "requirements"}
    assert set(plan["driver"]) == {"version", "cuda"}
    assert set(plan["compat"]) == {"decision", "reason", "libraries"}
    assert plan["compat"]["decision"] in ("host", "image", "none")
    assert isinstance(plan["compat"]["reason"], str)
    for g in plan["gpus"]:
        assert set(g) == {"index", "minor", "uuid", "bus_id", "model", "brand", "brand_source"}, g
    for m in plan["mounts"]:
        if m["kind"] == "device":
            assert set(m) == {"kind", "source", "target", "options", "node"}, m
            assert set(m["node"]) == {"major", "minor", "mode", "uid", "gid"}, m
            assert all(type(v) is int for v in m["node"].values()) and 0 <= m["node"]["mode"] <= 0o7777, m
        else:
            assert set(m) == {"kind", "source", "target", "options"}, m
    for s in plan["symlinks"]:
        assert set(s) == {"path", "target"}, s
    for r in plan["devices_cgroup"]:
        assert set(r) == {"type", "major", "minor", "access"} and r["type"] == "c" and r["access"] == "rw", r
    assert plan["ldconfig"] is None or set(plan["ldconfig"]) == {"binary", "directories"}
    json.dumps(plan)
    render.plan_text(plan)

    if exp is not None and exp.skip:
        assert not plan["mounts"] and not plan["symlinks"] and not plan["devices_cgroup"] and not plan["gpus"], \
            "a container that asked for nothing got something"
        return

    caps = exp.caps if exp is not None else set(CAPS)
    gpu_buses = {g["bus_id"].lower() for g in plan["gpus"]}
    targets = []
    device_numbers = set()
    gpu_minors_mounted = set()
    drm_mounted: dict[str, str] = {}  # DRM node name -> bus id of its GPU
    for m in plan["mounts"]:
        kind, src, tgt = m["kind"], m["source"], m["target"]
        assert kind in plan_mod.KINDS, m
        assert isinstance(tgt, str) and tgt.startswith("/") and not tgt.startswith("//"), m
        assert os.path.normpath(tgt) == tgt and ".." not in tgt.split("/"), f"target not normalised: {tgt!r}"
        targets.append(tgt)
        if kind not in ("tmpfs", "ipc"):
            assert "ro" in m["options"], m
        if kind == "compat":
            assert rootfs is not None and _inside(src, rootfs), f"compat source outside the rootfs: {src!r}"
            assert stat.S_ISREG(os.lstat(src).st_mode), f"compat source is not a regular file: {src!r}"
            assert os.path.dirname(tgt) in LIBDIRS64, m
            assert "compute" in caps, f"compat library without compute: {m}"
            continue
        if kind != "tmpfs":
            assert _inside(src, root), f"{kind} source outside the host root {root}: {src!r}"
        name = os.path.basename(tgt)
        if kind == "library" and tgt in catalog.CONFIGS:  # Vulkan ICD, EGL vendor, OpenCL ICD
            row_cap = next(c for p, c, _ in catalog.CONFIG_ROWS if p == tgt)
            assert row_cap in caps, f"loader config {tgt} ({row_cap}) without {row_cap}"
            need = catalog.CONFIG_NEEDS.get(tgt)
            assert need is None or any(os.path.basename(m["target"]).startswith(need + ".")
                                       for m in plan["mounts"] if m["kind"] == "library"), \
                f"{tgt} given without {need}"
        elif kind in ("library", "library32"):
            cap = lib_capability(name)
            assert cap is not None, f"mounted {name}, which is no driver library"
            assert cap in caps, f"library {name} ({cap}) mounted, capabilities {sorted(caps)}"
            assert os.path.dirname(tgt) in (LIBDIRS64 if kind == "library" else LIBDIRS32), m
            if kind == "library32":
                assert "compat32" in caps, f"32-bit library {name} without compat32"
        elif kind == "binary":
            assert os.path.dirname(tgt) == "/usr/bin"
            assert any(name in catalog.BINARIES[c] for c in caps if c in catalog.BINARIES), m
        elif kind == "ipc":
            assert any(tgt in catalog.IPC[c] for c in caps if c in catalog.IPC), m
        elif kind == "firmware":
            assert tgt.startswith("/lib/firmware/nvidia/") and ("utility" in caps or "compute" in caps), m
        elif kind == "tmpfs":
            assert tgt == "/proc/driver/nvidia" and src == "tmpfs", m
        elif kind == "procfs":
            assert tgt.startswith("/proc/driver/nvidia/"), m
            if tgt.startswith("/proc/driver/nvidia/gpus/"):
                ok = name in exp.allowed_proc if exp is not None else name.lower() in gpu_buses
                assert ok, f"procfs dir of an unselected GPU: {tgt}"
            elif tgt.startswith("/proc/driver/nvidia/capabilities/") and exp is not None:
                rel = tgt[len("/proc/driver/nvidia/capabilities/"):]
                assert rel in exp.allowed_mig_procfs, f"MIG capability file {tgt} of an unrequested instance"
        elif kind == "device":
            st_ = os.stat(src)
            assert stat.S_ISCHR(st_.st_mode), m
            device_numbers.add((os.major(st_.st_rdev), os.minor(st_.st_rdev)))
            if tgt.startswith("/dev/dri/"):
                # A DRM node: only with graphics, and one that sysfs lists under a GPU the
                # container asked for as a whole GPU (never another GPU's, never for a MIG device).
                assert "graphics" in caps, f"DRM node {tgt} without graphics"
                whole = exp.gpus if exp is not None else {g["index"] for g in plan["gpus"]}
                owners = [g["bus_id"] for g in plan["gpus"] if g["index"] in whole
                          and _sysfs_dev(root, g["bus_id"], os.path.basename(tgt)) == st_.st_rdev]
                assert owners, f"DRM node {tgt} belongs to no selected GPU"
                drm_mounted[os.path.basename(tgt)] = owners[0]
            base = tgt[len("/dev/nvidia"):] if tgt.startswith("/dev/nvidia") else ""
            if base.isdigit():
                gpu_minors_mounted.add(int(base))
            if exp is not None:
                ok = tgt in exp.allowed_devices or (exp.imex and tgt.startswith("/dev/nvidia-caps-imex-channels/")) \
                    or (tgt.startswith("/dev/dri/") and os.path.basename(tgt) in drm_mounted)
                assert ok, f"device {tgt} mounted but not requested (allowed: {sorted(exp.allowed_devices)})"
    twice = sorted({t for t in targets if targets.count(t) > 1})
    assert not twice, f"a target is mounted twice: {twice}"
    assert {(r["major"], r["minor"]) for r in plan["devices_cgroup"]} == device_numbers, \
        "devices_cgroup differs from the mounted device nodes"
    assert len(plan["devices_cgroup"]) == len(device_numbers)
    plan_minors = {g["minor"] for g in plan["gpus"]}
    assert gpu_minors_mounted <= plan_minors, "a GPU node mounted for a GPU not in the plan"
    present = {m for m in plan_minors if os.path.exists(os.path.join(root, f"dev/nvidia{m}"))
               and stat.S_ISCHR(os.stat(os.path.join(root, f"dev/nvidia{m}")).st_mode)}
    assert present <= gpu_minors_mounted, "a selected GPU's device node is not mounted"

    libdirs = LIBDIRS64 | LIBDIRS32
    # A link lives in a lib dir and names a file beside it; the one exception is a catalog link
    # in a subdirectory of a lib dir (GBM's <libdir>/gbm/nvidia-drm_gbm.so), which names a file
    # one level up, in that lib dir, and nothing else.
    from nvhook.base.catalog import DEV_LINKS

    subdirs = {os.path.dirname(n) for n in DEV_LINKS if "/" in n}
    for s in plan["symlinks"]:
        p, t = s["path"], s["target"]
        if p.startswith("/dev/dri/by-path/"):
            # udev's by-path link of a DRM node the container got, named for that node's GPU.
            node = t[3:] if t.startswith("../") else ""
            assert node in drm_mounted, f"by-path link {p} -> {t} for a node not given"
            kind = "card" if node.startswith("card") else "render"
            assert p == f"/dev/dri/by-path/pci-{drm_mounted[node]}-{kind}", f"by-path link {p} -> {t}"
            continue
        parent, sub = os.path.split(os.path.dirname(p))
        nested = sub in subdirs and parent in libdirs
        assert os.path.normpath(p) == p and (os.path.dirname(p) in libdirs or nested), \
            f"symlink outside the lib dirs: {p!r}"
        name = t[3:] if nested and t.startswith("../") else t
        assert name and "/" not in name and name not in (".", ".."), f"symlink target is not a file name: {t!r}"
    lib_dirs = sorted({os.path.dirname(m["target"]) for m in plan["mounts"]
                       if m["kind"] in ("library", "library32", "compat")} & libdirs)
    if plan["ldconfig"] is not None:
        assert plan["ldconfig"]["directories"] == lib_dirs
    assert len({g["index"] for g in plan["gpus"]}) == len(plan["gpus"])

    if exp is None:
        return
    assert not exp.unknown, f"unknown device ids {exp.unknown!r} accepted"
    assert exp.caps_known, "unknown capability accepted"
    indices = {g["index"] for g in plan["gpus"]}
    if exp.none:
        assert not indices and not gpu_minors_mounted, "NVIDIA_VISIBLE_DEVICES=none got a GPU"
    assert indices <= exp.allowed_gpus, f"GPUs {sorted(indices - exp.allowed_gpus)} were not requested"
    if exp.all or (exp.index_only and not exp.none):
        assert indices == exp.gpus, f"asked for {sorted(exp.gpus)}, got {sorted(indices)}"
    if exp.mig_config or exp.mig_monitor:
        assert exp.privileged, "MIG config/monitor for an unprivileged container"


def run_decide(state: dict, cfg: dict, root: str) -> dict | None:
    log = EventLog(level="debug", path=None)
    try:
        with time_limit(EXAMPLE_LIMIT, "pipeline.decide"):
            return pipeline.decide(OciBundle.from_state(state), Host(root, cfg, log)).plan
    except HookError as e:
        check_error(e)
        return None
    finally:
        log.lines()  # what the hook writes: every event must serialise


# --- pipeline cases: materialise, run, check ----------------------------------------------------

def nvhook_config(raw: dict, cache_dir: str) -> dict:
    cfg = config.merge(raw, "fuzz.toml")
    cfg["cache_dir"] = cache_dir
    return cfg


def run_case(case: dict, ctx: Ctx, workdir: str) -> str:
    """case: {"host", "rootfs": container name | {"layout": ...}, "nvhook_config": raw dict,
    "cache": bool, "bundle_config": config.json text with @ROOTFS@, "state": {... "@BUNDLE@"}}.
    Returns the outcome ("plan", "skip", "error") for statistics."""
    _note(json.dumps(case))
    root = str(ctx.fixtures / case["host"])
    rootfs_spec = case["rootfs"]
    if isinstance(rootfs_spec, str):
        rootfs = str(ctx.fixtures / rootfs_spec)
    else:
        rootfs = build_layout(Path(workdir) / "rootfs", rootfs_spec["layout"], ctx)
    bundle = os.path.join(workdir, "bundle")
    os.makedirs(bundle, exist_ok=True)
    text = case["bundle_config"].replace("@ROOTFS@", rootfs)
    raw = text.encode("utf-8", "surrogatepass")
    with open(os.path.join(bundle, "config.json"), "wb") as f:
        f.write(raw)
    state = {k: (v.replace("@BUNDLE@", bundle) if isinstance(v, str) else v) for k, v in case["state"].items()}
    cfg = nvhook_config(case.get("nvhook_config", {}), str(ctx.cache) if case.get("cache", True) else "")
    exp = Expect(raw if state.get("bundle") == bundle else None, state.get("bundle"), cfg,
                 GpuFacts.of_host(case["host"]))
    plan = run_decide(state, cfg, root)
    if plan is None:
        return "error"
    assert not exp.must_fail, "nvhook accepted a bundle config it cannot read"
    check_plan(plan, root, plan["container"]["rootfs"], exp)
    return "skip" if exp.skip else "plan"


class Ctx:
    def __init__(self, fixtures: Path, work: Path):
        self.fixtures = fixtures
        self.work = work
        self.cache = work / "inventory-cache"
        self.cache.mkdir(mode=0o700)
        # Outside every rootfs: what hostile links point at.
        self.outside = work / "outside"
        compat_dir = self.outside / "cuda-11.3" / "compat"
        self.good_lib_path = mf.build_compat_lib(compat_dir, NEW_COMPAT, NEW_NOTE, 12040)
        self.good_lib = self.good_lib_path.read_bytes()
        (self.outside / "libdir").mkdir()
        (self.outside / "etc").mkdir()
        (self.outside / "etc/shadow").write_text("root:$6$secret:19000:0:99999:7:::\n")
        self.counter = itertools.count()
        # A compat libcuda whose note has room for other JSON documents of up to note_size bytes.
        padded = {**NEW_NOTE, "Pad": " " * 240}
        self.roomy_lib = mf.build_compat_lib(work / "roomy", NEW_COMPAT, padded, 12040).read_bytes()
        self.note_at = self.roomy_lib.index(b'{"Format"')
        self.note_size = len(json.dumps(padded, separators=(",", ":")))

    def tmp(self) -> tempfile.TemporaryDirectory:
        return tempfile.TemporaryDirectory(dir=self.work)


@pytest.fixture(scope="module")
def ctx(fixtures_root, tmp_path_factory) -> Ctx:
    return Ctx(fixtures_root, tmp_path_factory.mktemp("fuzz"))


# --- strategies: environment values -------------------------------------------------------------

def _device_tokens() -> list[str]:
    out = ["all", "none", "void", "ALL", "None", "0", "1", "2", "3", "6", "7", "8", "99", "-1", "00", "0x1",
           "+1", "1.0", " 0", "\u0663", "\u00b2", "\uff10", "GPU-", "MIG-", "0:0", "0:1", "1:0", "1:1", "1:2",
           "2:0", "0:", ":0", ":", "::", "07:00.0", "0000:07:00.0:0", "\u0660:\u0660", "gpu-0"]
    for spec in (mf.HOSTS[h] for h in FUZZ_HOSTS):
        for g in spec.gpus:
            out += [g.uuid, g.uuid.lower(), g.uuid.upper(), g.bus_id, g.bus_id.upper(), g.bus_id[5:],
                    "0000" + g.bus_id]
            for m in g.migs:
                out += [m.uuid, m.uuid.upper(), f"{g.index}:{m.slot}"]
    return sorted(set(out))


DEVICE_TOKENS = _device_tokens()
HUGE = ["0," * 20000, "x" * 200000, ",".join(str(i) for i in range(3000)), "all," * 2000, " " * 100000,
        "cuda>=1.0 " * 5000, "\u2028" * 1000]
junk = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=",: =<>!.0123456789abcdefGPUMIG-\t\n\x00", max_size=30),
    st.sampled_from(["\ud800", "a\ud800b", "\x00", "\n", "0\n1", "\u2028", "\x1b[31m", "\\", "\"", "${HOME}"]),
    st.sampled_from(HUGE),
)


@st.composite
def joined(draw, items, max_size=5):
    parts = draw(st.lists(items, min_size=1, max_size=max_size))
    return "".join(p + (draw(st.sampled_from([",", ", ", " ,", ",,", ",\t"])) if i < len(parts) - 1 else "")
                   for i, p in enumerate(parts))


def _host_tokens(host: str) -> list[str]:
    """Device ids that name something on this fixture host."""
    out = ["all", "none"]
    for g in mf.HOSTS[host].gpus:
        out += [str(g.index), g.uuid, g.uuid.lower(), g.bus_id, g.bus_id[5:]]
        out += [f"{g.index}:{m.slot}" for m in g.migs] + [m.uuid for m in g.migs]
    return out


def dev_values(host: str | None):
    any_token = st.sampled_from(DEVICE_TOKENS)
    good = st.sampled_from(_host_tokens(host)) if host else any_token
    return st.one_of(good, good, good, joined(good, max_size=3), joined(good, max_size=3),
                     joined(st.one_of(good, any_token)), any_token, junk)


caps_good = joined(st.sampled_from([*CAPS, "all"]), max_size=3)
caps_value = st.one_of(*[caps_good] * 6,
                       joined(st.sampled_from([*CAPS, "all", "ALL", " Video ", "COMPUTE", "bogus", "", "compute "])),
                       junk)
_good_term = st.one_of(
    st.builds(lambda k, op, v: f"{k}{op}{v}", st.sampled_from(["cuda", "driver", "arch"]),
              st.sampled_from([">=", "<=", "!=", "=", "<", ">"]),
              st.sampled_from(["11.0", "12.2", "12.3", "535", "535.261.03", "525", "8.0", "7.5", "9.0"])),
    st.builds(lambda op, v: f"brand{op}{v}", st.sampled_from(["=", "!="]),
              st.sampled_from(["tesla", "geforce", "nvidia"])))
_term = st.one_of(_good_term, _good_term, st.builds(
    lambda k, op, v: f"{k}{op}{v}",
    st.sampled_from(["cuda", "driver", "arch", "brand", "CUDA", " cuda", "bogus", ""]),
    st.sampled_from([">=", "<=", "!=", "=", "<", ">", "==", "=>", "~", ""]),
    st.sampled_from(["11.0", "12.2", "535.261.03", "tesla", "", "1.", ".1", "x", "9" * 30, "9" * 5000,
                     "\u00b2", "\u0661\u0662", "12.2.0.0.0"])))
_expr = st.lists(st.lists(_term, min_size=1, max_size=3).map(",".join), min_size=1, max_size=3).map(" ".join)
req_value = st.one_of(_expr, _expr, junk)


def _maybe(good: list[str]):
    return st.one_of(st.sampled_from(good), st.sampled_from(good), junk)


ENV_VALUES = {
    "NVIDIA_DRIVER_CAPABILITIES": caps_value,
    "NVIDIA_REQUIRE_CUDA": req_value,
    "NVIDIA_REQUIRE_ARCH": req_value,
    "NVIDIA_REQUIRE_BRAND_X": req_value,
    "NVIDIA_DISABLE_REQUIRE": _maybe(["true", "1", "yes", "on", "false", "0", "", " TRUE "]),
    "CUDA_VERSION": _maybe(["11.3.1", "12.2.0", "11.0", "10", "11.x", "", "\u00b2.\u00b3", "99999.0", "12.2 "]),
    "NVIDIA_MIG_CONFIG_DEVICES": _maybe(["all", "0", "", " "]),
    "NVIDIA_MIG_MONITOR_DEVICES": _maybe(["all", "0", "", " "]),
    "NVIDIA_IMEX_CHANNELS": _maybe(["all", "0", "1,2", "", "-1"]),
    "NVHOOK_COMPAT_MODE": _maybe(["auto", "image", "host", "HOST", " image ", "", "always"]),
}
OTHER_ENTRIES = ["PATH=/usr/bin:/bin", "LD_PRELOAD=/tmp/x.so", "NVIDIA_VISIBLE_DEVICES", "=0", "=",
                 "NVIDIA_VISIBLE_DEVICES==0", "nvidia_visible_devices=all", "NVIDIA_REQUIRE_=cuda>=1"]


@st.composite
def env_lists(draw, host: str | None = None):
    """process.env: every variable nvhook reads, in any order, duplicated (last one wins), with
    entries that are no assignments; mostly a GPU container."""
    values = dict(ENV_VALUES, NVIDIA_VISIBLE_DEVICES=dev_values(host))
    entry = st.one_of(
        st.sampled_from(sorted(values)).flatmap(lambda k: values[k].map(lambda v: f"{k}={v}")),
        st.sampled_from(OTHER_ENTRIES),
        st.builds(lambda k, v: f"{k}={v}", st.text(max_size=10), junk))
    env = draw(st.lists(entry, max_size=6))
    for key in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"):
        if draw(st.sampled_from([True, True, True, True, False])):
            env.insert(draw(st.integers(0, len(env))), f"{key}={draw(values[key])}")
    return env


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=8)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutate_json(draw, obj):
    """Replace or delete one random subtree."""
    paths = list(_paths(obj))
    path = draw(st.sampled_from(paths))
    new = draw(json_values)
    if not path:
        return new
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return obj


volume_mounts = st.lists(st.builds(
    lambda root, tok, src: {"destination": f"{root}/{tok}", "type": "bind",
                            **({"source": src} if src is not None else {})},
    st.sampled_from(["/var/run/nvidia-container-devices", "/var/run/nvidia-container-devices/", "/dev"]),
    st.sampled_from(DEVICE_TOKENS), st.sampled_from(["/dev/null", None, "/dev/zero"])), max_size=3)

nvhook_raw = st.fixed_dictionaries({}, optional={
    "devices": st.fixed_dictionaries({}, optional={
        "accept_envvar_unprivileged": st.booleans(), "accept_volume_mounts": st.booleans(),
        "volume_mounts_root": st.sampled_from(["/var/run/nvidia-container-devices",
                                               "/var/run/nvidia-container-devices/", "/", "/dev", ""])}),
    "nvml": st.fixed_dictionaries({}, optional={"enabled": st.booleans()}),
    "compat": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(MODES),
                                                  "allow_env_override": st.booleans()}),
    "ldconfig": st.fixed_dictionaries({}, optional={
        "path": st.sampled_from(["/sbin/ldconfig", "@/sbin/ldconfig", "/x"])}),
})


@st.composite
def bundle_configs(draw, host: str | None = None):
    env = draw(env_lists(host))
    spec = mf.oci_config(draw(st.sampled_from(["@ROOTFS@"] * 6 + [
        "@ROOTFS@/", "@ROOTFS@/./usr/..", "@ROOTFS@/missing\nsecond line", "@ROOTFS@\x00",
        "@ROOTFS@/etc/debian_version", "no-such-dir"])), env)
    if draw(st.booleans()):
        spec["process"]["capabilities"]["bounding"].append("CAP_SYS_ADMIN")
    spec["mounts"] += draw(volume_mounts)
    how = draw(st.sampled_from(["plain"] * 12 + ["mutate", "mutate", "text", "truncate"]))
    if how == "mutate":
        spec = draw(mutate_json(spec))
    text = json.dumps(spec)
    if how == "text":
        text = draw(st.one_of(st.text(max_size=200), st.sampled_from(
            ["", " ", "null", "[]", "[" * 100000, '{"root": {"path": "@ROOTFS@"}, "process": {"env": "x"}}',
             '{"root": {"path": "@ROOTFS@"}, "process": [1]}', '\ufeff{}'])))
    elif how == "truncate":
        text = text[:draw(st.integers(0, len(text)))]
    return text


@st.composite
def pipeline_cases(draw):
    host = draw(st.sampled_from(FUZZ_HOSTS))
    return {
        "host": host,
        "rootfs": draw(st.sampled_from(FUZZ_CONTAINERS)),
        "nvhook_config": draw(nvhook_raw),
        "cache": True,
        "bundle_config": draw(bundle_configs(host)),
        "state": {"id": draw(st.text(max_size=12)), "pid": draw(st.none() | st.integers(1, 2**22)),
                  "bundle": draw(st.sampled_from(["@BUNDLE@"] * 12 + ["@BUNDLE@/missing", "@BUNDLE@\x00",
                                                                       "@BUNDLE@\nsecond line"]))},
    }


# --- 1. the decision pipeline over generated bundles --------------------------------------------

@budget(700)
@given(case=pipeline_cases())
def test_pipeline_on_generated_bundles(ctx, case):
    with saved_on_failure("pipeline", "json", json.dumps(case, indent=1)), ctx.tmp() as d:
        event(run_case(case, ctx, d))


@pytest.mark.parametrize("host", FUZZ_HOSTS)
def test_oracle_agrees_with_the_fixture_hosts(ctx, host):
    """The oracle's view of a host (indices, minors, bus ids) is the one nvhook sees."""
    case = {"host": host, "rootfs": "container-debian", "nvhook_config": {},
            "bundle_config": json.dumps(mf.oci_config("@ROOTFS@", ["NVIDIA_VISIBLE_DEVICES=all",
                                                                  "NVIDIA_DRIVER_CAPABILITIES=all"])),
            "state": {"id": "x", "pid": None, "bundle": "@BUNDLE@"}}
    with ctx.tmp() as d:
        assert run_case(case, ctx, d) == "plan"
    for g in mf.HOSTS[host].gpus:
        case["bundle_config"] = json.dumps(mf.oci_config("@ROOTFS@", [f"NVIDIA_VISIBLE_DEVICES={g.uuid}"]))
        with ctx.tmp() as d:
            assert run_case(case, ctx, d) == "plan"


# --- 2. the OCI state on stdin ------------------------------------------------------------------

def check_state(data: bytes) -> None:
    try:
        with time_limit(EXAMPLE_LIMIT, "oci.parse_state"):
            state = oci.parse_state(data)
    except HookError as e:
        check_error(e)
        return
    assert set(state) == {"id", "pid", "bundle", "annotations"}
    assert isinstance(state["id"], str)
    assert isinstance(state["bundle"], str) and state["bundle"]
    pid = state["pid"]
    assert pid is None or (type(pid) is int and pid > 0)


state_docs = st.fixed_dictionaries({}, optional={
    "ociVersion": json_values, "id": st.text(max_size=10) | json_values, "status": json_values,
    "pid": st.integers(-2, 2**64) | json_values, "bundle": st.text(max_size=20) | json_values,
    "bundlePath": st.text(max_size=20) | json_values, "root": st.text(max_size=20) | json_values,
    "annotations": json_values})


@budget(500)
@given(data=st.one_of(
    st.binary(max_size=300),
    state_docs.map(lambda d: json.dumps(d).encode()),
    state_docs.map(lambda d: json.dumps(d, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.sampled_from([b"[" * 100000, b"{" * 100000, b'{"bundle": "' + b"x" * 300000 + b'"}',
                     b'{"bundle": "/b", "pid": 1' + b"0" * 5000 + b"}", b'{"bundle": "/b", "pid": 1e999}',
                     b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"bundle": "/b", "pid": true}'])))
def test_oci_state_parser(data):
    with saved_on_failure("state", "bin", data):
        check_state(data)


NVHOOK_BIN = Path(sys.executable).with_name("nvhook")


def run_cli(args: list[str], stdin: bytes, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(NVHOOK_BIN)] if NVHOOK_BIN.exists() else [sys.executable, "-m", "nvhook"]
    base = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run(cmd + args, input=stdin, capture_output=True, timeout=60, env={**base, **(env or {})})


def assert_one_line_failure(proc: subprocess.CompletedProcess) -> None:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nvhook: "), err


@pytest.mark.parametrize("mode", ["dry-run", "hook"])
@pytest.mark.parametrize("stdin", [b"\x00\xffgarbage{", b'{"bundle": "/nonexistent\\nsecond line", "pid": 1}',
                                   b'{"bundle": "/b\\u0000c", "pid": 1}'], ids=["garbage", "newline", "nul"])
def test_cli_garbage_stdin_is_one_line(tmp_path, mode, stdin):
    """The real entry points: exit 1 and a single 'nvhook: ...' stderr line, no traceback."""
    args = ["--dry-run"] if mode == "dry-run" else []
    proc = run_cli(["--root", str(tmp_path), "--log-file", "", *args], stdin)
    assert_one_line_failure(proc)


@pytest.mark.parametrize("value", ["/nonexistent/hook.toml\nsecond line", "/", "relative\x1b[2J"])
def test_cli_nvhook_config_env_is_one_line(tmp_path, value):
    proc = run_cli(["--root", str(tmp_path), "--log-file", ""], b"{}", env={"NVHOOK_CONFIG": value})
    assert_one_line_failure(proc)


# --- 3. config/hook.toml ------------------------------------------------------------------------

def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


toml_values = st.one_of(
    st.booleans().map(lambda b: "true" if b else "false"),
    st.integers(-10**20, 10**20).map(str),
    st.sampled_from(["nan", "inf", "-inf", "0.0", "1e-300", "600", "600.0001", "0", "-1", "1e309", "5.0"]),
    st.text(max_size=20).map(_toml_str),
    st.sampled_from(['"auto"', '"image"', '"host"', '"debug"', '"/run/nvhook"', '""', '"\\u0000"', '"a\\nb"',
                     "1979-05-27T07:32:00Z", "07:32:00", "[1, 2]", "[]", "{a = 1}", "{}", "'/tmp'",
                     '"""multi\nline"""', "'''\n'''", "0x10", "1_000", "1" * 5000, "0x" + "f" * 5000,
                     "[" * 3000 + "]" * 3000, "{a = " * 2000 + "1" + "}" * 2000, '"\\u2028"', '"\\u0085"']),
)
TOML_KEYS = ["root", "log_file", "log_level", "cache_dir", "accept_envvar_unprivileged", "accept_volume_mounts",
             "volume_mounts_root", "enabled", "timeout", "mode", "allow_env_override", "path", "bogus",
             '"quoted key"', "a.b", "devices.accept_volume_mounts", "nvml.timeout", '"a\\nb"', '"\\u0000"']
toml_lines = st.one_of(
    st.builds(lambda k, v: f"{k} = {v}", st.sampled_from(TOML_KEYS), toml_values),
    st.sampled_from(["[devices]", "[nvml]", "[compat]", "[ldconfig]", "[bogus]", "[devices.sub]", "[[nvml]]",
                     "[root]", "# comment", "", "[devices]\n[devices]", "key", "= 1", '["x\\ny"]',
                     '[devices."a\\nb"]']),
)


@st.composite
def toml_docs(draw, base: str):
    how = draw(st.sampled_from(["lines", "lines", "base-mutated", "text", "bytes"]))
    if how == "lines":
        return "\n".join(draw(st.lists(toml_lines, max_size=12))).encode("utf-8", "surrogatepass")
    if how == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    if how == "bytes":
        return draw(st.binary(max_size=200))
    lines = base.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "replace", "insert"]))
        if op == "delete":
            del lines[i]
        elif op == "replace":
            lines[i] = draw(toml_lines)
        else:
            lines.insert(i, draw(toml_lines))
        if not lines:
            break
    return "\n".join(lines).encode("utf-8", "surrogatepass")


def check_config(data: bytes, ctx: Ctx) -> None:
    from unittest import mock

    cache = ctx.work / "config-cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    path = ctx.work / f"hook-{next(ctx.counter)}.toml"  # a new file each time: no stale cache identity
    path.write_bytes(data)
    read_cache = config._read_cache

    def write_cache(directory, ident, cfg):
        config.write_json_atomic(str(cache), "config.json", {"ident": ident, "config": cfg})

    try:
        with mock.patch.object(config, "_read_cache", lambda d, ident: read_cache(str(cache), ident)), \
                mock.patch.object(config, "_write_cache", write_cache), \
                time_limit(EXAMPLE_LIMIT, "config.load"):
            try:
                cfg = config.load(str(path), explicit=True)
            except HookError as e:
                check_error(e)
                return
            again = config.load(str(path), explicit=True)  # from the JSON cache this time
    finally:
        path.unlink()
    assert again == cfg, "the cached config differs from the parsed one"
    assert set(cfg) == set(config.DEFAULTS)
    for key, default in config.DEFAULTS.items():
        if isinstance(default, dict):
            assert set(cfg[key]) == set(default), key
    for name, want in config.TYPES.items():
        section, _, sub = name.partition(".")
        value = cfg[section][sub] if sub else cfg[section]
        assert isinstance(value, want) and (want is bool or not isinstance(value, bool)), (name, value)
        if isinstance(value, str):
            assert "\x00" not in value, f"{name} contains NUL: {value!r}"
        if name.endswith("timeout"):
            assert 0 < value <= 600
    for name, choices in config._CHOICES.items():
        section, _, sub = name.partition(".")
        assert (cfg[section][sub] if sub else cfg[section]) in choices
    # What the hook does next with these values must not crash either.
    try:
        pipeline.root_from(None, cfg)
    except HookError as e:
        check_error(e)
    config.cache_usable(cfg["cache_dir"])
    EventLog(cfg["log_level"], None)


@budget(400)
@given(data=st.data())
def test_config_toml(ctx, data):
    base = (Path(__file__).resolve().parents[1] / "config" / "hook.toml").read_text()
    doc = data.draw(toml_docs(base))
    with saved_on_failure("config", "toml", doc):
        check_config(doc, ctx)


# --- 4. ld.so.cache: cost bounds, and the inventory on corrupt caches ---------------------------
# (tests/test_ldcache.py fuzzes ldcache.parse for exceptions; here: time/size bounds and what
# the inventory and the plan make of a corrupt cache.)

LDCACHE_LIMIT = 2.0  # seconds of CPU for one parse of at most a few hundred KiB


def check_ldcache_parse(data: bytes) -> list | None:
    with cpu_seconds() as took:
        try:
            with time_limit(EXAMPLE_LIMIT, "ldcache.parse"):
                out = ldcache.parse(data)
        except ValueError:
            out = None
    assert took.seconds < LDCACHE_LIMIT, f"ldcache.parse took {took.seconds:.2f} s of CPU for {len(data)} bytes"
    if out is not None:
        # Memory held: distinct string objects (entries may share one).
        total = sum(len(x) for x in {id(x): x for e in out for x in e[:2]}.values())
        assert all(len(k) <= 4096 and len(p) <= 4096 for k, p, _ in out), "a string longer than PATH_MAX"
        assert total <= 8 * len(data) + 65536, f"{len(data)} bytes gave {total} characters of strings"
    return out


@st.composite
def amplifying_caches(draw):
    """Valid headers whose many entries all point at a few long strings: cost quadratic in the
    file size if each entry rescans its string."""
    size = draw(st.integers(1 << 12, 1 << 17))
    share = draw(st.floats(0.2, 0.8))
    nlibs = int(size * share) // 24
    hdr = ldcache.NEW_HEADER.size
    strings_at = hdr + nlibs * 24
    length = max(1, size - strings_at - 1)
    n_strings = draw(st.integers(1, 4))
    starts = [strings_at + i * (length // n_strings) for i in range(n_strings)]
    fill = draw(st.sampled_from([b"A", b"/usr/lib/x86_64-linux-gnu/libcuda.so.1", b"\xff"]))
    body = bytearray((fill * (length // len(fill) + 1))[:length] + b"\0")
    for s in starts[1:]:
        if draw(st.booleans()):
            body[s - strings_at - 1] = 0  # split into several strings, or keep one long one
    entries = b"".join(ldcache.NEW_ENTRY.pack(0x0303, draw(st.sampled_from(starts)),
                                               draw(st.sampled_from(starts)), 0, 0) for _ in range(nlibs))
    head = ldcache.NEW_HEADER.pack(ldcache.NEW_MAGIC, nlibs, len(body), 0)
    data = head + entries + bytes(body)
    if draw(st.booleans()):  # behind an old-format table, as `ldconfig -c compat` writes
        nold = draw(st.integers(0, 8))
        old = ldcache.OLD_MAGIC + b"\0" + struct.pack("<I", nold) + bytes(12 * nold)
        old += bytes(-len(old) % 8)
        data = old + data
    return data


@budget(40)
@given(data=amplifying_caches())
def test_ldcache_parse_cost_is_bounded(data):
    with saved_on_failure("ldcache", "bin", data):
        check_ldcache_parse(data)


@pytest.fixture(scope="module")
def private_host(ctx) -> Path:
    """A private copy of host-gpu8 (32-bit libraries, a stale libcuda, MIG) whose etc/ld.so.cache
    the tests rewrite."""
    return mf.build_host("host-gpu8", ctx.work / "hosts")


@pytest.fixture(scope="module")
def private_small_host(ctx) -> Path:
    """A private copy of host-gpu1 (fewer libraries: a cheaper inventory) whose proc/ the tests rewrite."""
    return mf.build_host("host-gpu1", ctx.work / "hosts")


@contextlib.contextmanager
def replaced(path: Path, data: bytes | None):
    """Temporarily replace a file's content (None: remove it)."""
    orig = path.read_bytes() if path.exists() else None
    if path.exists() or path.is_symlink():
        path.unlink()
    if data is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    try:
        yield
    finally:
        if path.exists() or path.is_symlink():
            path.unlink()
        if orig is not None:
            path.write_bytes(orig)


ALL_ENV = ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=all"]
HOST_ENVS = [ALL_ENV, ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"],
             ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_DRIVER_CAPABILITIES=graphics"],
             ["NVIDIA_VISIBLE_DEVICES=none", "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
             ["NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_DRIVER=driver>=500 arch>=8.0", "CUDA_VERSION=12.0.1"]]


def check_host(root: Path, ctx: Ctx, envs: list[list[str]], inventory_too: bool = True) -> None:
    """inventory.build_files gives a dict or a HookError; then the plan keeps its invariants."""
    if inventory_too:
        try:
            with time_limit(EXAMPLE_LIMIT, "inventory.build_files"):
                files = inventory.build_files(str(root))
        except HookError as e:
            check_error(e)
            return
        json.dumps(files)
        for lib in files["libraries"]:
            assert _inside(lib["source"], str(root)), lib
            assert "/" not in lib["file"], lib
            assert lib["file"].startswith(lib["name"] + "."), \
                f"ld.so.cache key {lib['name']} resolved to {lib['path']}, a different library"
            assert lib["soname"] not in (".", "..") and "/" not in lib["soname"], \
                f"{lib['path']} has SONAME {lib['soname']!r}, which becomes a symlink path"
    rootfs = str(ctx.fixtures / "container-debian")
    cfg = nvhook_config({"nvml": {"enabled": False}}, "")  # no cache: the files change under it
    for env in envs:
        with ctx.tmp() as d:
            text = json.dumps(mf.oci_config(rootfs, env))
            Path(d, "config.json").write_text(text)
            exp = Expect(text.encode(), d, cfg, GpuFacts.of_procfs(str(root)))
            plan = run_decide({"id": "x", "pid": None, "bundle": d}, cfg, str(root))
            if plan is not None:
                check_plan(plan, str(root), rootfs, exp)


def _cache_strings(data: bytes) -> list[int]:
    """Offsets (relative to the header) of the strings real entries use: plausible bad values."""
    n = struct.unpack_from("<I", data, 20)[0]
    offs = []
    for i in range(n):
        _f, k, v, _o, _h = ldcache.NEW_ENTRY.unpack_from(data, 48 + 24 * i)
        offs += [k, v]
    return sorted(set(offs))


@st.composite
def mutated_caches(draw, base: bytes):
    b = bytearray(base)
    n = struct.unpack_from("<I", base, 20)[0]
    strings = _cache_strings(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["swap-string", "swap-string", "u32", "flip", "truncate"]))
        if op == "swap-string":  # an entry's key or path pointing at another real string
            pos = 48 + 24 * draw(st.integers(0, n - 1)) + draw(st.sampled_from([4, 8]))
            if pos + 4 <= len(b):
                struct.pack_into("<I", b, pos, draw(st.sampled_from(strings)))
        elif op == "u32":
            pos = draw(st.sampled_from([20, 24, 32] + [48 + 24 * i + f for i in range(n) for f in (0, 4, 8)]))
            if pos + 4 <= len(b):
                struct.pack_into("<I", b, pos, draw(st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(b), len(b) - 1,
                                                                     0x0003, 0x0303, 0x0a03])))
        elif op == "flip":
            pos = draw(st.integers(0, len(b) - 1))
            b[pos] = draw(st.integers(0, 255))
        else:
            del b[draw(st.integers(0, len(b))):]
        if not b:
            break
    return bytes(b)


@budget(80)
@given(data=st.data())
def test_inventory_on_corrupt_ld_so_cache(ctx, private_host, data):
    base = (ctx.fixtures / "host-gpu8/etc/ld.so.cache").read_bytes()
    cache = data.draw(mutated_caches(base))
    with saved_on_failure("ldcache", "bin", cache), replaced(private_host / "etc/ld.so.cache", cache):
        check_ldcache_parse(cache)
        check_host(private_host, ctx, data.draw(st.lists(st.sampled_from(HOST_ENVS), max_size=1)))


def test_ld_so_cache_that_is_a_fifo_does_not_hang(ctx, private_host):
    cache = private_host / "etc/ld.so.cache"
    with replaced(cache, None):
        os.mkfifo(cache)
        check_host(private_host, ctx, [])


HOST_LIBDIR = "usr/lib/x86_64-linux-gnu"
SONAMES = ["../../../pwn", "a/b", "/abs", ".", "..", "", "x\ny", "libcuda.so.1", "libcuda.so.2", " "]


@budget(40)
@given(data=st.data())
def test_inventory_on_mutated_host_libraries(ctx, private_host, data):
    """A host driver library with a forged SONAME or damaged headers: the inventory skips it or
    records a name that is a plain file name; the plan's links stay in the library dirs."""
    name = data.draw(st.sampled_from(["libcuda", "libnvidia-ml", "libGLX_nvidia", "libnvidia-opticalflow"]))
    path = private_host / HOST_LIBDIR / f"{name}.so.535.261.03"
    lib = bytearray(path.read_bytes())
    soname = {"libGLX_nvidia": b"libGLX_nvidia.so.0"}.get(name, f"{name}.so.1".encode())
    at = lib.find(soname + b"\0")
    if data.draw(st.booleans()) and at > 0:
        new = data.draw(st.one_of(st.sampled_from(SONAMES), st.text(max_size=len(soname))))
        new = new.encode("utf-8", "surrogatepass")[:len(soname)]
        lib[at:at + len(soname) + 1] = new + b"\0" * (len(soname) + 1 - len(new))
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, min(len(lib), 1024) - 1))
            lib[pos] = data.draw(st.integers(0, 255))
    env = data.draw(st.sampled_from(HOST_ENVS))
    with saved_on_failure("hostlib", "bin", bytes(lib)), replaced(path, bytes(lib)):
        check_host(private_host, ctx, [env])


def test_driver_version_guessed_from_an_odd_file_name(ctx, tmp_path):
    """No /proc/driver/nvidia/version and libcuda.so.1 -> libcuda.so.1.bak: the version guessed
    from the file name is '1.bak'. Requirements on it must fail cleanly, not raise ValueError
    (nvhook/requirements.py before the fix)."""
    root = mf.build_host("host-gpu1", tmp_path)
    (root / "proc/driver/nvidia/version").unlink()
    libdir = root / HOST_LIBDIR
    (libdir / "libcuda.so.1.bak").write_bytes((libdir / "libcuda.so.535.261.03").read_bytes())
    (libdir / "libcuda.so.1").unlink()
    (libdir / "libcuda.so.1").symlink_to("libcuda.so.1.bak")
    (libdir / "libnvidia-ml.so.1").unlink()
    (libdir / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.x")
    for env in (["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_REQUIRE_CUDA=driver>=1"],
                ["NVIDIA_VISIBLE_DEVICES=all", "CUDA_VERSION=12.0"],
                ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_REQUIRE_ARCH=arch>=7.0 driver<2"]):
        check_host(root, ctx, [env])


# --- 5. procfs ----------------------------------------------------------------------------------

def _information(g: mf.Gpu) -> str:
    return (f"Model: \t\t {g.name}\nIRQ:   \t\t 42\nGPU UUID: \t {g.uuid}\nVideo BIOS: \t {g.vbios}\n"
            f"Bus Type: \t PCIe\nDMA Size: \t 47 bits\nDMA Mask: \t 0x7fffffffffff\n"
            f"Bus Location: \t {g.bus_id}\nDevice Minor: \t {g.minor}\nGPU Excluded:\t No\n")


GPU8 = mf.HOSTS["host-gpu8"]
NVML_GPUS = [{"index": g.index, "minor": g.minor, "uuid": g.uuid, "bus_id": g.bus_id, "model": g.name,
              "brand": compat.BRANDS.get(g.brand), "brand_id": g.brand, "source": "nvml"} for g in GPU8.gpus]
BAD_NUMBERS = ["", "0", "00", "-1", "1.5", "\u00b2", "\u0663", "\uff11", "9" * 30, "9" * 5000, "0x10", " 7 ", "NaN"]
line_values = st.one_of(st.sampled_from(BAD_NUMBERS), junk)


@st.composite
def text_files(draw, base: str):
    """A procfs file: the real text with some lines mutated, or garbage."""
    how = draw(st.sampled_from(["mutated", "mutated", "mutated", "binary", "huge", "empty"]))
    if how == "binary":
        return draw(st.binary(max_size=300))
    if how == "huge":
        return draw(st.sampled_from([b"x" * 200000, b"Device Minor: " + b"1" * 100000, b"\n" * 100000,
                                     (base * 2000).encode()]))
    if how == "empty":
        return b""
    lines = base.splitlines()
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["value", "value", "delete", "dup", "nocolon", "insert"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if not lines:
            lines.append(draw(junk))
        elif op == "value":
            key = lines[i].split(":")[0] if ":" in lines[i] else lines[i].split(" ")[0]
            sep = ":" if ":" in lines[i] else " "
            lines[i] = f"{key}{sep} {draw(line_values)}"
        elif op == "delete":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "nocolon":
            lines[i] = lines[i].replace(":", "")
        else:
            lines.insert(i, draw(junk))
    return "\n".join(lines).encode("utf-8", "surrogatepass")


bus_names = st.one_of(st.sampled_from([g.bus_id for g in GPU8.gpus] + ["zzz", "0000:00:00.0", "\u00e9"]),
                      st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
                              min_size=1, max_size=20).filter(lambda s: s not in (".", "..")))
VERSION_TEXT = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Tue Nov 18 2025\n"
                "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
MIG_MINORS_TEXT = "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"
DEVICES_TEXT = ("Character devices:\n  1 mem\n195 nvidia-frontend\n195 nvidia\n235 nvidia-uvm\n236 nvidia-caps\n\n"
                "Block devices:\n  8 sd\n")


@st.composite
def procfs_trees(draw):
    """{relative path: bytes | "fifo" | "dir"} for a host root's proc/."""
    files: dict[str, object] = {}
    for g in draw(st.lists(st.sampled_from(GPU8.gpus), max_size=3)):
        bus = draw(bus_names)
        files[f"proc/driver/nvidia/gpus/{bus}/information"] = draw(
            st.one_of(text_files(_information(g)), st.sampled_from(["fifo", "dir"])))
    for rel, base in (("proc/driver/nvidia/version", VERSION_TEXT), ("proc/devices", DEVICES_TEXT),
                      ("proc/driver/nvidia-caps/mig-minors", MIG_MINORS_TEXT)):
        if draw(st.integers(0, 3)):
            files[rel] = draw(st.one_of(text_files(base), st.sampled_from(["fifo", "dir"])))
    return files


def materialise(root: Path, files: dict) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            continue
        if content == "fifo":
            os.mkfifo(p)
        elif content == "dir":
            p.mkdir()
        else:
            p.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))


def check_procfs(root: str) -> None:
    with time_limit(EXAMPLE_LIMIT, "procfs"):
        gpus, problems = procfs.gpus(root)
        version = procfs.driver_version(root)
        majors = procfs.char_majors(root)
        migs = procfs.mig_minors(root)
        if hasattr(procfs, "mig_instances"):
            assert all(isinstance(x, str) for x in procfs.mig_instances(root))
    assert all(isinstance(p, str) for p in problems)  # log fields (JSON), not stderr lines
    for i, g in enumerate(gpus):
        assert g["index"] == i and type(g["minor"]) is int and g["minor"] >= 0
        assert all(isinstance(g[k], str) for k in ("uuid", "bus_id", "model", "proc_dir"))
        assert "/" not in g["proc_dir"][len(procfs.NVIDIA + "/gpus/"):]
    if version is not None:
        parts = version.split(".")
        assert len(parts) >= 2 and all(p.isascii() and p.isdigit() for p in parts), version
    assert all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in majors.items())
    assert all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in migs.items())


def _encode_tree(files: dict) -> str:
    return json.dumps({"files": {k: (v if isinstance(v, str) else {"base64": base64.b64encode(v).decode()})
                                 for k, v in files.items()}}, indent=1)


def _decode_tree(text: str) -> dict:
    return {k: (base64.b64decode(v["base64"]) if isinstance(v, dict) else v)
            for k, v in json.loads(text)["files"].items()}


@budget(300)
@given(files=procfs_trees())
def test_procfs_readers(ctx, files):
    with saved_on_failure("procfs", "json", _encode_tree(files)), ctx.tmp() as d:
        materialise(Path(d), files)
        check_procfs(d)


@contextlib.contextmanager
def procfs_replaced(root: Path, files: dict):
    """The private host's proc/ replaced by `files` (nvidia GPU dirs and the files named)."""
    import shutil

    proc = root / "proc"
    saved = root.parent / "proc.saved"
    shutil.copytree(proc, saved, symlinks=True)
    try:
        shutil.rmtree(proc / "driver/nvidia/gpus", ignore_errors=True)
        for rel in files:
            p = root / rel
            if p.is_file() or p.is_symlink():
                p.unlink()
        materialise(root, files)
        yield
    finally:
        shutil.rmtree(proc)
        saved.rename(proc)


@budget(60)
@given(files=procfs_trees(), env=st.sampled_from(HOST_ENVS))
def test_pipeline_on_corrupt_procfs(ctx, private_small_host, files, env):
    host = private_small_host
    with saved_on_failure("procfs", "json", _encode_tree(files)), procfs_replaced(host, files):
        check_procfs(str(host))
        check_host(host, ctx, [env], inventory_too=False)


# --- 6. ELF: compat libraries found in an image -------------------------------------------------
# (tests/test_elf.py fuzzes elf.elf_facts/fwd_compat_note directly; here: the image scan and
# the compat decision on top of them.)

@st.composite
def mutated_elf(draw, good: bytes) -> bytes:
    b = bytearray(good)
    phoff, shoff = struct.unpack_from("<QQ", good, 32)
    phnum, shnum = struct.unpack_from("<H", good, 56)[0], struct.unpack_from("<H", good, 60)[0]
    note = good.find(b"NVIDIA Corporation") - 12
    regions = {"header": (0, 64), "phdrs": (phoff, phoff + 56 * phnum),
               "shdrs": (shoff, min(len(good), shoff + 64 * shnum)), "note": (note, note + 160),
               "anywhere": (0, len(good))}
    for _ in range(draw(st.integers(1, 6))):
        lo, hi = regions[draw(st.sampled_from(sorted(regions)))]
        pos = draw(st.integers(lo, max(lo, min(hi, len(b)) - 1)))
        if pos >= len(b):
            continue
        if draw(st.booleans()):
            b[pos] = draw(st.integers(0, 255))
        else:
            val = draw(st.sampled_from([0, 1, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF, len(good), 2**63, 0x7FFFFFFF]))
            width = 8 if val > 0xFFFFFFFF else 4
            if pos + width <= len(b):
                b[pos:pos + width] = val.to_bytes(width, "little")
    if draw(st.integers(0, 3)) == 0:
        del b[draw(st.integers(0, len(b))):]
    return bytes(b)


def check_compat_scan(rootfs: str, host_driver: str = "535.261.03") -> list:
    with time_limit(EXAMPLE_LIMIT, "image.find_compat_libs"):
        found = image.find_compat_libs(rootfs, host_driver)
    assert isinstance(found, list)
    for c in found:
        assert {"name", "container_path", "host_path", "library", "version", "note", "note_error", "skipped"} <= set(c)
        assert c["note"] is None or isinstance(c["note"], dict)
        assert c["note_error"] is None or (isinstance(c["note_error"], str) and c["note_error"])
        if c["host_path"] is not None:
            assert _inside(c["host_path"], rootfs) and stat.S_ISREG(os.lstat(c["host_path"]).st_mode)
        json.dumps(c)
    gpus = NVML_GPUS
    for mode in MODES:
        for sel in (gpus[:1], gpus[6:7], []):
            d = compat.decide(["compute", "utility"], host_driver, sel, found, mode)
            assert d["decision"] in ("host", "image")
            usable = {c["container_path"] for c in found if not c.get("skipped")}
            assert set(d["libraries"]) <= usable
            if d["decision"] == "image" and mode == "auto":
                assert not any(c.get("note_error") for c in d["selected"] if c["library"] == "libcuda")
    return found


@budget(250)
@given(data=st.data())
def test_compat_scan_on_mutated_libraries(ctx, data):
    lib = data.draw(mutated_elf(ctx.good_lib))
    with saved_on_failure("elf", "bin", lib), ctx.tmp() as d:
        compat_dir = Path(d, "usr/local/cuda-12.4/compat")
        compat_dir.mkdir(parents=True)
        Path(d, "usr/local/cuda").symlink_to("cuda-12.4")
        (compat_dir / f"libcuda.so.{NEW_COMPAT}").write_bytes(lib)
        check_compat_scan(d)


def _note_docs(size: int):
    ints = st.one_of(st.sampled_from([535, 550, 470, 2, 5, 14, 15, 0, -1]), st.integers(-2**70, 2**70))
    driver = st.lists(st.sampled_from([535, 550, 470, 418]), max_size=4)
    device = st.lists(st.integers(0, 17), max_size=10)
    doc = st.fixed_dictionaries({}, optional={
        "Format": st.one_of(ints, ints, json_values),
        "CUDA Version": st.one_of(st.sampled_from(["12.4", "11.3", 12.4]), json_values),
        "Driver": st.one_of(driver, driver, driver, st.lists(st.one_of(ints, json_values), max_size=4), json_values),
        "Device": st.one_of(device, device, device, st.lists(st.one_of(st.integers(0, 17), json_values), max_size=4),
                            json_values)})
    text = st.one_of(doc.map(json.dumps), doc.map(json.dumps), doc.map(json.dumps), json_values.map(json.dumps),
                     st.text(max_size=40),
                     st.sampled_from(["[" * 200, '{"Driver": [535], "Driver": "x"}', "{}", '{"Device": []}']))
    return text.map(lambda t: t.encode("utf-8", "surrogatepass")).filter(lambda b: len(b) <= size)


@budget(250)
@given(data=st.data())
def test_compat_decision_on_generated_notes(ctx, data):
    """Any JSON (or not) in a compat libcuda's .note.cuda.fwd_compatibility: the scan never
    raises, and mode auto uses the library only on GPUs and a driver branch the note allows."""
    desc = data.draw(_note_docs(ctx.note_size))
    lib = bytearray(ctx.roomy_lib)
    lib[ctx.note_at:ctx.note_at + ctx.note_size] = desc.ljust(ctx.note_size, b" ")
    with saved_on_failure("elf", "bin", bytes(lib)), ctx.tmp() as d:
        compat_dir = Path(d, "usr/local/cuda/compat")
        compat_dir.mkdir(parents=True)
        (compat_dir / f"libcuda.so.{NEW_COMPAT}").write_bytes(bytes(lib))
        found = check_compat_scan(d)
        cand = [c for c in found if c["library"] == "libcuda"]
        assert len(cand) == 1
        note, error = cand[0]["note"], cand[0]["note_error"]
        event("note: " + ("error" if error else "none" if note is None else "parsed"))
        if note is not None:
            for key in ("Driver", "Device"):
                v = note.get(key)
                assert v is None or (isinstance(v, list) and all(type(x) is int for x in v)), note
        for gpus in ([NVML_GPUS[0]], [NVML_GPUS[4]], [NVML_GPUS[6]], NVML_GPUS[:2], [NVML_GPUS[0], NVML_GPUS[7]]):
            dec = compat.decide(["compute", "utility"], "535.261.03", gpus, found, "auto")
            event(f"decision on {len(gpus)} GPU(s): {dec['decision']}")
            if dec["decision"] != "image":
                continue
            assert error is None, "a compat libcuda with a malformed note was used"
            if note and note.get("Driver"):
                assert 535 in note["Driver"], f"used although the note's Driver list {note['Driver']} lacks 535"
            for g in gpus:
                if note and note.get("Device"):
                    assert g["brand_id"] in note["Device"], f"used on brand {g['brand_id']}, not in {note['Device']}"
                else:
                    assert g["brand"] in compat.DATACENTER_BRANDS, f"used on {g['model']} without a Device list"


# --- 7. hostile image layouts through the pipeline ----------------------------------------------

DIR_KINDS = ["dir", "missing", "host-abs-link", "dotdot-link", "loop", "file", "fifo"]
CUDA_KINDS = ["dir", "rel-link", "abs-link", "host-abs-link", "dotdot-link", "loop", "root-link", "missing", "file"]
COMPAT_KINDS = ["dir", "dir", "host-abs-link", "dotdot-link", "etc-link", "fifo", "file", "missing"]
ENTRY_KINDS = ["elf", "elf", "elf-old", "mutated", "link-shadow", "link-host-abs", "link-dotdot", "link-rel", "fifo",
               "dir", "hardlink-outside", "empty"]
OLD_COMPAT = "container-cuda113/usr/local/cuda-11.3/compat/libcuda.so.465.19.01"
ENTRY_NAMES = [f"libcuda.so.{NEW_COMPAT}", "libcuda.so.465.19.01", f"libnvidia-ptxjitcompiler.so.{NEW_COMPAT}",
               "libcuda.so.999.99.99", "libcuda.so.1"]


def _place(host_path: Path, kind: str, outside_target: Path, self_name: str) -> None:
    host_path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dir":
        host_path.mkdir(exist_ok=True)
    elif kind == "host-abs-link":
        host_path.symlink_to(outside_target)
    elif kind == "dotdot-link":
        host_path.symlink_to(os.path.relpath(outside_target, host_path.parent))
    elif kind == "loop":
        host_path.symlink_to(self_name)
    elif kind == "file":
        host_path.write_bytes(b"not a directory")
    elif kind == "fifo":
        os.mkfifo(host_path)


def build_layout(rootfs: Path, layout: dict, ctx: Ctx) -> str:
    """A container rootfs with hostile links where nvhook looks (see the *_KINDS lists)."""
    outside = ctx.outside
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/shadow").write_text("root:inside-the-rootfs:::\n")
    if layout.get("debian"):
        (rootfs / "etc/debian_version").write_text("12.5\n")
    (rootfs / "usr/local").mkdir(parents=True)
    _place(rootfs / "usr/lib/x86_64-linux-gnu", layout["libdir"], outside / "libdir", "x86_64-linux-gnu")
    cuda = layout["cuda"]
    parent: Path | None = None
    if cuda == "dir":
        parent = rootfs / "usr/local/cuda"
        parent.mkdir()
    elif cuda in ("rel-link", "abs-link"):
        parent = rootfs / "usr/local/cuda-11.3"
        parent.mkdir()
        (rootfs / "usr/local/cuda").symlink_to("cuda-11.3" if cuda == "rel-link" else "/usr/local/cuda-11.3")
    elif cuda == "root-link":
        (rootfs / "usr/local/cuda").symlink_to("/")
        parent = rootfs
    else:
        _place(rootfs / "usr/local/cuda", cuda, outside / "cuda-11.3", "cuda")
    if parent is None:
        return str(rootfs)
    comp = parent / "compat"
    kind = layout["compat"]
    entries_in = None
    if kind == "dir":
        comp.mkdir(exist_ok=True)
        entries_in = comp
    elif kind == "etc-link":
        comp.symlink_to("/etc")
        entries_in = rootfs / "etc"
    else:
        _place(comp, kind, outside / "cuda-11.3/compat", "compat")
    if entries_in is None:
        return str(rootfs)
    for name, ekind, patches in layout["entries"]:
        p = entries_in / name
        if p.exists() or p.is_symlink():
            continue
        if ekind == "elf":
            p.write_bytes(ctx.good_lib)
        elif ekind == "elf-old":
            p.write_bytes((ctx.fixtures / OLD_COMPAT).read_bytes())
        elif ekind == "mutated":
            b = bytearray(ctx.good_lib)
            for pos, val in patches:
                if pos < len(b):
                    b[pos] = val
            p.write_bytes(bytes(b))
        elif ekind == "link-shadow":
            p.symlink_to("/etc/shadow")
        elif ekind == "link-host-abs":
            p.symlink_to(ctx.good_lib_path)
        elif ekind == "link-dotdot":
            p.symlink_to(os.path.relpath(ctx.good_lib_path, p.parent))
        elif ekind == "link-rel":
            (entries_in / "real.so").write_bytes(ctx.good_lib)
            p.symlink_to("real.so")
        elif ekind == "fifo":
            os.mkfifo(p)
        elif ekind == "dir":
            p.mkdir()
        elif ekind == "hardlink-outside":
            try:
                os.link(ctx.good_lib_path, p)
            except OSError:
                p.write_bytes(ctx.good_lib)
        elif ekind == "empty":
            p.write_bytes(b"")
    return str(rootfs)


layouts = st.fixed_dictionaries({
    "debian": st.booleans(),
    "libdir": st.sampled_from(DIR_KINDS),
    "cuda": st.sampled_from(CUDA_KINDS),
    "compat": st.sampled_from(COMPAT_KINDS),
    "entries": st.lists(st.tuples(st.sampled_from(ENTRY_NAMES), st.sampled_from(ENTRY_KINDS),
                                  st.lists(st.tuples(st.integers(0, 20000), st.integers(0, 255)), max_size=4)),
                        max_size=4),
})
compute_env = st.builds(
    lambda dev, caps, mode, extra: [f"NVIDIA_VISIBLE_DEVICES={dev}", f"NVIDIA_DRIVER_CAPABILITIES={caps}",
                                    *([f"NVHOOK_COMPAT_MODE={mode}"] if mode else []), *extra],
    st.sampled_from(["0", "all", "none", "6", "0,6", "2", "0:0"]),
    st.sampled_from(["compute,utility", "compute", "video", "all", "utility", "compat32,compute", "graphics"]),
    st.sampled_from([None, "auto", "image", "host"]),
    st.lists(st.sampled_from(["CUDA_VERSION=12.4.0", "NVIDIA_REQUIRE_CUDA=cuda>=12.4", "NVIDIA_DISABLE_REQUIRE=1"]),
             max_size=2))


@st.composite
def layout_cases(draw):
    return {
        "host": draw(st.sampled_from(["host-gpu8", "host-gpu8", "host-debian"])),
        "rootfs": {"layout": draw(layouts)},
        "nvhook_config": draw(st.fixed_dictionaries({}, optional={
            "compat": st.fixed_dictionaries({"mode": st.sampled_from(MODES)})})),
        "cache": True,
        "bundle_config": json.dumps(mf.oci_config("@ROOTFS@", draw(compute_env))),
        "state": {"id": "layout", "pid": None, "bundle": "@BUNDLE@"},
    }


@budget(300)
@given(case=layout_cases())
def test_pipeline_on_hostile_image_layouts(ctx, case):
    with saved_on_failure("layout", "json", json.dumps(case, indent=1)), ctx.tmp() as d:
        event(run_case(case, ctx, d))
        check_compat_scan(str(Path(d) / "rootfs"))


def test_hostile_layouts_exercise_the_image_decision(ctx):
    """The layout property is only meaningful if good compat libraries do get used."""
    layout = {"debian": True, "libdir": "dir", "cuda": "rel-link", "compat": "dir",
              "entries": [[f"libcuda.so.{NEW_COMPAT}", "elf", []]]}
    case = {"host": "host-gpu8", "rootfs": {"layout": layout},
            "nvhook_config": {}, "bundle_config": json.dumps(mf.oci_config("@ROOTFS@", ["NVIDIA_VISIBLE_DEVICES=0"])),
            "state": {"id": "layout", "pid": None, "bundle": "@BUNDLE@"}}
    with ctx.tmp() as d:
        run_case(case, ctx, d)
        rootfs = str(Path(d) / "rootfs")
        bundle = os.path.join(d, "bundle")
        plan = pipeline.decide(OciBundle("x", None, bundle),
                               Host(str(ctx.fixtures / "host-gpu8"), nvhook_config({}, str(ctx.cache)),
                                    EventLog("debug"))).plan
        assert plan["compat"]["decision"] == "image", plan["compat"]
        assert [m for m in plan["mounts"] if m["kind"] == "compat" and _inside(m["source"], rootfs)]


# --- 8. the regression corpus -------------------------------------------------------------------

@pytest.mark.parametrize("path", corpus("state"))
def test_corpus_state(path):
    check_state(path.read_bytes())


@pytest.mark.parametrize("path", corpus("pipeline"))
def test_corpus_pipeline(ctx, path):
    with ctx.tmp() as d:
        run_case(json.loads(path.read_text()), ctx, d)


@pytest.mark.parametrize("path", corpus("layout"))
def test_corpus_layout(ctx, path):
    with ctx.tmp() as d:
        run_case(json.loads(path.read_text()), ctx, d)
        check_compat_scan(str(Path(d) / "rootfs"))


@pytest.mark.parametrize("path", corpus("config"))
def test_corpus_config(ctx, path):
    check_config(path.read_bytes(), ctx)


@pytest.mark.parametrize("path", corpus("ldcache"))
def test_corpus_ldcache(ctx, private_host, path):
    data = path.read_bytes()
    check_ldcache_parse(data)
    with replaced(private_host / "etc/ld.so.cache", data):
        check_host(private_host, ctx, HOST_ENVS)


@pytest.mark.parametrize("path", corpus("procfs"))
def test_corpus_procfs(ctx, private_small_host, path):
    files = _decode_tree(path.read_text())
    with ctx.tmp() as d:
        materialise(Path(d), files)
        check_procfs(d)
    with procfs_replaced(private_small_host, files):
        check_host(private_small_host, ctx, HOST_ENVS)


@pytest.mark.parametrize("path", corpus("elf"))
def test_corpus_elf(ctx, path):
    with ctx.tmp() as d:
        compat_dir = Path(d, "usr/local/cuda/compat")
        compat_dir.mkdir(parents=True)
        (compat_dir / f"libcuda.so.{NEW_COMPAT}").write_bytes(path.read_bytes())
        check_compat_scan(d)


@pytest.mark.parametrize("path", corpus("hostlib"))
def test_corpus_hostlib(ctx, private_host, path):
    """<library>--<what>.bin replaces <library>.so.535.261.03 of the private host-gpu8."""
    lib = private_host / HOST_LIBDIR / f"{path.name.split('--')[0]}.so.535.261.03"
    with replaced(lib, path.read_bytes()):
        check_host(private_host, ctx, HOST_ENVS)
