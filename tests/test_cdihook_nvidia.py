"""Specs written by NVIDIA's own nvidia-ctk, run by real podman with nvhook as their hook.

nvidia-ctk (1.17.0, 1.18.0) is built from NVIDIA's public sources by bench/build_reference_cdi.sh
in a scratch directory outside the repo; these tests run only where NVHOOK_REFERENCE_CDI names
that directory. The spec is generated for a fixture host (--driver-root/--dev-root), its hook
path pointed at nvhook's nvidia-cdi-hook (the .deb's first stage, tests/e2e/cdihookbox.py) with
`--nvhook-config` added for the test's private log, and podman 4.3.1 applies it
(tests/e2e/cdibox.py). The container says what it sees: the links NVIDIA's create-symlinks
hooks asked for, the loader cache update-ldcache asked for, and which libcuda a CUDA program
maps. On a GeForce host with a compat image, NVIDIA's enable-cuda-compat (1.18) would put the
image's compat libcuda first (CUDA error 804 on that GPU); nvhook's decision keeps the host's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))

import cdibox  # noqa: E402
import cdihookbox  # noqa: E402
import make_fixtures as mf  # noqa: E402
import runcbox as rb  # noqa: E402

from nvhook.base import catalog  # noqa: E402

pytestmark = [pytest.mark.podman, pytest.mark.skipif(cdibox.skip_reason() is not None,
                                                     reason=cdibox.skip_reason() or "")]

L = "/usr/lib/x86_64-linux-gnu"
VIEW = (f"/usr/bin/cuda-probe; echo LINK:$(readlink {L}/libcuda.so); "
        f"echo GBM:$(readlink {L}/gbm/nvidia-drm_gbm.so); echo CACHE; /sbin/ldconfig -p; echo END-CACHE; "
        "ls /etc/ld.so.conf.d/; ls /dev/nvidia0 /dev/nvidiactl")


def need(tag: str) -> Path:
    ref = cdihookbox.reference(tag)
    if ref is None:
        pytest.skip(f"NVIDIA's nvidia-ctk {tag} is not built: run bench/build_reference_cdi.sh DIR TOOLKIT_GIT and set "
                    f"NVHOOK_REFERENCE_CDI=DIR")
    return ref


class Run:
    def __init__(self, tmp: Path, fixtures_root: Path, tag: str, host: str, image: str, sysfs: bool = False,
                 stage: str = "shell"):
        ref = need(tag)
        self.tmp = tmp
        tmp.mkdir(parents=True)
        self.log = tmp / "nvhook.jsonl"
        self.config = rb.write_nvhook_config(tmp / "hook.toml", log_file=self.log, cache_dir=tmp / "cache",
                                             root=fixtures_root / host)
        hook = cdihookbox.shell_first_stage(tmp) if stage == "shell" else cdihookbox.first_stage(tmp)
        self.marks = hook.parent.parent / "marks"
        p = cdihookbox.nvidia_ctk_generate(ref, fixtures_root / host, str(hook), sysfs=sysfs)
        assert p.returncode == 0, p.stderr
        spec = json.loads(p.stdout)
        self.spec = spec
        self.hooks = spec["containerEdits"]["hooks"]
        for h in self.hooks + [h for d in spec["devices"] for h in d["containerEdits"].get("hooks") or []]:
            assert h["path"] == str(hook)
            h["args"][1:1] = ["--nvhook-config", str(self.config)]
        if spec["cdiVersion"] > "0.5.0":  # podman 4.3.1 knows up to 0.5.0; nothing here needs more
            spec["cdiVersion"] = "0.5.0"
        self.spec = spec
        self.podman = cdibox.CdiPodman(tmp)
        self.write_spec()
        self.rootfs = mf.build_container(image, tmp / "images")

    def write_spec(self) -> None:
        (self.podman.spec_dir / "nvidia.json").write_text(json.dumps(self.spec))

    def run(self, script: str = VIEW):
        return self.podman.run(self.rootfs, script, ["nvidia.com/gpu=0"])

    def events(self, name: str) -> list[dict]:
        return [e for e in rb.read_events(self.log) if e["event"] == name]

    def close(self) -> None:
        assert self.podman.leftovers() == []
        self.podman.close()


@pytest.fixture
def make(tmp_path, fixtures_root):
    made = []

    def _make(tag: str, host: str, image: str = "container-debian", sysfs: bool = False, stage: str = "shell") -> Run:
        r = Run(tmp_path / f"r{len(made)}", fixtures_root, tag, host, image, sysfs, stage)
        made.append(r)
        return r

    yield _make
    for r in made:
        r.close()


def field(out: str, key: str) -> str:
    values = [ln[len(key) + 2:] for ln in out.splitlines() if ln.startswith(key + ": ")]
    assert len(values) == 1, out
    return values[0]


def cache_target(out: str, soname: str) -> str:
    """Where the container's ld.so.cache leads `soname` first (ldconfig -p's first line of it)."""
    cache = out.split("\nCACHE\n", 1)[1].split("END-CACHE", 1)[0]
    return next(ln.split(" => ")[1] for ln in cache.splitlines() if ln.strip().startswith(soname + " "))


@pytest.mark.parametrize("stage", ["shell", "python"])
@pytest.mark.parametrize("tag", ["v1.17.0", "v1.18.0"])
def test_nvidia_spec_with_nvhooks_hook(make, tag, stage):
    """What the container sees is the same whichever first stage runs the entries: the shell
    one (the .deb's) does the run of entries in the first entry's Python process and the
    others end in the shell; the python one (a pip install's) runs one process per entry."""
    r = make(tag, "host-gpu1", stage=stage)
    p = r.run()
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "LINK:libcuda.so.1" in out  # create-symlinks
    assert "GBM:../libnvidia-allocator.so.1" in out
    assert cache_target(out, "libcuda.so.1") == f"{L}/libcuda.so.1"  # update-ldcache
    assert field(out, "path") == f"{L}/libcuda.so.{mf.HOSTS['host-gpu1'].driver}"  # a CUDA program's libcuda
    assert "/dev/nvidia0" in out
    done = r.events("cdi_hook.done")
    assert len(done) == len(r.hooks) >= 3  # every hook entry's work done once, each logged
    assert [e["cdi_hook"] for e in done] == [h["args"][3] for h in r.hooks]  # in the spec's order
    pids = {e["nvhook_pid"] for e in done}
    if stage == "shell":
        assert len(pids) == 1, done  # one Python process for the whole run
        assert [bool(e.get("coalesced")) for e in done] == [False] + [True] * (len(done) - 1)
        # the marker: every entry taken off it by its own run in the shell
        (marker,) = list(r.marks.iterdir())
        assert len(marker.read_text().splitlines()) == 1, marker.read_text()
    else:
        assert len(pids) == len(done)


def test_geforce_host_with_compat_image_keeps_the_hosts_libcuda(make):
    """NVIDIA 1.18's spec asks enable-cuda-compat --host-driver-version 460...: its own hook
    would add the image's compat directory (465 > 460) on a GeForce GPU, error 804."""
    r = make("v1.18.0", "host-geforce-460", "container-cuda113")
    assert any(h["args"][3] == "enable-cuda-compat" for h in r.hooks), r.hooks
    p = r.run()
    assert p.returncode == 0, p.stderr
    host_lib = f"{L}/libcuda.so.{mf.HOSTS['host-geforce-460'].driver}"
    assert field(p.stdout, "path") == host_lib
    assert cache_target(p.stdout, "libcuda.so.1") == f"{L}/libcuda.so.1"
    assert "00-compat-nvhook.conf" not in p.stdout
    (d,) = r.events("compat.decision")
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported", d


def test_datacenter_host_with_compat_image_uses_compat(make):
    r = make("v1.18.0", "host-t4-450", "container-cuda113")
    p = r.run()
    assert p.returncode == 0, p.stderr
    compat = mf.CONTAINERS["container-cuda113"].compat
    assert "00-compat-nvhook.conf" in p.stdout
    assert field(p.stdout, "path").endswith(f"compat/libcuda.so.{compat.version}")
    (d,) = r.events("compat.decision")
    assert d["decision"] == "image", d


COMPAT_ROOT = "/opt/nv/compat"


def _compat_elsewhere(r: Run, flag: bool, outside: Path | None = None) -> None:
    """The image keeps its compat libraries at /opt/nv/compat (nothing under /usr/local/cuda);
    with `flag`, the spec's enable-cuda-compat names that directory as NVIDIA 1.19+ lets it.
    `outside`: /opt/nv/compat is instead an absolute link to that host directory (the libraries
    moved there), which a hook must resolve inside the rootfs, where it leads nowhere."""
    cuda_dir = mf.CONTAINERS["container-cuda113"].compat.cuda_dir
    (r.rootfs / "opt/nv").mkdir(parents=True)
    src = r.rootfs / f"usr/local/{cuda_dir}/compat"
    if outside is None:
        src.rename(r.rootfs / COMPAT_ROOT.lstrip("/"))
    else:
        src.rename(outside)
        (r.rootfs / COMPAT_ROOT.lstrip("/")).symlink_to(outside)
    (hook,) = [h for h in r.spec["containerEdits"]["hooks"] if h["args"][3] == "enable-cuda-compat"]
    if flag:
        hook["args"] += ["--cuda-compat-container-root", COMPAT_ROOT]
    r.write_spec()


def test_cuda_compat_container_root_is_where_the_hook_looks(make):
    """NVIDIA's --cuda-compat-container-root (1.19+): the compat libraries are looked for in that
    directory, and nvhook's per-GPU decision is still the one that picks them."""
    r = make("v1.18.0", "host-t4-450", "container-cuda113")
    compat = mf.CONTAINERS["container-cuda113"].compat
    _compat_elsewhere(r, flag=True)
    p = r.run()
    assert p.returncode == 0, p.stderr
    assert field(p.stdout, "path") == f"{COMPAT_ROOT}/libcuda.so.{compat.version}"
    assert cache_target(p.stdout, "libcuda.so.1") == f"{COMPAT_ROOT}/libcuda.so.1"
    assert "00-compat-nvhook.conf" in p.stdout
    (d,) = r.events("compat.decision")
    assert d["decision"] == "image", d


def test_compat_libraries_elsewhere_are_not_found_without_the_flag(make):
    r = make("v1.18.0", "host-t4-450", "container-cuda113")
    _compat_elsewhere(r, flag=False)
    p = r.run()
    assert p.returncode == 0, p.stderr
    assert field(p.stdout, "path") == f"{L}/libcuda.so.{mf.HOSTS['host-t4-450'].driver}"
    assert "00-compat-nvhook.conf" not in p.stdout


def test_cuda_compat_container_root_on_a_geforce_gpu_keeps_the_hosts_libcuda(make):
    r = make("v1.18.0", "host-geforce-460", "container-cuda113")
    _compat_elsewhere(r, flag=True)
    p = r.run()
    assert p.returncode == 0, p.stderr
    assert field(p.stdout, "path") == f"{L}/libcuda.so.{mf.HOSTS['host-geforce-460'].driver}"
    assert "00-compat-nvhook.conf" not in p.stdout
    (d,) = r.events("compat.decision")
    assert d["decision"] == "host" and d["reason_code"] == "gpu-not-supported", d


def test_cuda_compat_container_root_is_resolved_inside_the_rootfs(make, tmp_path):
    """An image whose compat root is an absolute link to a host directory holding a newer
    libcuda: inside the rootfs that link leads nowhere, so nothing is found and nothing of the
    host directory reaches the container's loader path."""
    r = make("v1.18.0", "host-t4-450", "container-cuda113")
    outside = tmp_path / "host-compat"
    _compat_elsewhere(r, flag=True, outside=outside)
    p = r.run()
    assert p.returncode == 0, p.stderr
    assert field(p.stdout, "path") == f"{L}/libcuda.so.{mf.HOSTS['host-t4-450'].driver}"
    assert "00-compat-nvhook.conf" not in p.stdout
    assert any(outside.glob("libcuda.so.*.*"))  # the host directory is there, with a newer libcuda


def test_cdi_list_all_reads_nvidia_ctk_yaml(tmp_path, fixtures_root):
    ref = need("v1.18.0")
    host = fixtures_root / "host-gpu1"
    p = cdihookbox.nvidia_ctk_generate(ref, host, "/usr/lib/nvhook/bin/nvidia-cdi-hook")
    assert p.returncode == 0, p.stderr
    d = tmp_path / "cdi"
    d.mkdir()
    yaml = subprocess.run([str(ref / "nvidia-ctk"), "cdi", "generate", "--driver-root", str(host), "--dev-root",
                           str(host), "--format", "yaml"], capture_output=True, text=True, timeout=120)
    assert yaml.returncode == 0, yaml.stderr
    (d / "nvidia.yaml").write_text(yaml.stdout)
    conf = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "log", cache_dir=tmp_path / "cache")
    out = subprocess.run([str(rb.NVHOOK_BIN), "--config", str(conf), "cdi", "list", "--spec-dir", str(d),
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    names = [i["name"] for i in json.loads(out.stdout)]
    assert names == [f"nvidia.com/gpu={d['name']}" for d in json.loads(p.stdout)["devices"]]


# -- graphics: /dev/dri nodes, by-path links, loader files ----------------------------------------

def _device_nodes(spec: dict) -> dict[str, list[str]]:
    return {d["name"]: sorted(n["path"] for n in d["containerEdits"].get("deviceNodes") or [])
            for d in spec["devices"]}


@pytest.mark.parametrize("tag", ["v1.17.0", "v1.18.0"])
@pytest.mark.parametrize("host", ["host-gpu1", "host-debian"])
def test_graphics_spec_parity_with_nvidia_ctk(tmp_path, fixtures_root, tag, host):
    """nvidia-ctk (given the fixture's sysfs) and `nvhook cdi generate --capabilities all` give
    every device the same nodes (its /dev/nvidiaN and its own DRM card and render nodes); the
    loader files nvidia-ctk mounts are all in nvhook's spec (the X server's configs there
    with display, which `all` has), which adds the OpenCL ICD file. The by-path links nvidia-ctk
    asks create-symlinks for are the ones nvhook's hook makes (where the host has them)."""
    ref = need(tag)
    root = fixtures_root / host
    theirs = json.loads(cdihookbox.nvidia_ctk_generate(ref, root, "/bin/true", sysfs=True).stdout)
    conf = rb.write_nvhook_config(tmp_path / "hook.toml", log_file=tmp_path / "log", cache_dir=tmp_path / "cache")
    p = subprocess.run([str(rb.NVHOOK_BIN), "--config", str(conf), "--root", str(root), "cdi", "generate",
                        "--capabilities", "all"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    ours = json.loads(p.stdout)
    assert _device_nodes(ours) == _device_nodes(theirs)
    assert any(n.startswith("/dev/dri/renderD") for n in _device_nodes(ours)["0"])

    def files(spec: dict) -> set[str]:
        programs = {name for name, _, _ in catalog.BINARY_ROWS}  # nvidia-ctk misses Debian's (issue 26)
        return {m["hostPath"] for m in spec["containerEdits"]["mounts"]
                if ".so" not in m["hostPath"] and m["hostPath"].rsplit("/", 1)[1] not in programs
                and "/firmware/" not in m["hostPath"] and "/run/" not in m["hostPath"] and "/tmp/" not in m["hostPath"]}

    assert files(theirs) and files(theirs) <= files(ours)
    assert files(ours) - files(theirs) == {str(root / "etc/OpenCL/vendors/nvidia.icd")}
    their_links = sorted(a.split("::")[1].rsplit("/", 1)[1] for d in theirs["devices"] if d["name"] == "0"
                         for h in d["containerEdits"].get("hooks") or [] if "create-symlinks" in h["args"]
                         for a in h["args"] if "::" in a)
    spec = mf.HOSTS[host]
    g0 = spec.gpus[0]
    want = sorted(f"pci-{g0.bus_id}-{k}" for k in ("card", "render")) if spec.by_path else []
    assert their_links == want


@pytest.mark.parametrize("tag", ["v1.17.0", "v1.18.0"])
def test_nvidia_graphics_spec_with_nvhooks_hook(make, tag):
    """NVIDIA's spec with DRM nodes per device and their hooks (create-symlinks for by-path,
    1.17's chmod of /dev/dri) run by nvhook: the container has GPU 0's card and render nodes,
    and the links where NVIDIA's spec puts them (under --dev-root's path: nvidia-ctk writes the
    host path of the link, dev root included, as the container path)."""
    r = make(tag, "host-gpu1", sysfs=True)
    dev0 = next(d for d in r.spec["devices"] if d["name"] == "0")["containerEdits"]
    links = [a.split("::") for h in dev0.get("hooks") or [] for a in h["args"] if "::" in a]
    assert len(links) == 2
    script = ('for d in /dev/dri/card* /dev/dri/renderD*; do echo "DRI $d $(stat -c %t:%T $d)"; done; '
              + "; ".join(f'echo "LINK {link} $(readlink {link})"' for _, link in links)
              + '; echo "MODE $(stat -c %a /dev/dri)"')
    p = r.run(script)
    assert p.returncode == 0, p.stderr
    assert "DRI /dev/dri/card1 e2:1" in p.stdout and "DRI /dev/dri/renderD128 e2:80" in p.stdout, p.stdout
    for target, link in links:
        assert f"LINK {link} {target}" in p.stdout, p.stdout
    assert "MODE 755" in p.stdout
    device_hooks = len(dev0.get("hooks") or [])
    assert len(r.events("cdi_hook.done")) == len(r.hooks) + device_hooks
