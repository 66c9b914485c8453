"""nvidia-cdi-hook's shell first stage (nvhook/data/nvidia-cdi-hook.sh) and the python stage
that does a run of entries in one process (nvhook/start/cdihook/coalesce.py).

The hook is laid out as the .deb lays it out (tests/e2e/cdihookbox.shell_first_stage:
set-group-ID copies of /bin/sh and of this venv's python). The entries are run one after the
other with the state on stdin, by this test process, as runc runs a container's createContainer
entries from its init (one parent for all of them), or by real runc. What is checked is what
the container gets (links, the order of work against other hooks, exit codes and messages) and
how many Python processes did it (the log's nvhook_pid), never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdihookbox  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.start.cdihook import coalesce as cdihookrun  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the CDI hook works on a rootfs as root")


class Spec:
    """A bundle whose config.json lists createContainer entries, its rootfs, the hook laid out
    as the .deb has it, and a private nvhook config."""

    def __init__(self, tmp: Path, cid: str = "coalesce-test", shell: str = "/bin/sh"):
        self.tmp = tmp
        self.hook = cdihookbox.shell_first_stage(tmp, shell=shell)
        self.marks = self.hook.parent.parent / "marks"
        self.bundle = tmp / "bundle"
        self.rootfs = self.bundle / "rootfs"
        for d in ("usr/lib", "etc", "dev", "proc"):
            (self.rootfs / d).mkdir(parents=True, exist_ok=True)
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "hook.toml", log_file=self.log, cache_dir=tmp / "cache")
        self.entries: list[dict] = []
        self.cid = cid
        # the container's init: the entries' parent (this test), as runc's state names it
        self.state = json.dumps({"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": os.getpid(),
                                 "bundle": str(self.bundle)}, separators=(",", ":"))

    def entry(self, *args: str, path: Path | None = None, **extra) -> dict:
        """One more entry; nvhook's get --nvhook-config first, as the NVIDIA-spec tests add it."""
        pre = ["--nvhook-config", str(self.config)] if path is None else []
        e = {"path": str(path or self.hook), "args": ["nvidia-cdi-hook", *pre, *args], **extra}
        self.entries.append(e)
        return e

    def write(self) -> None:
        (self.bundle / "config.json").write_text(json.dumps({
            "root": {"path": "rootfs"}, "process": {"env": ["PATH=/bin"]}, "linux": {},
            "hooks": {"createContainer": self.entries}}))

    def run_all(self, state: str | None = None) -> list[subprocess.CompletedProcess]:
        """Each entry in order, as runc runs them; stops at the first that fails, as runc does."""
        self.write()
        out = []
        for e in self.entries:
            p = subprocess.run([e["path"], *e["args"][1:]], input=self.state if state is None else state,
                               capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
            out.append(p)
            if p.returncode:
                break
        return out

    def done(self) -> list[dict]:
        return [e for e in rb.read_events(self.log) if e["event"] == "cdi_hook.done"]

    def link(self, name: str) -> str | None:
        p = self.rootfs / "usr/lib" / name
        return os.readlink(p) if p.is_symlink() else None


@pytest.fixture
def spec(tmp_path):
    return Spec(tmp_path)


def links(spec: Spec, *names: str) -> None:
    for n in names:
        spec.entry("create-symlinks", "--link", f"target-{n}::/usr/lib/{n}")


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
def test_a_run_of_entries_is_one_python_process(tmp_path, shell):
    """Debian's /bin/sh (dash) and the RHEL family's (bash, which a set-group-ID copy named
    `sh` runs in POSIX mode, dropping the group as dash does)."""
    if not os.path.exists(shell):
        pytest.skip(f"no {shell}")
    spec = Spec(tmp_path, shell=shell)
    links(spec, "a", "b")
    spec.entry("create-soname-symlinks", "--folder", "/usr/lib")
    spec.entry("some-future-hook")  # a hook this version lacks: a warning, exit 0
    links(spec, "c")
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0] * 5, [p.stderr for p in ps]
    assert [spec.link(n) for n in "abc"] == ["target-a", "target-b", "target-c"]
    done = spec.done()
    assert [e["cdi_hook"] for e in done] == ["create-symlinks", "create-symlinks", "create-soname-symlinks",
                                             "unsupported", "create-symlinks"]
    assert len({e["nvhook_pid"] for e in done}) == 1
    # the first entry's process said what the unsupported entry's own run says
    assert "warning: Unsupported CDI hook: some-future-hook" in ps[0].stderr
    assert all(p.stderr == "" for p in ps[1:])
    # the marker: only its header left, every entry taken off by its own run
    (marker,) = spec.marks.iterdir()
    assert marker.name == f"{spec.cid}.{os.getpid()}"  # the entries' parent: this test
    assert marker.read_text().count("\n") == 1


def test_a_failing_step_fails_its_own_entry_with_nvidias_message(spec):
    """The second entry's step fails: the first entry still succeeds (as NVIDIA's would: its
    own work was done), the second fails with NVIDIA's message and exit 1, and the third never
    runs, as runc stops at the failing entry: its link is not there."""
    links(spec, "a")
    spec.entry("chmod", "--mode", "rwx", "--path", "/usr/lib")
    links(spec, "c")
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 1]
    assert ps[1].stderr.startswith("nvidia-cdi-hook (nvhook): error: failed to parse mode as octal"), ps[1].stderr
    assert spec.link("a") == "target-a" and spec.link("c") is None
    assert not (spec.marks / spec.cid).exists()  # nothing was done for the entries after the first


def test_a_bad_command_line_later_in_the_run_is_its_own_error(spec):
    links(spec, "a")
    spec.entry("create-symlinks", "--bogus")
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 1]
    assert ps[1].stderr.strip() == "nvidia-cdi-hook (nvhook): error: flag provided but not defined: -bogus"


def test_another_hook_between_keeps_the_order(spec, tmp_path):
    """An entry of another path between two of nvhook's: it sees the first's link and not the
    second's, as with one process per entry (the run ends at the other path)."""
    seen = tmp_path / "seen"
    other = tmp_path / "other-hook"
    other.write_text(f"#!/bin/sh\ncat >/dev/null\n{{ [ -L {spec.rootfs}/usr/lib/a ] && echo a; "
                     f"[ -L {spec.rootfs}/usr/lib/b ] && echo b; }} > {seen}\nexit 0\n")
    other.chmod(0o755)
    links(spec, "a")
    spec.entry(path=other)
    links(spec, "b")
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0, 0], [p.stderr for p in ps]
    assert seen.read_text() == "a\n"
    assert spec.link("b") == "target-b"
    assert len({e["nvhook_pid"] for e in spec.done()}) == 2


@pytest.mark.parametrize("extra", [{"timeout": 30}, {"path2": True}])
def test_entries_not_coalesced(spec, extra):
    """A later entry with a timeout (its own limit must hold for its own work), or with the
    hook under another path: each entry runs its own process."""
    links(spec, "a")
    if "timeout" in extra:
        spec.entry("create-symlinks", "--link", "target-b::/usr/lib/b", timeout=30)
    else:
        alias = spec.tmp / "alias-hook"
        alias.symlink_to(spec.hook)
        spec.entries.append({"path": str(alias), "args": ["nvidia-cdi-hook", "--nvhook-config", str(spec.config),
                                                         "create-symlinks", "--link", "target-b::/usr/lib/b"]})
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0]
    assert spec.link("b") == "target-b"
    assert len({e["nvhook_pid"] for e in spec.done()}) == 2


def test_a_marker_of_another_process_skips_nothing(spec):
    """Markers planted for this container id whose header names another process (this
    machine's init with its real start time, or a process that is gone): no entry ends in the
    shell, every link is made; the stale ones are removed when a new marker is written."""
    links(spec, "a", "b", "c")
    spec.marks.mkdir(mode=0o700)
    with open("/proc/1/stat") as f:
        start = f.read().rsplit(") ", 1)[1].split()[19]
    shapes = "".join(f"{cdihookrun.shape(e['args'][1:])}\n" for e in spec.entries)
    for name, head in ((spec.cid, f"1 {start}"), (f"{spec.cid}.{os.getpid()}", f"{os.getpid()} 1"),
                       ("gone.999999999", "999999999 1")):
        (spec.marks / name).write_text(f"{head}\n{shapes}")
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0, 0]
    assert [spec.link(n) for n in "abc"] == ["target-a", "target-b", "target-c"]
    assert len({e["nvhook_pid"] for e in spec.done()}) == 1  # the first did all three, anew
    # the gone process's pruned, this container's rewritten; init's stays while init lives
    assert sorted(os.listdir(spec.marks)) == [spec.cid, f"{spec.cid}.{os.getpid()}"]


def test_a_state_that_names_another_id_first_is_not_coalesced(spec):
    """A runtime whose state puts annotations before the id, and an annotation "id" naming
    another container: the shell would look up that container's marker, so nothing is
    coalesced (each entry its own process) and every link is made."""
    links(spec, "a", "b")
    state = json.dumps({"ociVersion": "1.0.2", "annotations": {"id": "victim"}, "id": spec.cid,
                        "status": "creating", "pid": 1, "bundle": str(spec.bundle)}, separators=(",", ":"))
    ps = spec.run_all(state)
    assert [p.returncode for p in ps] == [0, 0]
    assert [spec.link(n) for n in "ab"] == ["target-a", "target-b"]
    assert len({e["nvhook_pid"] for e in spec.done()}) == 2
    assert not spec.marks.exists() or os.listdir(spec.marks) == []


def test_the_marker_directory_must_be_roots_alone(spec):
    links(spec, "a", "b")
    spec.marks.mkdir(mode=0o777)
    os.chmod(spec.marks, 0o777)
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0]
    assert len({e["nvhook_pid"] for e in spec.done()}) == 2
    assert os.listdir(spec.marks) == []


def test_no_state_and_container_spec_are_nvidias(spec, tmp_path):
    e = spec.entry("create-symlinks", "--link", "t::/usr/lib/x")
    spec.write()
    p = subprocess.run([e["path"], *e["args"][1:]], input="", capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "failed to load container state" in p.stderr, p.stderr
    state_file = tmp_path / "state.json"
    state_file.write_text(spec.state)
    p = subprocess.run([e["path"], *e["args"][1:], "--container-spec", str(state_file)], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert spec.link("x") == "t"


def test_version_does_not_wait_for_stdin(spec):
    """A person's `nvidia-cdi-hook --version` with a stdin that never ends: answered at once."""
    p = subprocess.Popen([str(spec.hook), "--version"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.wait(timeout=60) == 0  # the shell did not wait for the end of stdin
        assert p.stdout.readline().startswith("nvidia-cdi-hook (nvhook) version")
    finally:
        p.stdin.close()
        p.kill()


@pytest.mark.parametrize("args,code,message", [
    (["no-such-hook"], 0, "warning: Unsupported CDI hook: no-such-hook"),
    ([], 0, "warning: No CDI hook specified"),
    (["chmod", "--bogus", "x"], 1, "error: flag provided but not defined: -bogus"),
    (["create-symlinks", "--link", "a::b::c"], 1, "error: invalid symlink specification a::b::c"),
    (["noop"], 0, None),
])
def test_exit_codes_and_messages_through_the_shell(spec, args, code, message):
    e = spec.entry(*args)
    spec.write()
    p = subprocess.run([e["path"], *e["args"][1:]], input=spec.state, capture_output=True, text=True, timeout=60)
    assert p.returncode == code, p.stderr
    if message is None:
        assert p.stderr == ""
    else:
        assert p.stderr.strip() == f"nvidia-cdi-hook (nvhook): {message}"


# -- the plan, pure -----------------------------------------------------------------------------

def _spec(*entries) -> dict:
    return {"hooks": {"createContainer": [{"path": p, "args": ["x", *a], **kw} for p, a, kw in entries]}}


def test_plan_needs_this_entry_once_and_stops_where_its_own_run_must_decide():
    H = "/h"
    one = ["create-symlinks", "--link", "a::/a"]
    assert cdihookrun.plan(_spec((H, one, {}), (H, one, {})), H, one, None) is None  # which one am I?
    assert cdihookrun.plan(_spec((H, one, {"timeout": 5})), H, one, None) is None
    assert cdihookrun.plan(_spec(("/other", one, {})), H, one, None) is None
    later = [(H, ["update-ldcache", "--folder", "/usr/lib"], {}),
             (H, ["--nvhook-config", "/elsewhere.toml", "noop"], {}),  # another config: its own run
             (H, ["noop"], {})]
    steps = cdihookrun.plan(_spec((H, one, {}), *later), H, one, None)
    assert [s.sub for s in steps] == ["update-ldcache"]
    for stop in (["create-symlinks", "--container-spec", "/s"], ["--version"], ["chmod", "--bogus"]):
        steps = cdihookrun.plan(_spec((H, one, {}), (H, ["noop"], {}), (H, stop, {}), (H, ["noop"], {})), H, one, None)
        assert [s.sub for s in steps] == ["noop"], stop
    env = cdihookrun.plan(_spec((H, one, {}), (H, ["noop"], {"env": ["NVIDIA_CTK_DEBUG=true"]})), H, one, None)
    assert env[0].out.debug  # each entry's own logging switches


def test_shell_id_is_what_the_shell_reads():
    assert cdihookrun.shell_id(b'{"ociVersion":"1.0.2","id":"abc","pid":1}') == "abc"
    assert cdihookrun.shell_id(b'{"ociVersion": "1.0.2", "id": "abc"}') == "abc"
    assert cdihookrun.shell_id(b'{"annotations":{"id":"victim"},"id":"abc"}') == "victim"
    assert cdihookrun.shell_id(b'{"pid":1}') is None
    state = {"id": "abc"}
    assert cdihookrun.marker_name(state, b'{"annotations":{"id":"victim"},"id":"abc"}') is None
    assert cdihookrun.marker_name(state, b'{"id":"abc"}') == "abc"
    for bad in ("", ".", "..", ".x", "a/b", "a b", "x" * 201):
        assert cdihookrun.marker_name({"id": bad}, json.dumps({"id": bad}).encode()) is None, bad


def test_shape_is_the_shells():
    args = ["--nvhook-config", "/c.toml", "create-symlinks", "--link", "libé.so::/usr/lib/x y"]
    sh = subprocess.run(["sh", "-c", 'LC_ALL=C; a=$*; echo "$# ${#a}"', "sh", *args], capture_output=True,
                        text=True, check=True).stdout.strip()
    assert sh == cdihookrun.shape(args)


def test_files_made_in_the_container_keep_their_modes(spec):
    """What the python stage creates behind the shell (the loader cache, the drop-in and its
    directory) is readable by a container's non-root user, as with one process per entry: the
    shell hands on the runtime's umask unchanged."""
    libdir = spec.rootfs / "opt/nv"
    libdir.mkdir(parents=True)
    rb.build_elf_library(libdir / "libnvtest.so.535.1", "libnvtest.so.1")
    links(spec, "a")
    spec.entry("update-ldcache", "--folder", "/opt/nv")
    spec.write()
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0], [p.stderr for p in ps]
    assert len({e["nvhook_pid"] for e in spec.done()}) == 1
    for rel, mode in (("etc/ld.so.cache", 0o644), ("etc/ld.so.conf.d", 0o755),
                      ("etc/ld.so.conf.d/00-nvcr-nvhook.conf", 0o644)):
        assert oct((spec.rootfs / rel).stat().st_mode & 0o777) == oct(mode), rel


def test_finished_markers_are_removed_by_the_next_run(tmp_path):
    """Each start leaves its marker with no entry left (the shell cannot remove files): the
    next start that writes one removes it, so the directory does not grow with the number of
    running containers."""
    first = Spec(tmp_path / "one", cid="first")
    links(first, "a", "b")
    assert [p.returncode for p in first.run_all()] == [0, 0]
    assert os.listdir(first.marks) == [f"first.{os.getpid()}"]
    second = Spec(tmp_path / "one", cid="second")  # same hook and marker directory
    second.hook, second.marks = first.hook, first.marks
    links(second, "a", "b")
    assert [p.returncode for p in second.run_all()] == [0, 0]
    assert os.listdir(second.marks) == [f"second.{os.getpid()}"]


# -- a hostile container against the shell stage, with real runc ---------------------------------

def _runc_bundle(tmp: Path, hook: Path, config: Path, env: list[str], annotations: dict | None = None,
                 names: tuple = ("a", "b", "c")) -> tuple[Path, Path]:
    """A busybox container whose createContainer entries (no `env`: runc hands them the
    container's) link /usr/lib/<name> for each name; it prints the links."""
    rootfs = rb.make_rootfs(tmp / "rootfs")
    bundle = tmp / "bundle"
    bundle.mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True, capture_output=True, timeout=30)
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["process"].pop("rlimits", None)
    cfg["process"]["terminal"] = False
    cfg["process"]["env"] = env
    cfg["process"]["args"] = ["/bin/sh", "-c", " ; ".join(f"readlink /usr/lib/{n}" for n in names)]
    cfg["root"] = {"path": str(rootfs), "readonly": False}
    if annotations:
        cfg["annotations"] = annotations
    cfg["hooks"] = {"createContainer": [{"path": str(hook), "args": [
        "nvidia-cdi-hook", "--nvhook-config", str(config), "create-symlinks", "--link", f"target-{n}::/usr/lib/{n}"]}
        for n in names]}
    (bundle / "config.json").write_text(json.dumps(cfg))
    return bundle, rootfs


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
@pytest.mark.parametrize("shell,secure", [("/bin/sh", True), ("/bin/bash", True), ("/bin/bash", False)])
def test_the_containers_environment_steers_no_shell(tmp_path, shell, secure):
    """The image's environment (runc gives it to an entry without `env`) holds every variable a
    POSIX shell or bash reads, and the state is over 64 KiB (annotations: CRI-O copies a pod's
    into the spec), where bash writes a here-document to a file in $TMPDIR instead of a pipe. The
    run is done as without them (one Python process, every link), and nothing is created in the
    image's TMPDIR, a host directory by that name when the hook runs (before pivot_root): bash
    creates `sh-thd.*` there, as root, holding the state, unless the loader's secure mode
    (AT_SECURE, from the set-group-ID copy) has removed TMPDIR from the environment, which it
    does. Not `secure`: bash itself as the shell, the control that shows the test sees it."""
    if not os.path.exists(shell):
        pytest.skip(f"no {shell}")
    hook = cdihookbox.shell_first_stage(tmp_path, secure, shell=shell)
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=log, cache_dir=tmp_path / "cache")
    tmpdir = tmp_path / "host-dir"
    tmpdir.mkdir()
    os.utime(tmpdir, (0, 0))
    trace = tmp_path / "trace"
    env = ["PATH=/bin:/usr/bin", f"TMPDIR={tmpdir}", f"ENV={tmp_path}/env.sh", f"BASH_ENV={tmp_path}/env.sh",
           "IFS=/-:", f"PS4=$(touch {trace})", "SHELLOPTS=xtrace:verbose:noclobber:errexit", "BASHOPTS=extglob:nullglob",
           "POSIXLY_CORRECT=1", f"CDPATH={tmp_path}", "BASH_COMPAT=31", "BASH_XTRACEFD=3",
           "LC_ALL=tr_TR.UTF-8", "LANG=tr_TR.UTF-8", "BASH_FUNC_printf%%=() { /bin/touch " + str(trace) + "; }",
           "BASH_FUNC_read%%=() { /bin/touch " + str(trace) + "; }", "GLOBIGNORE=*", "HISTFILE=" + str(trace),
           "OPTIND=3", "PPID=1", "EXECIGNORE=*",
           # the script's own variables, which a shell imports from the environment
           'st={"id":"other"}', "direct=1", "a=0 0", "h=1 1", "n=0 0", "r=x", "m=/etc/passwd", "p=1", "id=other"]
    (tmp_path / "env.sh").write_text(f"touch {trace}\n")
    if not secure:  # the control: TMPDIR alone (plain bash honours the rest, its xtrace on stderr...)
        env = ["PATH=/bin:/usr/bin", f"TMPDIR={tmpdir}"]
    bundle, rootfs = _runc_bundle(tmp_path, hook, config, env, annotations={"big": "x" * (80 << 10)})
    p = rb.runc_run(bundle, tmp_path / "runc-state")
    if not secure:
        assert tmpdir.stat().st_mtime != 0, "the control: bash wrote its here-document in TMPDIR"
        return
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["target-a", "target-b", "target-c"]
    done = [e for e in rb.read_events(log) if e["event"] == "cdi_hook.done"]
    assert len(done) == 3 and len({e["nvhook_pid"] for e in done}) == 1
    assert not trace.exists()
    assert os.listdir(tmpdir) == [] and tmpdir.stat().st_mtime == 0, "the hook wrote in the image's TMPDIR"


PRELOAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    const char *m = getenv("NVHOOK_TEST_MARKER");
    FILE *f = m ? fopen(m, "a") : NULL;
    if (f) { fputs("preloaded\n", f); fclose(f); }
}
"""


# A stand-in for journald's native socket: each datagram to a file, until one says STOP.
_JOURNAL = r"""
import os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
os.chmod(sys.argv[1], 0o666)
with open(sys.argv[2], "ab") as out:
    while True:
        d = s.recv(1 << 20)
        if d == b"STOP":
            break
        out.write(d + b"\0")
        out.flush()
"""


def _journal_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln[len(b"NVHOOK_JSON="):]) for d in path.read_bytes().split(b"\0")
            for ln in d.split(b"\n") if ln.startswith(b"NVHOOK_JSON=")]


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
@pytest.mark.parametrize("preload", [False, True])
def test_a_user_namespaced_container_starts(preload):
    """runc runs createContainer entries in the container's user namespace; where that maps the
    container's root to an unprivileged host uid (Kubernetes' hostUsers: false, podman
    --userns=auto, rootless podman), the hook runs as that host uid. The copies are executable
    by others (mode 2711: they were 2710, and the container did not start, "fork/exec <hook>:
    permission denied", where NVIDIA's 0755 hook started it): the container starts with every
    entry's work done, as NVIDIA's hook (when built here) starts it. The copies' group has no
    mapping in the namespace, so the kernel ignores their set-group-ID bit and sets no
    AT_SECURE (docs/cdi-hook.md, "Limits"): with `preload`, the image's LD_PRELOAD (handed to
    the entries, which carry no `env`) is loaded into the shell and the python stage, running
    with the container's own unprivileged credentials, and the python stage logs
    cdi_hook.loader_env_reached. The log file is root's (as on a node): that uid cannot append
    to it, so the events go to the node's journal (a stand-in socket at journald's path, in a
    private mount namespace runc runs in)."""
    import shutil
    import tempfile

    # The copies are of this interpreter: an unprivileged uid must be able to run it at all. A
    # pyenv build under /root (CI's 3.9) names its libpython by an absolute RUNPATH there,
    # which that uid cannot enter; a distribution's python3 (the .deb's, node install's) has it
    # in /usr/lib.
    probe = subprocess.run(["setpriv", "--reuid=100000", "--regid=100000", "--clear-groups",
                            os.path.realpath(sys.executable), "-c", "pass"], capture_output=True, text=True,
                           timeout=60)
    if probe.returncode:
        pytest.skip(f"{os.path.realpath(sys.executable)} cannot be run by an unprivileged uid here: "
                    f"{probe.stderr.strip()[:200]}")
    tmp = Path(tempfile.mkdtemp(prefix="nvhook-userns-", dir="/tmp"))  # pytest's is root's alone
    try:
        os.chmod(tmp, 0o755)
        hooks = {"nvhook": cdihookbox.shell_first_stage(tmp)}
        ref = cdihookbox.reference()
        if ref is not None and not preload:
            hooks["nvidia"] = ref / "nvidia-cdi-hook"
        logdir = tmp / "log"  # root's, as /var/log is
        logdir.mkdir(mode=0o700)
        log = logdir / "nvhook.jsonl"
        config = rb.write_nvhook_config(tmp / "hook.toml", log_file=log, cache_dir=logdir / "cache")
        shared = tmp / "shared"  # what the container's root may write: the preload's marker
        shared.mkdir()
        os.chown(shared, 100000, 100000)
        for name, hook in hooks.items():
            d = tmp / name
            d.mkdir()
            marker = shared / f"marker-{name}"
            journal = d / "journal"
            env = ["PATH=/bin"]
            bundle, rootfs = _runc_bundle(d, hook, config, env)
            if preload:
                subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(rootfs / "usr/lib/preload.so"), "-x", "c", "-"],
                               input=PRELOAD_C, text=True, check=True, capture_output=True, timeout=60)
                env += [f"LD_PRELOAD={rootfs}/usr/lib/preload.so", f"NVHOOK_TEST_MARKER={marker}"]
            cfg = json.loads((bundle / "config.json").read_text())
            cfg["process"]["env"] = env
            cfg["linux"]["namespaces"].append({"type": "user"})
            cfg["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            cfg["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
            cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] != "/sys"]
            if name == "nvidia":
                for h in cfg["hooks"]["createContainer"]:
                    h["args"] = [a for a in h["args"] if a not in ("--nvhook-config", str(config))]
            (bundle / "config.json").write_text(json.dumps(cfg))
            subprocess.run(["chown", "-R", "100000:100000", str(rootfs)], check=True, timeout=30)
            cid = f"nvhook-test-userns-{os.getpid()}-{name}"
            state = d / "runc-state"
            sock = "/run/systemd/journal/socket"
            script = (f'mount -t tmpfs tmpfs /run && mkdir -p /run/systemd/journal || exit 125; '
                      f'"{sys.executable}" -c "$JOURNAL" {sock} "{journal}" & '
                      f'while [ ! -S {sock} ]; do sleep 0.01; done; '
                      f'runc --root "{state}" run --bundle "{bundle}" {cid}; rc=$?; runc --root "{state}" delete -f {cid}; '
                      f'"{sys.executable}" -c "import socket; socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)'
                      f'.sendto(b\'STOP\', \'{sock}\')"; wait; exit $rc')
            p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                               env={**os.environ, "JOURNAL": _JOURNAL}, stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, p.stderr
            assert p.stdout.split() == ["target-a", "target-b", "target-c"]
            for n in "abc":
                assert (rootfs / f"usr/lib/{n}").lstat().st_uid == 100000  # made as the container's root
            if name == "nvhook":
                assert not log.exists()
                events = _journal_events(journal)
                assert len([e for e in events if e["event"] == "cdi_hook.done"]) == 3, events
                reached = [e for e in events if e["event"] == "cdi_hook.loader_env_reached"]
                # each entry its own process (root's marker directory is not the namespace's
                # root's): no warning each start for that
                assert not [e for e in events if e["level"] == "warning" and e["event"] != "cdi_hook.loader_env_reached"]
                if preload:
                    pids = {e["nvhook_pid"] for e in events}
                    # each python stage, and the shell that started it, loaded it
                    assert marker.read_text() == "preloaded\n" * 2 * len(pids)
                    assert [e["variables"] for e in reached] == [["LD_PRELOAD"]] * len(pids), reached
                else:
                    assert reached == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_RUNNER = r"""
import json, os, subprocess, sys
entries, state = json.loads(sys.argv[1]), json.loads(sys.argv[2])
state = json.dumps(dict(state, pid=os.getpid()), separators=(",", ":"))  # this runner is the init
for e in entries:
    if sys.stdin.readline() != "go\n":
        break
    p = subprocess.run([e["path"], *e["args"][1:]], input=state, capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin"})
    print(json.dumps([p.returncode, p.stderr]), flush=True)
"""


class Runtime:
    """One process that runs a container's entries in order, each when told to, as runc's init
    does (the entries' parent, for the shell's check): two of them interleave two starts
    without a timer."""

    def __init__(self, spec: Spec):
        spec.write()
        self.proc = subprocess.Popen([sys.executable, "-c", _RUNNER, json.dumps(spec.entries), spec.state],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def step(self) -> int:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        code, err = json.loads(self.proc.stdout.readline())
        assert err == "", err
        return code

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_two_containers_with_one_id_each_do_their_run_once(tmp_path):
    """Two starts of containers with the same id at once (runc roots of two containerd
    namespaces: `ctr -n a run ... web` and `ctr -n b run ... web`), their entries interleaved:
    A's first entry does A's run and writes its marker, then B's does B's, then A's later
    entries come. Each container's run is one Python process and each entry's work is done
    once. It was not: B's marker replaced A's (one name per id), so A's later entries found
    another process's header and did their work again (which disable-device-node-modification
    refused to do, failing A on a real GPU)."""
    a, b = Spec(tmp_path / "a", cid="web"), Spec(tmp_path / "b", cid="web")
    b.hook, b.marks = a.hook, a.marks  # one nvhook on the node: one marker directory
    for s in (a, b):
        links(s, "x", "y", "z")
    ra, rb_ = Runtime(a), Runtime(b)
    try:
        assert ra.step() == 0
        assert [rb_.step() for _ in range(3)] == [0, 0, 0]
        assert [ra.step(), ra.step()] == [0, 0]
    finally:
        ra.close()
        rb_.close()
    for s in (a, b):
        assert [s.link(n) for n in "xyz"] == ["target-x", "target-y", "target-z"]
        done = s.done()
        assert len(done) == 3 and len({e["nvhook_pid"] for e in done}) == 1, done


@pytest.mark.parametrize("owner", ["dir", "file"])
def test_a_marker_not_written_by_root_skips_nothing(spec, owner):
    """The marker directory is another user's (`dir`, made before nvhook made it: the python
    stage then writes no marker there), or root's and open to others (`file`): that user plants
    a marker with the right header (the entries' parent, here this test, and its start time,
    readable in /proc by anyone) and the shapes of entries 2 and 3. The shell takes only a
    marker that root owns (checked on the file it opened): every entry does its work (the
    planted marker made the shell skip entries 2 and 3: no links b and c)."""
    links(spec, "a", "b", "c")
    spec.marks.mkdir()
    os.chmod(spec.marks, 0o700 if owner == "dir" else 0o777)
    if owner == "dir":
        os.chown(spec.marks, 1000, 1000)
    with open("/proc/self/stat") as f:
        start = f.read().rsplit(") ", 1)[1].split()[19]
    shapes = "".join(f"{cdihookrun.shape(e['args'][1:])}\n" for e in spec.entries[1:])
    planted = spec.marks / f"{spec.cid}.{os.getpid()}"
    planted.write_text(f"{os.getpid()} {start}\n{shapes}")
    os.chown(planted, 1000, 1000)
    ps = spec.run_all()
    assert [p.returncode for p in ps] == [0, 0, 0], [p.stderr for p in ps]
    assert [spec.link(n) for n in "abc"] == ["target-a", "target-b", "target-c"]
    assert len(spec.done()) == 3


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
def test_a_state_over_a_mebibyte_is_read_whole(tmp_path):
    """runc's state carries the spec's annotations, which a podman user or a CRI-O pod
    (io.kubernetes.cri-o.Annotations) makes as large as they like: at 1.1 MiB the container
    starts with every link, as with NVIDIA's hook (Go reads the whole state). The python stage
    read the first MiB only and failed the container with "failed to load container state"."""
    hook = cdihookbox.shell_first_stage(tmp_path)
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=log, cache_dir=tmp_path / "cache")
    bundle, _rootfs = _runc_bundle(tmp_path, hook, config, ["PATH=/bin"], annotations={"big": "x" * (1100 << 10)})
    p = rb.runc_run(bundle, tmp_path / "runc-state")
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["target-a", "target-b", "target-c"]


@pytest.mark.skipif(rb.skip_reason() is not None, reason=rb.skip_reason() or "")
def test_an_entry_also_named_in_prestart_does_only_its_own_work_there(tmp_path):
    """The first createContainer entry is also a prestart entry (an OCI hooks.d file adding it
    beside the CDI spec): runc runs prestart from its own process, in the runtime's namespaces,
    before the container's init runs the createContainer entries. There the entry does its own
    work only, as NVIDIA's would: it did the later createContainer entries too, a phase early
    (6 steps done for 4 entries: the createContainer run could not use that process's marker)."""
    hook = cdihookbox.shell_first_stage(tmp_path)
    log = tmp_path / "nvhook.jsonl"
    config = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=log, cache_dir=tmp_path / "cache")
    bundle, _rootfs = _runc_bundle(tmp_path, hook, config, ["PATH=/bin"])
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["hooks"]["prestart"] = [cfg["hooks"]["createContainer"][0]]
    (bundle / "config.json").write_text(json.dumps(cfg))
    p = rb.runc_run(bundle, tmp_path / "runc-state")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["target-a", "target-b", "target-c"]
    done = [e for e in rb.read_events(log) if e["event"] == "cdi_hook.done"]
    by_pid: dict = {}
    for e in done:
        by_pid.setdefault(e["nvhook_pid"], []).append(bool(e.get("coalesced")))
    assert sorted(by_pid.values()) == [[False], [False, True, True]], done


@pytest.mark.parametrize("form,coalesced", [
    ("crun", True),  # crun's keys: ociVersion, id, pid (0 for createContainer), root, bundle, status...
    ("indented", True),  # newlines and a space after each colon
    ("space-before-colon", False),
    ("escaped-id", False),  # the id spelled with a \\u escape: the shell cannot read it
    ("escaped-bundle", True),  # \\/ in the bundle path: only python reads it
    ("annotation-id-after", True),  # an annotation "id" after the real one (runc's order)
    ("trailing-newlines", True),
])
def test_state_forms_give_the_same_work(spec, form, coalesced):
    """Every JSON form of the state a runtime may write does every entry's work, once; where the
    shell cannot read the id as python does, nothing is coalesced (each entry its own process)."""
    links(spec, "a", "b", "c")
    pid, cid, bundle = os.getpid(), spec.cid, str(spec.bundle)
    base = {"ociVersion": "1.0.2", "id": cid, "status": "creating", "pid": pid, "bundle": bundle}
    state = {
        "crun": json.dumps({"ociVersion": "1.0", "id": cid, "pid": 0, "root": str(spec.rootfs), "bundle": bundle,
                            "status": "created", "annotations": {"a": "b"}}, separators=(",", ":")),
        "indented": json.dumps(base, indent=2),
        "space-before-colon": json.dumps(base, separators=(",", " : ")),
        "escaped-id": json.dumps(base, separators=(",", ":")).replace(f'"{cid}"', '"\\u0063' + cid[1:] + '"'),
        "escaped-bundle": json.dumps(base, separators=(",", ":")).replace(bundle, bundle.replace("/", "\\/")),
        "annotation-id-after": json.dumps(dict(base, annotations={"id": "victim", "x": '"id":"victim"'}),
                                          separators=(",", ":")),
        "trailing-newlines": json.dumps(base, separators=(",", ":")) + "\n\n\r\n",
    }[form]
    ps = spec.run_all(state)
    assert [p.returncode for p in ps] == [0, 0, 0], [p.stderr for p in ps]
    assert [spec.link(n) for n in "abc"] == ["target-a", "target-b", "target-c"]
    done = spec.done()
    assert len(done) == 3
    assert len({e["nvhook_pid"] for e in done}) == (1 if coalesced else 3)


def test_a_marker_being_rewritten_is_not_pruned(tmp_path):
    """A's shell stage takes an entry off its marker by truncating and rewriting it through its
    open file; B's python stage, pruning the directory at that instant, read an empty file and
    removed it: A's rewrite went to the removed file, and A's later entries did their work
    again. Held here at that instant: the marker truncated through an open fd while B runs,
    then written as the shell writes it."""
    a, b = Spec(tmp_path / "a", cid="a"), Spec(tmp_path / "b", cid="b")
    b.hook, b.marks = a.hook, a.marks
    for s in (a, b):
        links(s, "x", "y", "z")
    ra, rb_ = Runtime(a), Runtime(b)
    try:
        assert ra.step() == 0  # A's python did x, y, z: marker [y, z]
        (marker,) = a.marks.iterdir()
        body = marker.read_bytes()
        fd = os.open(marker, os.O_WRONLY | os.O_TRUNC)  # a shell's `> /proc/self/fd/3`, begun
        try:
            assert [rb_.step() for _ in range(3)] == [0, 0, 0]  # B's python prunes meanwhile
            os.write(fd, body)  # and finished (the same lines: what it takes off is not the point)
        finally:
            os.close(fd)
        assert [ra.step(), ra.step()] == [0, 0]  # y and z end in the shell
    finally:
        ra.close()
        rb_.close()
    done = a.done()
    assert len(done) == 3 and len({e["nvhook_pid"] for e in done}) == 1, done
