"""Red team of the NRI plugin's once-per-image binds (tests/test_nri_lib_dirs.py's harness, real
runc containers): a plugin restarted between a container's creation and its start, or one that
reconnects, may have learned the image otherwise since; what it does at the start and at
Synchronize follows the binds the container has, not what it learned. A changed image whose
/etc/ld.so.conf.d cannot take nvhook's file still gets the cache that makes its loader find the
driver; an image's links, FIFOs and loops in the places the start reads or writes never reach
outside its root, hang the start or refuse another container."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_nri_lib_dirs import (  # noqa: F401
    LIB64,
    MULTIARCH,
    RHEL_LOADER_PROBE,
    Pods,
    loads_host_libcuda,
    pods,
    runc_ready,
    setup,
    started,
)
from test_nri_plugin import events, serve, synchronize

CONF = "etc/ld.so.conf.d/00-driver-nvhook.conf"


@pytest.fixture
def fresh(tmp_path, fixtures_root):
    """A second plugin process (the first one restarted), on its own runtime connection, with
    its own Pods (created containers) and log."""
    d = tmp_path / "fresh"
    d.mkdir()
    gen = serve(d, fixtures_root / "host-gpu8")
    rt, log = next(gen)
    p2 = Pods(rt, d, fixtures_root)
    yield p2, log
    p2.close()
    gen.close()


def learn(p: Pods, image_dir: str, want: list[str]) -> None:
    """A container of `image_dir` created and started by `p`'s plugin, which then binds the
    image's next container in `want`."""
    box, c, pod, _ = p.create(image_dir)
    assert p.start(c, pod)[0] == 0
    p.run(box)
    assert p.create(image_dir)[3] == want


def test_restarted_plugin_that_learned_the_image_otherwise_finishes_a_once_bound_container(setup, pods, fresh):
    """Created by the old process bound once in /usr/lib64; the new one has since seen the name
    start as a Debian image. The start work is for the directory the container has: not
    `nri.start_not_adjusted` with nothing done (no cache: the probe's loader, which searches
    the multiarch directory, would not find libcuda)."""
    learn(pods, "container-rhel", [LIB64])
    box, c, pod, dirs = pods.create("container-rhel")
    assert dirs == [LIB64]
    p2, log2 = fresh
    learn(p2, "container-debian", [MULTIARCH])

    code, msg, _ = pods.start(c, pod, rt=p2.rt)
    assert code == 0, msg
    assert events(log2, "nri.start_not_adjusted") == []
    ev = started(log2, box.id)
    assert ev["lib_dirs"] == LIB64 and ev["ldcache"] == "written", ev
    loads_host_libcuda(pods.run(box), LIB64)


def test_restarted_plugin_does_not_narrow_a_container_bound_in_both_families(setup, pods, fresh):
    """Created before anything was known of the image (both families), read-only root, a
    RHEL-family image; the new process has since seen the name start as a Debian image. The
    container's loader finds its /usr/lib64 binds: it starts (no loader cache on a read-only
    root), not refused as an image that changed."""
    box, c, pod, dirs = pods.create("container-rhel", readonly=True, script=RHEL_LOADER_PROBE)
    assert dirs == sorted([MULTIARCH, LIB64])
    p2, log2 = fresh
    learn(p2, "container-debian", [MULTIARCH])

    code, msg, _ = pods.start(c, pod, rt=p2.rt)
    assert code == 0, msg
    ev = started(log2, box.id)
    assert sorted(ev["lib_dirs"].split(",")) == sorted([MULTIARCH, LIB64]) and ev["ldcache"] == "read-only", ev
    out = pods.run(box)
    assert f"path: {LIB64}/libcuda.so.1" in out and "cuDriverGetVersion" in out, out


def test_synchronize_checks_a_once_bound_container_the_plugin_learned_otherwise(setup, pods, fresh):
    """A running container bound once in /usr/lib64 that missed its start work is named at
    Synchronize by a plugin that has since seen the name start as a Debian image (a reconnect
    keeps what the process learned): not skipped as a container nvhook never answered."""
    learn(pods, "container-rhel", [LIB64])
    box, c, _pod, _ = pods.create("container-rhel")
    p2, log2 = fresh
    learn(p2, "container-debian", [MULTIARCH])

    synchronize(p2.rt, c)
    [ev] = [e for e in events(log2, "nri.start_work_missing") if e["container"] == box.id]
    assert ev["missing"] == ["ldcache"], ev
    sync = events(log2, "nri.synchronized")[-1]
    assert (sync["start_work_checked"], sync["start_work_missing"]) == (1, 1), sync


def changed(pods: Pods, **kw):
    """The name learned as a Debian image, now a RHEL-family one: its container is bound in the
    multiarch directory, which its loader does not search, so its start must name that
    directory in the loader cache (and its config). (Created, Container, PodSandbox)."""
    learn(pods, "container-debian", [MULTIARCH])
    box, c, pod, dirs = pods.create("container-rhel", **kw)
    assert dirs == [MULTIARCH]
    return box, c, pod


def test_a_read_only_ld_so_conf_d_volume_still_gets_the_cache(setup, pods, tmp_path):
    """/etc/ld.so.conf.d is a volume (a ConfigMap: read-only, not the image's): nvhook's file is
    not written there, but the cache in the image's own /etc is, and the loader finds libcuda
    through it (`ldconfig -p` lists it); a warning says what an ldconfig run later will lose.
    Nothing lands in the volume."""
    _rt, log = setup
    confd = tmp_path / "configmap"
    confd.mkdir()
    (confd / "app.conf").write_text("/opt/app/lib\n")
    before = sorted(os.listdir(confd))
    box, c, pod = changed(pods, volumes=[{"destination": "/etc/ld.so.conf.d", "type": "bind",
                                          "source": str(confd), "options": ["rbind", "ro"]}])
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    ev = started(log, box.id)
    assert ev["lib_conf"] == "not-written" and ev["ldcache"] == "written", ev
    [warn] = [e for e in events(log, "nri.lib_conf_not_written") if e["container"] == box.id]
    assert warn["level"] == "warning" and "ldconfig" in warn["message"], warn
    assert sorted(os.listdir(confd)) == before
    loads_host_libcuda(pods.run(box), MULTIARCH)


def test_an_etc_volume_on_a_changed_image_is_refused_with_one_line(setup, pods, tmp_path):
    """/etc itself a volume (not the image's, not the node's): no cache can be written there, so
    nothing would point the loader at the multiarch directory: refused with one line that says
    to start again (the next container is bound where the image looks); nothing written in it."""
    _rt, log = setup
    etc = tmp_path / "etcvol"
    import shutil

    shutil.copytree(pods.fixtures / "container-rhel" / "etc", etc)
    before = sorted(str(p.relative_to(etc)) for p in etc.rglob("*"))
    box, c, pod = changed(pods, volumes=[{"destination": "/etc", "type": "bind", "source": str(etc),
                                          "options": ["rbind", "rw"]}])
    code, msg, _ = pods.start(c, pod)
    assert code != 0 and "\n" not in msg, msg
    assert "volume" in msg and "start the container again" in msg, msg
    assert sorted(str(p.relative_to(etc)) for p in etc.rglob("*")) == before
    assert pods.create("container-rhel")[3] == [LIB64]


def _plant(kind: str, host: Path):
    """An image's plant where the start of a changed image writes its loader config."""
    def plant(rootfs: Path) -> None:
        confd = rootfs / "etc/ld.so.conf.d"
        conf = rootfs / CONF
        if kind == "conf-link-host":
            conf.symlink_to(host / "victim.conf")
        elif kind == "conf-fifo":
            os.mkfifo(conf)
        elif kind == "conf-dir":
            conf.mkdir()
        elif kind == "confd-link-host":
            os.rmdir(confd)
            confd.symlink_to(host)
        elif kind == "confd-link-root":
            os.rmdir(confd)
            confd.symlink_to("/")
        elif kind == "confd-file":
            os.rmdir(confd)
            confd.write_text("/usr/lib64\n")
        elif kind == "confd-loop":
            os.rmdir(confd)
            confd.symlink_to("ld.so.conf.d")
    return plant


@pytest.mark.parametrize("kind", ["conf-link-host", "conf-fifo", "conf-dir", "confd-link-host", "confd-link-root",
                                  "confd-file", "confd-loop"])
def test_a_hostile_changed_image_gets_its_cache_and_nothing_outside(setup, pods, tmp_path, kind):
    """The image plants a link to a node path, a FIFO, a directory or a loop where the start writes
    00-driver-nvhook.conf: nothing outside its root is written or read, the start does not
    hang, and the loader finds libcuda through the cache (the config is written inside the
    root, or a warning says it was not)."""
    _rt, log = setup
    host = tmp_path / "node-dir"
    host.mkdir()
    (host / "victim.conf").write_text("node's own\n")
    box, c, pod = changed(pods, plant=_plant(kind, host))
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    assert sorted(os.listdir(host)) == ["victim.conf"] and (host / "victim.conf").read_text() == "node's own\n"
    ev = started(log, box.id)
    assert ev["ldcache"] == "written", ev
    if kind in ("conf-link-host", "conf-fifo"):
        conf = box.rootfs / CONF
        assert not conf.is_symlink() and conf.read_text() == MULTIARCH + "\n", kind
    if kind == "confd-link-root":
        assert (box.rootfs / "00-driver-nvhook.conf").read_text() == MULTIARCH + "\n"
    loads_host_libcuda(pods.run(box), MULTIARCH)


def test_a_pods_volume_does_not_teach_where_the_image_looks(setup, pods, tmp_path):
    """A pod of a RHEL-family image with a volume holding a libc.so.6 at the multiarch directory
    (its own volume: what it shows is the pod's, not the image's) teaches nothing of it: the
    image's next container, in a pod without that volume, is bound in /usr/lib64 where its
    loader looks, not in the multiarch directory (a warning each time, or a refused start on a
    read-only root, for every pod of the image without the volume)."""
    vol = tmp_path / "libs"
    vol.mkdir()
    (vol / "libc.so.6").write_bytes((pods.fixtures / "container-rhel/usr/lib64/libc.so.6").read_bytes())
    box, c, pod, _ = pods.create("container-rhel", volumes=[{"destination": MULTIARCH, "type": "bind",
                                                            "source": str(vol), "options": ["rbind", "ro"]}])
    assert pods.start(c, pod)[0] == 0
    assert pods.create("container-rhel")[3] == [LIB64]


def _libc(kind: str, host: Path):
    """A Debian image's libc.so.6 (/lib/<multiarch>, the first place looked) or its directory
    replaced by what a hostile image plants; the start reads it to learn where the loader looks."""
    def plant(rootfs: Path) -> None:
        d = rootfs / "lib/x86_64-linux-gnu"
        libc = d / "libc.so.6"
        if kind.startswith("libc-"):
            libc.unlink()
        if kind == "libc-link-host":
            libc.symlink_to(host / "libc.so.6")
        elif kind == "libc-loop":
            libc.symlink_to("libc.so.6")
        elif kind == "libc-fifo":
            os.mkfifo(libc)
        elif kind == "libc-dev-null":
            os.mknod(libc, 0o600 | 0o020000, os.makedev(1, 3))
        elif kind == "dir-link-root":
            for p in d.iterdir():
                p.rename(rootfs / p.name)  # the image's libraries, libc too, at / instead
            d.rmdir()
            d.symlink_to("/")
    return plant


@pytest.mark.parametrize(("kind", "want"), [
    ("libc-link-host", [MULTIARCH, LIB64]),  # resolved inside the root: no libc there, nothing learned
    ("libc-loop", [MULTIARCH, LIB64]),
    ("libc-fifo", [MULTIARCH]),  # never opened: only its name counts
    ("libc-dev-null", [MULTIARCH]),
    ("dir-link-root", [MULTIARCH])])  # the directory is "/" inside the root: libc.so.6 is there
def test_a_hostile_libc_teaches_only_its_own_image_and_never_hangs_the_start(setup, pods, tmp_path, kind, want):
    """What the start learns from: links resolved inside the root (a node path, a loop), a FIFO
    or a device never opened. The start answers, nothing on the node is read or changed, and
    what it learned moves only this image's binds, in this namespace."""
    host = tmp_path / "node-dir"
    host.mkdir()
    (host / "libc.so.6").write_bytes(b"\x7fELF node's own")
    box, c, pod, _ = pods.create("container-debian", plant=_libc(kind, host), script="true")
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    assert sorted(os.listdir(host)) == ["libc.so.6"] and (host / "libc.so.6").read_bytes() == b"\x7fELF node's own"
    assert pods.create("container-debian")[3] == sorted(want)
    assert pods.create("container-debian", namespace="other")[3] == sorted([MULTIARCH, LIB64])


def _usr_lib(links: bool):
    """The RHEL-family fixture rearranged with its libc in /usr/lib: Arch's layout (`links`:
    /lib64 and /usr/lib64 are links to /usr/lib) or one with no such link."""
    def plant(rootfs: Path) -> None:
        lib64 = rootfs / "usr/lib64"
        for p in lib64.iterdir():
            p.rename(rootfs / "usr/lib" / p.name)
        lib64.rmdir()
        (rootfs / "lib64").unlink()
        if links:
            lib64.symlink_to("lib")
            (rootfs / "lib64").symlink_to("usr/lib")
        else:  # its programs' interpreter is /lib/ld-linux-x86-64.so.2 then; /lib is a link to usr/lib
            (rootfs / "lib64").mkdir()
            (rootfs / "lib64/ld-linux-x86-64.so.2").symlink_to("/usr/lib/ld-linux-x86-64.so.2")
    return plant


ARCH_PROBE = "/usr/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /usr/lib /usr/bin/cuda-probe > /out.txt 2>&1"


def test_an_arch_layout_is_bound_once_through_its_lib64_link(setup, pods):
    """Arch keeps its libc in /usr/lib, with /lib64 and /usr/lib64 links to it: found as /lib64's
    family, its next container is bound once in /usr/lib64, which lands in /usr/lib, where its
    loader looks with no cache (run here as an Arch loader searches: /usr/lib only)."""
    _rt, log = setup
    box, c, pod, _ = pods.create("container-rhel", plant=_usr_lib(True), script=ARCH_PROBE)
    assert pods.start(c, pod)[0] == 0
    box, c, pod, dirs = pods.create("container-rhel", plant=_usr_lib(True), script=ARCH_PROBE)
    assert dirs == [LIB64]
    assert pods.start(c, pod)[0] == 0
    assert "lib_conf" not in started(log, box.id)
    out = pods.run(box)
    assert "path: /usr/lib/libcuda.so.1" in out and "cuDriverGetVersion" in out, out


def test_a_usr_lib_libc_without_links_is_reached_through_the_cache_or_refused_read_only(setup, pods):
    """A glibc image whose libc is in /usr/lib with no /lib64 link to it searches neither family's
    directory: every container is bound in both, and named in the loader config and cache
    (info, not a warning: nothing changed); on a read-only root, refused with the line that
    says what to set."""
    _rt, log = setup
    for _ in range(2):
        box, c, pod, dirs = pods.create("container-rhel", plant=_usr_lib(False))
        assert dirs == sorted([MULTIARCH, LIB64])
        assert pods.start(c, pod)[0] == 0
        assert started(log, box.id)["lib_conf"] == "written"
        assert (box.rootfs / CONF).read_text().split() == [MULTIARCH, LIB64]
    assert {e["level"] for e in events(log, "nri.lib_dirs_not_searched")} == {"info"}
    box, c, pod, dirs = pods.create("container-rhel", plant=_usr_lib(False), readonly=True)
    code, msg, _ = pods.start(c, pod)
    assert code != 0 and "\n" not in msg and "searches /lib, /usr/lib" in msg, msg
    assert "readOnlyRootFilesystem: false" in msg and "LD_LIBRARY_PATH=" in msg, msg
