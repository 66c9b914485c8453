"""A container that asks for no GPU always starts, whatever is wrong with nvhook's config file,
its host root, its cache directory or its log file; a GPU container under a config or root
fault is refused with one line naming the problem.

Every case is a real `runc run` of the Debian fixture image, through each path a container
start takes: nvhook as a prestart hook (hook mode), nvhook's CDI hook (createContainer, `--cdi`)
and nvhook-runtime in front of runc. The warning is read where an operator finds it: the hook's
stderr (runc drops a successful hook's stderr, so the hook's is appended to a file:
runcbox.nvhook_bundle stderr_to), nvhook-runtime's `--log` file (its stderr is the container's log under an engine's
shim: it carries only a fatal error), and the log event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

WRAPPER = Path(sys.executable).with_name("nvhook-runtime")
pytestmark = [pytest.mark.runc,
              pytest.mark.skipif(rb.nvhook_skip_reason() is not None, reason=rb.nvhook_skip_reason() or "")]

SCRIPT = "echo STARTED; ls /dev | grep -c '^nvidia' || true"
FAULTS = ("bad-toml", "unknown-key", "wrong-root", "unwritable-log", "unwritable-cache", "missing-config",
          "fifo-config", "zero-config")
# The config path names no file nvhook can read (none, a FIFO, a link to /dev/zero): no line
# scan finds a log_file in it, so the hook is given one.
NO_FILE = ("missing-config", "fifo-config", "zero-config")
# What the warning (and, for a GPU container, the one error line) names, per fault.
SAYS = {
    "bad-toml": "is not valid TOML",
    "unknown-key": "unknown key 'log_levl'",
    "wrong-root": "host root /wrong-root-for-nvhook-tests",
    "unwritable-log": "cannot open log file",
    "missing-config": "cannot read config",
    "fifo-config": "is a FIFO, not a regular file",
    "zero-config": "(-> /dev/zero) is a character device, not a regular file",
}
EVENT = {"bad-toml": "config.unusable", "unknown-key": "config.unusable", "wrong-root": "root.unusable",
         "fifo-config": "config.unusable", "zero-config": "config.unusable"}
# Faults that stop a GPU container (the driver cannot be given as configured); the log and the
# cache are best effort: a GPU container still gets its GPU.
STOPS_GPU = ("bad-toml", "unknown-key", "wrong-root", "missing-config", "fifo-config", "zero-config")
# A hook or nvhook-runtime that blocked on a FIFO (or read /dev/zero for ever) is killed by then:
# the test fails, it does not hang.
HOOK_TIMEOUT = 15


class World:
    def __init__(self, tmp: Path, host: Path, fault: str):
        self.tmp = tmp
        self.host = host
        self.fault = fault
        self.log = tmp / "nvhook.jsonl"
        self.conf = tmp / "hook.toml"
        cache = tmp / "cache"
        log = self.log
        root = host
        if fault == "unwritable-log":
            (tmp / "a-file").write_text("")
            log = tmp / "a-file" / "nvhook.jsonl"  # its directory is a file: cannot be created
        if fault == "unwritable-cache":
            (tmp / "a-file").write_text("")
            cache = tmp / "a-file" / "cache"
        if fault == "wrong-root":
            root = Path("/wrong-root-for-nvhook-tests")
        rb.write_nvhook_config(self.conf, log_file=log, cache_dir=cache, root=root)
        if fault == "bad-toml":
            self.conf.write_text(self.conf.read_text() + "[devices\n")
        elif fault == "unknown-key":
            self.conf.write_text(self.conf.read_text() + 'log_levl = "debug"\n')
        elif fault == "missing-config":
            self.conf.unlink()
        elif fault == "fifo-config":  # no writer ever comes: an open() for reading waits for ever
            self.conf.unlink()
            os.mkfifo(self.conf)
        elif fault == "zero-config":
            self.conf.unlink()
            self.conf.symlink_to("/dev/zero")
        self.stderr = tmp / "hook-stderr.txt"
        self.state = tmp / "runc-state"
        self.runtime_log = tmp / "runtime-log.json"

    def oci(self, name: str, env: dict, devices: bool = False) -> dict:
        rootfs = mf.build_container("container-debian", self.tmp / name / "images")
        cfg = mf.oci_config(str(rootfs), rb.image_env("container-debian", env))
        cfg["process"]["args"] = ["/bin/sh", "-c", SCRIPT]
        if devices:  # what a CDI spec of nvhook's gives a GPU container: the node and its rule
            cfg["linux"].setdefault("devices", []).append(
                {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666})
            cfg["linux"]["resources"]["devices"].append({"allow": True, "type": "c", "major": 195, "minor": 0,
                                                         "access": "rwm"})
        return cfg

    def hook_args(self, cdi: bool) -> list[str]:
        args = ["--config", str(self.conf)]
        if self.fault in NO_FILE:
            args += ["--log-file", str(self.log)]  # no file to name one
        return args + (["--cdi", "compute,utility", "createContainer"] if cdi else ["prestart"])

    def run_hooked(self, name: str, env: dict, *, cdi: bool = False, devices: bool = False):
        bundle = rb.nvhook_bundle(self.tmp / name / "bundle", self.oci(name, env, devices), self.hook_args(cdi),
                                  stderr_to=self.stderr, stage="createContainer" if cdi else "prestart",
                                  timeout=HOOK_TIMEOUT)
        return rb.runc_run(bundle, self.state, timeout=HOOK_TIMEOUT * 3)

    def run_wrapped(self, name: str, env: dict):
        """nvhook-runtime run as containerd's shim runs it: with --log (runc's JSON lines). In a
        mount namespace whose /var/log is the test's: where no config names a log file (NO_FILE),
        nvhook's log is the default /var/log/nvhook.log, which must not be the machine's."""
        bundle = self.tmp / name / "bundle"
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps(self.oci(name, env), indent=1))
        cid = f"nvhook-ng-{uuid.uuid4().hex[:10]}"
        penv = {k: v for k, v in os.environ.items() if k not in ("NVHOOK_CONFIG", "NVHOOK_RUNTIME")}
        penv["NVHOOK_CONFIG"] = str(self.conf)
        var_log = self.tmp / "var-log"
        var_log.mkdir(exist_ok=True)
        private_log = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                       'mount --bind "$0" /var/log || exit 125; exec "$@"', str(var_log)]
        try:
            return subprocess.run([*private_log, str(WRAPPER), "--root", str(self.state), "--log",
                                   str(self.runtime_log), "--log-format", "json", "run", "--bundle", str(bundle), cid],
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                                  env=penv, timeout=HOOK_TIMEOUT * 3)
        finally:
            subprocess.run(["runc", "--root", str(self.state), "delete", "-f", cid], capture_output=True, timeout=30)

    def runtime_said(self) -> list[str]:
        """nvhook-runtime's lines in its --log file (runc writes its own there too)."""
        lines = self.runtime_log.read_text().splitlines() if self.runtime_log.exists() else []
        self.runtime_log.unlink(missing_ok=True)
        entries = [json.loads(line) for line in lines]
        return [e["msg"] for e in entries if e["msg"].startswith("nvhook-runtime: ")]

    def hook_said(self) -> list[str]:
        lines = self.stderr.read_text().splitlines() if self.stderr.exists() else []
        self.stderr.unlink(missing_ok=True)
        return lines

    def events(self, name: str) -> list[dict]:
        """The events in the config's log, and in the default one (nvhook-runtime's namespace's
        /var/log/nvhook.log) where no config names one."""
        logs = [self.log, self.tmp / "var-log" / "nvhook.log"]
        return [e for log in logs for e in rb.read_events(log) if e["event"] == name]


@pytest.fixture
def gpu8(fixtures_root: Path) -> Path:
    return fixtures_root / "host-gpu8"


NO_GPU = {"unset": {"NVIDIA_VISIBLE_DEVICES": None}, "void": {"NVIDIA_VISIBLE_DEVICES": "void"},
          "empty": {"NVIDIA_VISIBLE_DEVICES": ""}}


def _started_without_gpu(p: subprocess.CompletedProcess, *context: str) -> None:
    """The container ran (its script printed STARTED) and saw no NVIDIA device node."""
    assert p.returncode == 0 and p.stdout.splitlines() == ["STARTED", "0"], (*context, p.stdout, p.stderr)


def _warned(w: World, said: list[str], program: str) -> None:
    """One line from `program` on stderr naming the problem (a warning; a log it could not
    write is reported as itself, without the word); the event in the log where one can be written."""
    prefix = f"{program}: " if w.fault == "unwritable-log" else f"{program}: warning: "
    if w.fault == "unwritable-cache":
        assert not [s for s in said if "warning" in s or "error" in s], said  # nothing to say: never used
        return
    lines = [s for s in said if SAYS[w.fault] in s]
    assert lines and all(line.startswith(prefix) for line in lines), said
    assert len(lines) == len(said), said
    if w.fault in EVENT:
        evs = w.events(EVENT[w.fault])
        assert evs, rb.read_events(w.log)
        for ev in evs:
            assert ev["level"] == "warning" and SAYS[w.fault] in ev["error"] and ev["container"], ev
            assert SAYS[w.fault] in ev["message"] and "asks for no GPU" in ev["message"], ev
    for line in lines:
        if w.fault == "wrong-root":
            assert "root" in line and "asks for no GPU" in line, line
        if w.fault in NO_FILE:
            assert str(w.conf) in line


@pytest.mark.parametrize("fault", FAULTS)
def test_hook_mode(tmp_path, gpu8, fault):
    w = World(tmp_path, gpu8, fault)
    said = []
    for name, env in NO_GPU.items():
        p = w.run_hooked(name, env)
        _started_without_gpu(p, name)
        said += w.hook_said()
    _warned(w, said, "nvhook")
    w.log.unlink(missing_ok=True)
    p = w.run_hooked("gpu", {"NVIDIA_VISIBLE_DEVICES": "0"})
    _gpu_outcome(w, p, w.hook_said())


def _gpu_outcome(w: World, p: subprocess.CompletedProcess, said: list[str], program: str = "nvhook") -> None:
    """A GPU container under the fault: refused with one line from `program` where the fault
    stops GPU starts, else started with its device nodes."""
    if w.fault in STOPS_GPU:
        assert p.returncode != 0 and "STARTED" not in p.stdout, p.stdout
        assert len(said) == 1 and said[0].startswith(f"{program}: ") and SAYS[w.fault] in said[0], said
        assert "warning" not in said[0] and "Traceback" not in p.stderr
    else:
        out = p.stdout.splitlines()
        assert p.returncode == 0 and out[0] == "STARTED" and int(out[1]) >= 2, (p.stdout, p.stderr)


@pytest.mark.parametrize("fault", FAULTS)
def test_cdi_hook(tmp_path, gpu8, fault):
    """nvhook's CDI hook: a container without NVIDIA device nodes asks for nothing (the hook
    of a spec that gave it none); one that got a GPU node is refused under a config or root fault."""
    w = World(tmp_path, gpu8, fault)
    p = w.run_hooked("plain", NO_GPU["void"], cdi=True)
    _started_without_gpu(p)
    _warned(w, w.hook_said(), "nvhook")
    w.log.unlink(missing_ok=True)
    if fault in STOPS_GPU:
        p = w.run_hooked("gpu", NO_GPU["void"], cdi=True, devices=True)
        _gpu_outcome(w, p, w.hook_said())


@pytest.mark.skipif(not WRAPPER.exists(), reason="nvhook-runtime is not installed")
@pytest.mark.parametrize("fault", FAULTS)
def test_runtime_wrapper(tmp_path, gpu8, fault):
    w = World(tmp_path, gpu8, fault)
    said = []
    for name, env in NO_GPU.items():
        p = w.run_wrapped(name, env)
        _started_without_gpu(p, name)
        assert p.stderr == "", p.stderr  # the container's log under a shim: no warning there
        now = w.runtime_said()
        said += now
        if name == "unset" and fault not in ("bad-toml", "unknown-key", *NO_FILE):
            # a spec without the variable is not even parsed: nothing of the config is used
            assert now == [], now
    _warned(w, said, "nvhook-runtime")
    w.log.unlink(missing_ok=True)
    p = w.run_wrapped("gpu", {"NVIDIA_VISIBLE_DEVICES": "0"})
    said = [s for s in p.stderr.splitlines() if s.startswith("nvhook-runtime: ")]  # among runc's own lines
    _gpu_outcome(w, p, said, "nvhook-runtime")


def test_apply_done_and_hook_done_agree_on_symlinks(tmp_path, gpu8):
    """The image already has one of the planned links, right: both events count the plan's
    symlinks, and both say how many were created or replaced (one fewer)."""
    def prepare(rootfs: Path) -> None:
        lib = rootfs / "usr/lib/x86_64-linux-gnu"
        lib.mkdir(parents=True, exist_ok=True)
        (lib / "libcuda.so").unlink(missing_ok=True)
        (lib / "libcuda.so").symlink_to("libcuda.so.1")

    r = rb.run_with_nvhook(tmp_path, host=gpu8, script="true", prepare=prepare,
                           env={"NVIDIA_VISIBLE_DEVICES": "0"})
    assert r.proc.returncode == 0, r.proc.stderr
    (applied,) = r.events("apply.done")
    (done,) = r.events("hook.done")
    assert applied["symlinks"] == done["symlinks"] >= 2
    assert applied["symlinks_changed"] == done["symlinks_changed"] == done["symlinks"] - 1
    assert f"{done['symlinks']} symlinks ({done['symlinks'] - 1} created or replaced)" in done["message"]
    assert f"{done['symlinks']} symlinks ({done['symlinks'] - 1} created or replaced)" in applied["message"]


def test_every_events_message_says_more_than_its_name(tmp_path, gpu8):
    """A GPU container at debug level: each event's message is a sentence or carries its
    fields, never the bare event name."""
    r = rb.run_with_nvhook(tmp_path, host=gpu8, script="true", config_extra='log_level = "debug"\n',
                           env={"NVIDIA_VISIBLE_DEVICES": "0", "NVIDIA_DRIVER_CAPABILITIES": "all"})
    assert r.proc.returncode == 0, r.proc.stderr
    evs = r.events()
    assert len({e["event"] for e in evs}) > 15
    bare = [e for e in evs if e["message"].strip() in (e["event"], e["event"] + ":")
            or len(e["message"]) <= len(e["event"]) + 2]
    assert not bare, bare
