"""hookreach's walk has a deadline (`cdi.check_timeout`): a hook path on a network mount
whose server never answers must not hang `cdi generate`, `cdi check` or `doctor --node`.

The blocker is real and deterministic, not a timer: a FUSE file system, mounted in a private
mount namespace, whose server answers FUSE_INIT and then takes every request and answers none.
A stat() there waits as on a hard NFS mount whose server is gone, and harder: once the server
has read the request, not even SIGKILL ends the wait. The command must come back at
its deadline (1 s here) with one line naming that path; the walk's child, abandoned, ends when
the server is killed after the command (the connection is aborted). Each command runs with its
stdout and stderr captured: a child left waiting that still held them would hold the caller's
read too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hostfix import NVHOOK
from test_node_doctor import make_node

from nvhook.commands import hookreach

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "rootfs"


def _fuse_skip() -> str | None:
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        return "needs /dev/fuse and root"
    with open("/proc/filesystems") as f:
        return None if any(ln.split()[-1] == "fuse" for ln in f) else "no fuse in this kernel"


# The server: INIT answered, then every request read and none answered.
HANGFS = r"""
import os, struct, sys
sys.path.insert(0, sys.argv[2])
from nvhook.base import sandbox
sandbox.set_pdeathsig(9)  # never outlives the test's driver, whatever ends it
fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
sandbox.mount("hangfs", sys.argv[1], "fuse", sandbox.MS_NOSUID | sandbox.MS_NODEV,
              f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other")
req = os.read(fd, 1 << 20)
length, opcode, unique = struct.unpack_from("<IIQ", req)
assert opcode == 26, opcode  # FUSE_INIT
body = struct.pack("<IIIIHHIIHHI", 7, 31, 0, 0, 0, 0, 4096, 0, 0, 0, 0) + bytes(28)
os.write(fd, struct.pack("<IiQ", 16 + len(body), 0, unique) + body)
print("mounted", flush=True)
while True:
    os.read(fd, 1 << 20)
"""

# In the private mount namespace: the server mounts at argv[1]; each command of argv[4] (JSON)
# runs with its output captured, at most 30 s: one still running then is reported as hung, after
# the server is killed (which ends the waits: a command waiting uninterruptibly could not be
# killed before). Prints the results as JSON.
DRIVER = r"""
import json, subprocess, sys, time
mnt, repo, hangfs, cmds = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
server = subprocess.Popen([sys.executable, "-c", hangfs, mnt, repo], stdout=subprocess.PIPE, text=True)
out = []
try:
    assert server.stdout.readline().strip() == "mounted"
    for argv in cmds:
        t = time.monotonic()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            o, e = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            p.kill()
            o, e = p.communicate()
            out.append({"rc": "hung", "stdout": o, "stderr": e, "took": time.monotonic() - t})
            break
        out.append({"rc": p.returncode, "stdout": o, "stderr": e, "took": time.monotonic() - t})
finally:
    server.kill()
    server.wait()
print(json.dumps(out))
"""


def with_hung_mount(mnt: Path, cmds: list[list[str]]) -> list[dict]:
    """Each command run while `mnt` is a mount whose server never answers."""
    mnt.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", DRIVER, str(mnt),
                        str(REPO), HANGFS, json.dumps(cmds)], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout)
    assert len(out) == len(cmds) and all(r["rc"] != "hung" for r in out), out
    return out


def said(at: str, what: str) -> str:
    return (f"{at} did not answer within 1 s (a network mount whose server does not answer?): {what}; find what "
            f"serves it (findmnt -T {at}) and repair or unmount it (umount -l), or raise cdi.check_timeout")


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    p = tmp_path / "hook.toml"
    p.write_text(f'log_file = "{tmp_path / "nvhook.jsonl"}"\ncache_dir = "{tmp_path / "cache"}"\n'
                 f'[cdi]\nspec = "{tmp_path / "cdi.json"}"\ncheck_timeout = 1\n')
    return p


@pytest.mark.skipif(_fuse_skip() is not None, reason=_fuse_skip() or "")
def test_generate_warns_and_check_fails_at_the_deadline(tmp_path, cfg):
    """The spec's hook is on the hung mount. generate still writes the spec (it is right for a
    rootful engine) with one warning naming the path; check, which looks at every file the spec
    names, exits 1 with one line naming it (nothing was verified) and does not say the spec
    matches."""
    hook = tmp_path / "hang" / "nvidia-cdi-hook"
    spec = tmp_path / "cdi.json"
    common = [*NVHOOK, "--config", str(cfg), "--root", str(FIXTURES / "host-gpu1")]
    gen = [*common, "cdi", "generate", "--hook-path", str(hook)]
    r_stdout, r_file, r_check = with_hung_mount(tmp_path / "hang", [
        gen, [*gen, "--output", str(spec)], [*common, "cdi", "check", str(spec), "--hook-path", str(hook)]])
    # The walk of the hook's path stops at the mount's own directory (lstat asks the server for
    # its root's attributes); check's look at the spec's files stops at the hook itself.
    for r, where in ((r_stdout, "the spec"), (r_file, str(spec))):
        assert r["rc"] == 0 and r["took"] < 30, r
        warned = said(str(hook.parent), f"the hooks of {where} were not checked for other users")
        assert f"nvhook: warning: {warned}\n" in r["stderr"], r["stderr"]
    assert json.loads(r_stdout["stdout"])["containerEdits"]["hooks"][0]["path"] == str(hook)
    assert r_check["rc"] == 1 and r_check["took"] < 30, r_check
    assert r_check["stderr"] == f"nvhook: {said(str(hook), f'CDI spec {spec} could not be checked')}\n", r_check
    assert r_check["stdout"] == "", r_check["stdout"]


@pytest.mark.skipif(_fuse_skip() is not None, reason=_fuse_skip() or "")
def test_doctor_names_the_path_its_check_waited_on(tmp_path):
    """doctor --node --prefix: the node's spec runs its hook from a shared directory, and that
    directory is the hung mount. One problem naming the path it waited on (the machine's path,
    under the prefix), exit 5; the files the spec names are not looked at there again."""
    node = make_node(tmp_path / "node")
    with open(node / "etc/nvhook/hook.toml", "a") as f:
        f.write("[cdi]\ncheck_timeout = 1\n")
    spec = json.loads((node / "etc/cdi/nvhook.json").read_text())
    spec["containerEdits"]["hooks"][0]["path"] = "/srv/share/bin/nvhook"
    (node / "etc/cdi/nvhook.json").write_text(json.dumps(spec))
    bindir = node / "srv/share/bin"
    (r,) = with_hung_mount(bindir, [[*NVHOOK, "doctor", "--node", "--prefix", str(node), "--format", "json"]])
    assert r["rc"] == 5 and r["took"] < 30, r
    problems = [x for x in json.loads(r["stdout"])["problems"] if x["check"] == "cdi"]
    assert len(problems) == 1, problems
    # the walk stops at the mount's own directory (lstat asks the server for its root's attributes)
    at = str(bindir)
    why, fix = said(at, "its hooks were not checked for other users").split("; find", 1)
    assert problems == [{"check": "cdi", "path": "/etc/cdi/nvhook.json", "problem": why, "fix": "find" + fix}], problems


def test_within_gives_what_the_walk_gives(tmp_path):
    """Without a hang, the walk's lines come back whole through the child's pipe (a path that is
    not UTF-8 included), and nothing is said to be stuck."""
    top = Path(tempfile.mkdtemp(prefix="nvhook-reach-", dir="/tmp"))  # open to others above (tmp_path is not)
    top.chmod(0o755)
    base = Path(os.fsdecode(os.fsencode(str(top)) + b"/r\xe9p"))
    (base / "closed").mkdir(parents=True)
    hook = base / "closed" / "hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    (base / "closed").chmod(0o700)
    spec = {"containerEdits": {"hooks": [{"path": str(hook)}, {"path": "relative"}]}}
    try:
        lines, at = hookreach.within(spec, "/", 10)
        assert (lines, at) == (hookreach.spec_problems(spec), None)
    finally:
        shutil.rmtree(top)
    assert any(f"{base / 'closed'} is mode 0700" in ln for ln in lines), lines
    assert any("relative is not an absolute path" in ln for ln in lines), lines


def test_a_child_that_fails_is_never_read_as_nothing_found(monkeypatch, capsys):
    """The walk's child raising (or dying) is an error naming why, never an empty answer that
    reads as "every hook reachable" or "no file missing"."""
    from nvhook.base import process
    from nvhook.base.errors import HookError
    from nvhook.start import cdispecs

    def boom(send):
        send(b"Pfirst")
        raise RuntimeError("disk on fire")

    with pytest.raises(HookError, match=r"failed \(RuntimeError: disk on fire\): nothing was checked"):
        process.records_within(boom, 10)
    with pytest.raises(HookError, match="exit status 3"):
        process.records_within(lambda send: os._exit(3), 10)

    def broken(path, root=""):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(hookreach, "path_problems", broken)  # inherited by the forked child
    spec = {"containerEdits": {"hooks": [{"path": "/usr/bin/true"}]}}
    with pytest.raises(HookError, match="Input/output error"):
        hookreach.within(spec, "/", 10)
    assert hookreach.warn(spec, 10, "spec.json") is False
    err = capsys.readouterr().err
    assert err.startswith("nvhook: warning: the hooks of spec.json were not checked for other users: ") and \
        err.count("\n") == 1, err
    assert hookreach.warn(spec, 10, "spec.json", fatal=True) is True
    assert capsys.readouterr().err.startswith("nvhook: the hooks of spec.json were not checked")
    monkeypatch.setattr(os.path, "lexists", broken)
    with pytest.raises(HookError, match="Input/output error"):
        cdispecs.missing_within(["/usr/bin/true"], 10)
