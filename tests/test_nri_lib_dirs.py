"""Where the NRI plugin binds the driver's libraries for an image without LD_LIBRARY_PATH, with
real runc containers (tests/test_nri_plugin.py's harness): the first container of an image gets
them in both glibc families' default directories (the image cannot be read at its creation);
its start shows where the image's loader looks, and the next container of that image, in that
namespace, gets them once, in that directory. An image that changed since (another family
under the same name) still loads the driver (its loader cache and config name the directory),
or, where its /etc cannot be written, is refused with one line, and the container after it is
bound where the image now looks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "nri"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import runcbox as rb  # noqa: E402
from test_nri_plugin import HOST, PLAIN_ENV, PROBE, Created, events, serve  # noqa: E402

pytest.importorskip("grpc_tools")
import fakeruntime as fr  # noqa: E402

MULTIARCH = "/usr/lib/x86_64-linux-gnu"
LIB64 = "/usr/lib64"
IMAGE = "registry.example/team/app:1"
ANNOTATION = "io.kubernetes.cri.image-name"
# The RHEL-family fixture's loader is a Debian build (its compiled-in search path is multiarch):
# a RHEL build's search with no cache (/lib64, /usr/lib64: `ld.so --help`) is run by hand.
RHEL_LOADER_PROBE = "/usr/lib64/ld-linux-x86-64.so.2 --inhibit-cache --library-path /lib64:/usr/lib64 " \
                    "/usr/bin/cuda-probe > /out.txt 2>&1"


@pytest.fixture
def runc_ready():
    why = rb.skip_reason()
    if why:
        pytest.skip(why)


@pytest.fixture
def setup(tmp_path, fixtures_root, runc_ready):
    gen = serve(tmp_path, fixtures_root / "host-gpu8")
    yield next(gen)
    gen.close()


class Pods:
    """Containers of fixture images created by real runc with the plugin's answer, named by the
    engine's image annotation, in a pod of `namespace`."""

    def __init__(self, rt, tmp_path: Path, fixtures_root: Path):
        self.rt, self.tmp, self.fixtures = rt, tmp_path, fixtures_root
        self.n = 0
        self.boxes: list[Created] = []

    def create(self, image_dir: str, *, name: str | None = IMAGE, namespace: str = "ml", readonly: bool = False,
               script: str = PROBE, plant=None, volumes=()):
        """(Created, the Container message, the library directories the answer binds libcuda in);
        `plant(rootfs)` edits the image's copy, `volumes` are more spec mounts (the pod's)."""
        p = fr.pb()
        annotations = {ANNOTATION: name} if name else {}
        pod = p.PodSandbox(id="pod1", name="web", namespace=namespace)
        msg = p.Container(id="ignored", pod_sandbox_id="pod1", name="app", env=PLAIN_ENV, annotations=annotations)
        code, err, payload = self.rt.call("CreateContainer", p.CreateContainerRequest(pod=pod, container=msg))
        assert code == 0, err
        resp = p.CreateContainerResponse.FromString(payload)
        self.n += 1
        work = self.tmp / f"c{self.n}"
        work.mkdir()

        out = work / "out"
        out.mkdir()

        def ro(cfg):  # a read-only root writes its probe's output in a directory bound from here
            cfg["root"]["readonly"] = readonly
            cfg["mounts"].append({"destination": "/out", "type": "bind", "source": str(out),
                                  "options": ["rbind", "rw"]})
            cfg["mounts"] += list(volumes)

        box = Created(work, self.fixtures, image_dir, resp.adjust.mounts,
                      script.replace("/out.txt", "/out/out.txt"), plant=plant, edit=ro)
        box.out = out / "out.txt"  # type: ignore[attr-defined]
        self.boxes.append(box)
        devices = [p.LinuxDevice(path=d.path, type=d.type, major=d.major, minor=d.minor)
                   for d in resp.adjust.linux.devices]
        c = p.Container(id=box.id, pod_sandbox_id="pod1", name="app", env=PLAIN_ENV, pid=box.pid,
                        annotations=annotations, linux=p.LinuxContainer(devices=devices),
                        mounts=[p.Mount(destination=m.destination, type="bind", source=m.source)
                                for m in resp.adjust.mounts] +
                        [p.Mount(destination=v["destination"], type="bind", source=v["source"]) for v in volumes])
        dirs = sorted(m.destination.rsplit("/", 1)[0] for m in resp.adjust.mounts
                      if m.destination.endswith("/libcuda.so.1"))
        return box, c, pod, dirs

    @staticmethod
    def run(box) -> str:
        """Start `box` (after its StartContainer) and what its probe printed."""
        return box.start_and_wait(box.out)

    def taught(self, image_dir: str, **kw) -> None:
        """A container of `image_dir` created, given its StartContainer and run: what the plugin
        then knows of the image is what its next container is bound by."""
        box, c, pod, _dirs = self.create(image_dir, **kw)
        code, msg, _ = self.start(c, pod)
        assert code == 0, msg
        self.run(box)

    def start(self, c, pod, rt=None):
        p = fr.pb()
        return (rt or self.rt).call("StateChange", p.StateChangeEvent(event=6, pod=pod, container=c))

    def close(self):
        for b in self.boxes:
            b.delete()


@pytest.fixture
def pods(setup, tmp_path, fixtures_root):
    rt, _log = setup
    p = Pods(rt, tmp_path, fixtures_root)
    yield p
    p.close()


def started(log: Path, cid: str) -> dict:
    [ev] = [e for e in events(log, "nri.started") if e["container"] == cid]
    return ev


def loads_host_libcuda(out: str, lib_dir: str) -> None:
    lib = f"{lib_dir}/libcuda.so.1"
    assert f"=> {lib}" in out and out.count("libcuda.so.1 (") == 1, out
    assert f"path: {lib}" in out and f"cuDriverGetVersion: {HOST.cuda}" in out, out


@pytest.mark.parametrize(("image_dir", "family_dir"), [("container-debian", MULTIARCH), ("container-rhel", LIB64)])
def test_second_container_of_an_image_is_bound_once_where_its_loader_looks(setup, pods, image_dir, family_dir):
    _rt, log = setup
    box, c, pod, dirs = pods.create(image_dir)
    assert dirs == sorted([MULTIARCH, LIB64])  # nothing known of the image yet: both families
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    loads_host_libcuda(pods.run(box), family_dir)

    box, c, pod, dirs = pods.create(image_dir)
    assert dirs == [family_dir]  # once, where this image's loader looks with no cache at all
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    out = pods.run(box)
    loads_host_libcuda(out, family_dir)
    ev = started(log, box.id)
    assert ev["lib_dirs"] == family_dir and ev["ldcache"] == "written", ev
    assert "lib_conf" not in ev, ev  # the loader finds them without any config of nvhook's
    assert events(log, "nri.lib_dirs_not_searched") == []


def test_what_one_namespace_showed_does_not_move_anothers_binds(setup, pods):
    """A pod elsewhere naming the same image (over another image, or its own annotation) only
    teaches its own namespace."""
    pods.taught("container-rhel", namespace="other")
    assert pods.create("container-debian", namespace="ml")[3] == sorted([MULTIARCH, LIB64])
    assert pods.create("container-rhel", namespace="other")[3] == [LIB64]


def test_no_image_name_binds_both_families_every_time(setup, pods):
    for _ in range(2):
        box, c, pod, dirs = pods.create("container-debian", name=None)
        assert dirs == sorted([MULTIARCH, LIB64])
        assert pods.start(c, pod)[0] == 0
        loads_host_libcuda(pods.run(box), MULTIARCH)


def test_image_that_changed_family_loads_through_its_loader_config(setup, pods):
    """Learned as a Debian image, the name now a RHEL-family one: bound in the multiarch
    directory its loader does not search; the start names it in the loader config and the
    cache, a warning says why, and the CUDA program loads the host's libcuda from there. The
    next container is bound in /usr/lib64."""
    _rt, log = setup
    pods.taught("container-debian")

    box, c, pod, dirs = pods.create("container-rhel")
    assert dirs == [MULTIARCH]
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    out = pods.run(box)
    loads_host_libcuda(out, MULTIARCH)
    conf = box.rootfs / "etc/ld.so.conf.d/00-driver-nvhook.conf"
    assert conf.read_text() == MULTIARCH + "\n" and not conf.is_symlink()
    [warn] = events(log, "nri.lib_dirs_not_searched")
    assert warn["level"] == "warning" and warn["container"] == box.id and "changed" in warn["message"], warn
    assert started(log, box.id)["lib_conf"] == "written"

    box, c, pod, dirs = pods.create("container-rhel")
    assert dirs == [LIB64]
    assert pods.start(c, pod)[0] == 0
    loads_host_libcuda(pods.run(box), LIB64)


def test_image_that_changed_family_on_a_read_only_root_is_refused_once(setup, pods):
    """readOnlyRootFilesystem: nothing can point the loader at the multiarch directory, so the
    start is refused with one line that says what happened and what to do; the container made
    again (as the kubelet does) is bound where the image looks and starts."""
    _rt, log = setup
    pods.taught("container-debian")

    box, c, pod, dirs = pods.create("container-rhel", readonly=True)
    assert dirs == [MULTIARCH]
    code, msg, _ = pods.start(c, pod)
    assert code != 0 and "\n" not in msg, msg
    assert "image changed" in msg and "/usr/lib64" in msg and "start the container again" in msg, msg
    assert not (box.rootfs / "etc/ld.so.conf.d/00-driver-nvhook.conf").exists()
    [ev] = [e for e in events(log, "nri.start_refused") if e["container"] == box.id]
    assert ev["level"] == "error"

    box, c, pod, dirs = pods.create("container-rhel", readonly=True, script=RHEL_LOADER_PROBE)
    assert dirs == [LIB64]
    code, msg, _ = pods.start(c, pod)
    assert code == 0, msg
    ev = started(log, box.id)
    assert ev["ldcache"] == "read-only" and ev["lib_dirs"] == LIB64, ev
    out = pods.run(box)  # no cache of nvhook's: the loader finds the bind in its own directory
    assert f"path: {LIB64}/libcuda.so.1" in out and f"cuDriverGetVersion: {HOST.cuda}" in out, out


def test_plugin_restarted_between_create_and_start_finishes_a_once_bound_container(setup, pods, tmp_path,
                                                                                 fixtures_root):
    """A container bound once (what the old process had learned) started by a plugin that knows
    nothing of the image: its start work is for the directory the container has, not refused
    as a container the plugin never answered."""
    _rt, _log = setup
    pods.taught("container-rhel")
    box, c, pod, dirs = pods.create("container-rhel")
    assert dirs == [LIB64]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    gen = serve(fresh, fixtures_root / "host-gpu8")
    rt2, log2 = next(gen)
    try:
        code, msg, _ = pods.start(c, pod, rt=rt2)
        assert code == 0, msg
        loads_host_libcuda(pods.run(box), LIB64)
        assert events(log2, "nri.start_not_adjusted") == []
        ev = started(log2, box.id)
        assert ev["lib_dirs"] == LIB64 and ev["ldcache"] == "written", ev
    finally:
        gen.close()


def test_kept_answers_follow_what_the_image_showed(setup, pods):
    """The same request of the same image: the answer before its first start (both families)
    is not served once the image showed where it looks; the one after is kept."""
    _rt, log = setup
    box, c, pod, _ = pods.create("container-debian")
    pods.start(c, pod)
    pods.run(box)
    for _ in range(2):
        assert pods.create("container-debian")[3] == [MULTIARCH]
    cached = [e["cached"] for e in events(log, "nri.adjusted")]
    assert cached == [False, False, True], cached


def test_a_hostile_image_name_is_only_a_key(setup, pods):
    """The annotation's value is the pod's: a huge or odd name is kept as a digest, and never a
    path."""
    name = "../../etc/" + "x" * 100_000 + "\n\0"
    pods.taught("container-debian", name=name)
    assert pods.create("container-debian", name=name)[3] == [MULTIARCH]
    assert "x" * 1000 not in (pods.tmp / "nvhook.jsonl").read_text()
    assert not any(p.name.startswith("x" * 10) for p in Path("/etc").iterdir())
