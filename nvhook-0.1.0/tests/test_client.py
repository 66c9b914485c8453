"""Resident mode's client (nvhook/start/client.py) and the daemon's warm inventory, in-process: the
parts that real starts through runc (tests/test_resident.py) cannot pin down one by one."""

from __future__ import annotations

import os
import time

import pytest
from hostfix import copy_host, fx, private_dir  # noqa: F401

from nvhook.base.log import LEVELS, EventLog
from nvhook.observe import host
from nvhook.observe.host import cache
from nvhook.start import client

L = "usr/lib/x86_64-linux-gnu"


def test_level_names_are_the_logs():
    """The client checks --log-level without importing base.log."""
    assert client.LEVEL_NAMES == tuple(LEVELS)


@pytest.mark.parametrize("argv", [
    [], ["prestart"], ["createRuntime"], ["--config", "/etc/x.toml", "prestart"], ["--config=/x", "--root=/h"],
    ["--root", "/h", "--log-file", "", "--log-level", "debug", "prestart"], ["--in-container-only", "prestart"],
    ["--log-level=warning"], ["--log-level", "loud"], ["--config"], ["prestart", "prestart"],
    ["createContainer"], ["--cdi", "compute", "createContainer"], ["--dry-run"], ["info"], ["--help"],
])
def test_client_serves_only_what_the_hook_would_run_the_same_way(argv):
    """Every command line the client takes as hook mode is parsed the same way for the in-process
    hook, and is `servable`; whatever it does not take (None) is the hook's or a command's,
    unchanged (nvhook.entry)."""
    mine = client.parse_hook_argv(argv, served=True)
    full = client.parse_hook_argv(argv)
    if mine is not None:
        assert full == mine and client.servable(full)
    elif full is not None:
        assert not client.servable(full)
    if argv and argv[-1] == "createContainer" or "--cdi" in argv:
        assert mine is None  # nvhookd cannot stand in there


def test_warm_inventory_is_used_without_the_file_until_the_host_changes(fx, tmp_path):  # noqa: F811
    """nvhookd's children use the inventory it holds (cache.WARM) for its cache_dir and root:
    no file is read while the stamp matches; a driver file rewritten (an upgrade) voids it."""
    root = str(copy_host(fx, "host-gpu1", tmp_path / "hosts"))
    cache_dir = str(private_dir(tmp_path / "cache"))
    log = EventLog("debug")
    host.observe(root, cache_dir, log)  # builds and stores the inventory
    held = cache.load(cache_dir, root)
    assert held is not None
    for name in os.listdir(cache_dir):
        os.unlink(os.path.join(cache_dir, name))
    assert cache.load(cache_dir, root) is None  # no file, nothing held
    cache.WARM = (cache_dir, root, held)
    try:
        assert cache.load(cache_dir, root) is held
        assert cache.load(str(tmp_path / "other"), root) is None  # another cache_dir: the file's rules
        lib = next(p for p in os.listdir(os.path.join(root, L)) if p.startswith("libcuda.so.") and p.count(".") > 3)
        now = time.time_ns()
        os.utime(os.path.join(root, L, lib), ns=(now, now + 1_000_000_000))
        assert cache.load(cache_dir, root) is None
        log = EventLog("debug")
        inv = host.observe(root, cache_dir, log)
        assert [e["event"] for e in log.events if e["event"].startswith("inventory.")] == ["inventory.built"]
        assert inv["files"]["root"] == root
    finally:
        cache.WARM = None


@pytest.mark.parametrize("key", ["cfg", "state", "daemon", "resident", "cdi"])
def test_nvhookd_refuses_what_only_the_client_hands_nvhook_main(key):
    """run_hook trusts opts["cfg"], ["state"] and ["daemon"] (the client's handoff, in the
    same process) and ["resident"] (nvhookd's own): a client cannot send them to nvhookd."""
    from nvhook.start.daemon.listen import check_request

    req = {"opts": {key: {"daemon": {"mode": "off"}}}, "state": "{}"}
    assert check_request(req, []) == f"malformed request: unknown option {key!r}"


def _in_child(fn) -> str:
    """fn() in a fork of this process; its printed result."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - reports over the pipe and exits
        try:
            os.write(w, str(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 1 << 16):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out.decode()


def test_pages_a_request_copied_are_copied_ahead_in_the_next_fork():
    """nvhookd's request children report the pages they copied on write (touched_pages); the
    next spares copy those up front (prefault), so serving takes no fault for them."""
    import resource

    from nvhook.start.daemon import pages

    page = os.sysconf("SC_PAGE_SIZE")
    buf = bytearray(4 << 20)  # shared copy-on-write with the forks below
    buf[::page] = b"x" * len(buf[::page])  # present here, so a fork shares it

    def touch() -> None:
        for i in range(0, len(buf), page * 2):
            buf[i] = 1

    def learn() -> str:
        touch()
        return repr(pages.touched_pages())

    runs = eval(_in_child(learn))  # noqa: S307 - our own repr of a list of int pairs
    learned = sum(n for _, n in runs)
    assert learned >= len(buf) // page // 2

    def faults_after(pre) -> int:
        pre()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        touch()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    cold = int(_in_child(lambda: faults_after(lambda: None)))
    warm = int(_in_child(lambda: faults_after(lambda: pages.prefault(runs))))
    assert cold >= len(buf) // page // 2 - 16, cold
    assert warm < cold // 10, (warm, cold)


def test_a_bogus_page_report_is_not_learned():
    """What request children write to nvhookd's learn pipe is merged into what every later
    spare prefaults before it serves: a report naming pages outside nvhookd's own private
    writable mappings (past the address space, a kernel address) is dropped."""
    from nvhook.start.daemon import pages, pool

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps", "rb") as f:
        mappings = pages._private_writable(f.read().splitlines())
    real = next((lo // page, hi // page) for lo, hi in mappings if hi - lo >= 2 * page)
    d = object.__new__(pool.Daemon)
    d.learned, d.lessons, d.runs = set(), 0, []
    d.learn_r, w = os.pipe()
    try:
        bogus = [(1 << 62, 4), (0xFFFF8000_0000_0000 // page, 1), (real[0], 2), (real[1] - 1, 3)]
        msg = len(bogus).to_bytes(4, "little") + b"".join(
            a.to_bytes(8, "little") + n.to_bytes(4, "little") for a, n in bogus)
        os.write(w, msg)
        d._learn()
    finally:
        os.close(d.learn_r)
        os.close(w)
    assert d.lessons == 1
    # what is learned is inside our mappings (a run across a mapping's end keeps its part in it)
    with open("/proc/self/maps", "rb") as f:
        now = [(lo // page, hi // page) for lo, hi in pages._private_writable(f.read().splitlines())]
    assert {real[0], real[0] + 1, real[1] - 1} <= d.learned <= {real[0], real[0] + 1, real[1] - 1, real[1], real[1] + 1}
    assert all(any(lo <= p < hi for lo, hi in now) for p in d.learned), d.runs


def test_a_state_pid_past_pid_t_still_starts_a_container_that_asks_for_no_gpu(tmp_path, monkeypatch):
    """bin/nvhook's client opens a pidfd for the state's pid before asking nvhookd: a pid no
    pid_t holds (OverflowError, not OSError) was the client's internal error, exit 1, for a
    container that asks for no GPU, which the in-process hook starts (it needs no pid)."""
    import json
    import subprocess
    import sys

    from nvhook.base import config as config_mod

    run = private_dir(tmp_path / "run")
    monkeypatch.setenv("NVHOOK_RUN_DIR", str(run))
    conf = tmp_path / "hook.toml"
    conf.write_text(f'cache_dir = "{run}"\nlog_file = "{tmp_path / "hook.jsonl"}"\n'
                    f'[daemon]\nmode = "required"\nsocket = "{run / "nvhookd.sock"}"\n')
    config_mod.load(str(conf), True)  # cached: the next start is the client's alone
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps(
        {"ociVersion": "1.0.2", "root": {"path": "rootfs"}, "process": {"args": ["/bin/true"], "env": ["PATH=/bin"]},
         "mounts": []}))
    state = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "created", "pid": 1 << 40,
                        "bundle": str(bundle)})
    launcher = os.path.join(os.path.dirname(sys.executable), "nvhook")
    proc = subprocess.run([launcher, "--config", str(conf), "prestart"], input=state.encode(),
                          capture_output=True, timeout=60, env={**os.environ, "NVHOOK_RUN_DIR": str(run)})
    assert proc.returncode == 0, proc.stderr
    assert b"internal error" not in proc.stderr


def test_pages_a_fork_reports_are_learned():
    """The filter of _learn keeps what a real request child reports: its copies of nvhookd's
    own pages (a buffer shared copy-on-write, written in the fork)."""
    from nvhook.start.daemon import pages, pool

    page = os.sysconf("SC_PAGE_SIZE")
    buf = bytearray(4 << 20)
    buf[::page] = b"x" * len(buf[::page])

    def learn() -> str:
        for i in range(0, len(buf), page):
            buf[i] = 1
        return repr(pages.touched_pages()[:340])

    runs = eval(_in_child(learn))  # noqa: S307 - our own repr of a list of int pairs
    d = object.__new__(pool.Daemon)
    d.learned, d.lessons, d.runs = set(), 0, []
    d.learn_r, w = os.pipe()
    try:
        os.write(w, len(runs).to_bytes(4, "little") + b"".join(
            a.to_bytes(8, "little") + n.to_bytes(4, "little") for a, n in runs))
        d._learn()
    finally:
        os.close(d.learn_r)
        os.close(w)
    import ctypes

    data = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) // page
    wanted = set(range(data + 1, data + len(buf) // page - 1))
    reported = {p for a, n in runs for p in range(a, a + n)}
    assert wanted <= reported
    assert wanted <= d.learned, len(wanted - d.learned)
