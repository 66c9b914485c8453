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
from test_nri_lib_dirs import (LIB64, MULTIARCH, RHEL_LOADER_PROBE, Pods, loads_host_libcuda, pods,  # noqa: F401
                               runc_ready, setup, started)
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
