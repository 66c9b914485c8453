"""The NRI plugin's StartContainer work in a pod with a user namespace of its own (its root is
host uid 100000), with real runc containers (tests/test_nri_plugin.py's harness): the plugin
creates the container's files as that root, and must keep the capabilities the container's
root holds in its namespace while it does (the kernel drops them from the effective set when
the fsuid leaves 0): the application profile's 0555 directories, an image's 0555 /etc or
/etc/ld.so.conf.d. Hook mode does the same in its apply child (tests/test_apply_runc.py)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "nri"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402
from test_nri_plugin import (  # noqa: E402
    HOST,
    PROBE,
    PROFILE,
    Created,
    container,
    create,
    events,
    no_drm_node,
    no_process_started,
    profile_bytes,
    serve,
    start_event,
)

pytest.importorskip("grpc_tools")
import fakeruntime as fr  # noqa: E402

from nvhook.base import sandbox  # noqa: E402

USERNS_ROOT = 100000  # the host uid and gid of the container's root


@pytest.fixture
def runc_ready():
    why = rb.skip_reason()
    if why:
        pytest.skip(why)


def _owner_mode(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def userns_base():
    """A directory the container's root (host uid 100000) may traverse (tmp_path is 0700)."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="nvhook-nri-userns-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


@pytest.fixture
def start_securebits(monkeypatch):
    """The real start work, spied on: its thread's securebits before and after it, per start."""
    from nvhook.start.nri import nristart

    seen: list[tuple[int, int]] = []
    real = nristart.start_work

    def spy(*args):
        before = sandbox.get_securebits()
        try:
            return real(*args)
        finally:
            seen.append((before, sandbox.get_securebits()))

    monkeypatch.setattr(nristart, "start_work", spy)
    return seen


def userns_started(rt, base: Path, fixtures_root: Path, monkeypatch, env, image: str, script: str, modes) -> Created:
    """The plugin's answer for `env`; a container of `image` created by runc with it in a user
    namespace of its own whose root is host uid USERNS_ROOT (the image's copy owned by it, as
    its engine unpacks it for such a pod; `modes`, {directory: mode}, given to the image's
    directories); the plugin's StartContainer for it, which must succeed (no process), and
    the container run: the Created."""
    p = fr.pb()
    code, msg, resp = create(rt, container("ignored", env))
    assert code == 0, msg

    def plant(rootfs: Path) -> None:
        for d, names, files in os.walk(rootfs):
            for n in [d, *(os.path.join(d, x) for x in names + files)]:
                os.lchown(n, USERNS_ROOT, USERNS_ROOT)
        for rel, mode in modes.items():
            (rootfs / rel.lstrip("/")).chmod(mode)

    def userns(cfg: dict) -> None:
        cfg["linux"]["namespaces"].append({"type": "user"})
        for key in ("uidMappings", "gidMappings"):
            cfg["linux"][key] = [{"containerID": 0, "hostID": USERNS_ROOT, "size": 65536}]

    box = Created(base, fixtures_root, image, resp.adjust.mounts, script, plant=plant, edit=userns)
    c = p.Container(id=box.id, pod_sandbox_id="pod1", name="app", env=env, pid=box.pid,
                    mounts=[p.Mount(destination=m.destination, type="bind", source=m.source)
                            for m in resp.adjust.mounts],
                    linux=p.LinuxContainer(devices=[p.LinuxDevice(path=d.path, type=d.type, major=d.major,
                                                                  minor=d.minor) for d in resp.adjust.linux.devices]))
    try:
        with no_process_started(monkeypatch):
            code, msg, _ = rt.call("StateChange", start_event(c))
        assert code == 0, msg
        box.start_and_wait()
    finally:
        box.delete()
    return box


@pytest.mark.parametrize("etc_mode", [0o755, 0o555], ids=["etc-0755", "etc-0555"])
def test_a_user_namespaced_graphics_container_gets_its_profile_and_cache(tmp_path, fixtures_root, runc_ready,
                                                                         monkeypatch, userns_base, start_securebits,
                                                                         etc_mode):
    """A pod with its own user namespace (its root is host uid 100000): the plugin makes the
    profile's directories and files as that root, the directories 0555, so the second one is
    made inside a directory its owner may not write; the container's root may (it holds
    CAP_DAC_OVERRIDE in its namespace), and so must nvhook as it: the profile is written, the
    file 0444 and the directories 0555, all the container's root's, and so is the loader cache,
    also where the image's /etc itself is 0555 (without, that start was refused). The start's
    thread has its securebits back after the work (no thread of the plugin's is left without
    the kernel's setuid fixup)."""


    gen = serve(tmp_path, no_drm_node(userns_base, fixtures_root))
    rt, log = next(gen)
    env = ["NVIDIA_VISIBLE_DEVICES=1,5", "NVIDIA_DRIVER_CAPABILITIES=compute,graphics,utility"]
    dirs = ("/etc/nvidia", "/etc/nvidia/nvidia-application-profiles-rc.d")
    script = (f"cat /{PROFILE} > /out.txt 2>&1; echo '<end>' >> /out.txt; "
              f"stat -c '%u %g %a %n' {' '.join(dirs)} /{PROFILE} /etc/ld.so.cache >> /out.txt 2>&1; "
              f"/sbin/ldconfig -p | grep -c 'libcuda.so.1 (' >> /out.txt")
    try:
        box = userns_started(rt, userns_base, fixtures_root, monkeypatch, env, "container-debian", script,
                             {"/etc": etc_mode})
    finally:
        gen.close()
    want = profile_bytes([HOST.gpus[1].minor, HOST.gpus[5].minor])
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    assert (ev["work"], ev["app_profile"], ev["ldcache"]) == ("compat,ldcache,profile", "written", "written"), ev
    assert not events(log, "app_profile.not_written")
    assert (box.rootfs / PROFILE).read_bytes() == want
    # inside: the container's root (uid 0 there) owns them; its own ldconfig lists the driver once
    out = (box.rootfs / "out.txt").read_text()
    assert out.splitlines() == [want.decode() + "<end>", f"0 0 555 {dirs[0]}", f"0 0 555 {dirs[1]}",
                                f"0 0 444 /{PROFILE}", "0 0 644 /etc/ld.so.cache", "1"], out
    # outside: the host ids the container's root is
    owners = {rel: _owner_mode(box.rootfs / rel.lstrip("/")) for rel in (*dirs, f"/{PROFILE}", "/etc/ld.so.cache")}
    root = (USERNS_ROOT, USERNS_ROOT)
    assert owners == {dirs[0]: (*root, 0o555), dirs[1]: (*root, 0o555), f"/{PROFILE}": (*root, 0o444),
                      "/etc/ld.so.cache": (*root, 0o644)}, owners
    [(before, after)] = start_securebits
    assert after == before and not before & sandbox.SECBIT_NO_SETUID_FIXUP, start_securebits


def test_a_user_namespaced_container_gets_its_compat_conf_in_a_0555_conf_dir(tmp_path, fixtures_root, runc_ready,
                                                                             monkeypatch, userns_base,
                                                                             start_securebits):
    """The loader drop-in in a user-namespaced pod: a CUDA 11.3 image on a 450 driver with a T4
    (its compat libcuda chosen) whose /etc/ld.so.conf.d is 0555: the compat conf is written
    there as the container's root (without, that start was refused), the cache lists the
    compat libcuda first, and a CUDA program loads it."""
    fixture = mf.HOSTS["host-t4-450"]
    gen = serve(tmp_path, fixtures_root / "host-t4-450")
    rt, log = next(gen)
    env = [f"NVIDIA_VISIBLE_DEVICES={fixture.gpus[0].uuid}", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
           *mf.CONTAINERS["container-cuda113"].env]
    try:
        box = userns_started(rt, userns_base, fixtures_root, monkeypatch, env, "container-cuda113", PROBE,
                             {"/etc/ld.so.conf.d": 0o555})
    finally:
        gen.close()
    compat = "/usr/local/cuda-11.3/compat"
    [ev] = [e for e in events(log, "nri.started") if e["container"] == box.id]
    assert (ev["compat"], ev["compat_dir"], ev["ldcache"]) == ("image", compat, "written"), ev
    out = (box.rootfs / "out.txt").read_text()
    first = next(line.strip() for line in out.splitlines() if "libcuda.so.1 (" in line)
    assert first == f"libcuda.so.1 (libc6,x86-64) => {compat}/libcuda.so.1", out
    assert f"path: {compat}/libcuda.so.465.19.01" in out and "cuDriverGetVersion: 11030" in out, out
    conf = box.rootfs / "etc/ld.so.conf.d/00-compat-nvhook.conf"
    assert conf.read_text() == compat + "\n"
    assert _owner_mode(conf) == (USERNS_ROOT, USERNS_ROOT, 0o644)
    assert _owner_mode(box.rootfs / "etc/ld.so.cache") == (USERNS_ROOT, USERNS_ROOT, 0o644)
    assert [after for _before, after in start_securebits] == [before for before, _after in start_securebits]
