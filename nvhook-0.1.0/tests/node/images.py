"""Container images for the node, built from local files (no registry is reachable): an OCI
image layout archive per image, one uncompressed layer made from a directory, ready for
`ctr -n k8s.io images import`.

- PAUSE: the pod sandbox image, one static binary (src/pause.c); containerd's sandbox_image is
  set to it so no pull is ever attempted.
- DEBIAN: the fixture image container-debian (tests/fixtures/make_fixtures.py: busybox, the
  host's glibc and ldconfig, cuda-probe), the image the e2e tests already use.
- CUDA113: container-cuda113 (CUDA 11.3 forward-compat libcuda in the image).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures"))

import make_fixtures as mf  # noqa: E402

PAUSE = "nvhook.test/pause:3.10"
DEBIAN = "nvhook.test/debian:12"
CUDA113 = "nvhook.test/cuda:11.3"
FIXTURE_IMAGES = {DEBIAN: "container-debian", CUDA113: "container-cuda113"}


def _layer_tar(src: Path) -> bytes:
    """The directory as a layer: every entry owned by root, in a stable order, times kept."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = Path(dirpath) / name
                info = tar.gettarinfo(str(full), arcname=str(full.relative_to(src)))
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _blob(blobs: dict, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def oci_archive(rootfs: Path, ref: str, out: Path, *, entrypoint: list[str] | None = None,
                cmd: list[str] | None = None, env: list[str] | None = None) -> Path:
    """Write `out`: an OCI image layout tar of one image named `ref` (annotation
    io.containerd.image.name, which `ctr images import` names the image by)."""
    blobs: dict[str, bytes] = {}
    layer = _layer_tar(rootfs)
    layer_desc = _blob(blobs, layer, "application/vnd.oci.image.layer.v1.tar")
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                         **({"Entrypoint": entrypoint} if entrypoint else {}), **({"Cmd": cmd} if cmd else {})},
              "rootfs": {"type": "layers", "diff_ids": [layer_desc["digest"]]},
              "history": [{"created_by": "nvhook tests/node/images.py"}]}
    config_desc = _blob(blobs, json.dumps(config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    man_desc = _blob(blobs, json.dumps(manifest, sort_keys=True).encode(), "application/vnd.oci.image.manifest.v1+json")
    man_desc["platform"] = {"architecture": "amd64", "os": "linux"}
    man_desc["annotations"] = {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [man_desc]}
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        add("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add("index.json", json.dumps(index).encode())
        for digest, data in blobs.items():
            add(f"blobs/sha256/{digest.split(':', 1)[1]}", data)
    return out


def build_pause(work: Path) -> Path:
    root = work / "pause-rootfs"
    # The sandbox's root is mounted read-only from the start: the runtime cannot create the
    # mount points it needs there, so the image carries them.
    for d in ("dev", "proc", "sys", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "etc/resolv.conf").write_text("")
    (root / "etc/hostname").write_text("")
    (root / "etc/hosts").write_text("")
    subprocess.run(["gcc", "-static", "-O2", "-s", "-o", str(root / "pause"), str(HERE / "src/pause.c")],
                   check=True, capture_output=True, timeout=120)
    return oci_archive(root, PAUSE, work / "pause.tar", entrypoint=["/pause"])


def build_all(work: Path) -> dict[str, Path]:
    """{image ref: archive} for every image the node imports, built under `work`."""
    work.mkdir(parents=True, exist_ok=True)
    out = {PAUSE: build_pause(work)}
    for ref, name in FIXTURE_IMAGES.items():
        rootfs = mf.build_container(name, work / "rootfs")
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *mf.CONTAINERS[name].env]
        out[ref] = oci_archive(rootfs, ref, work / f"{name}.tar", cmd=["/bin/sh"], env=env)
    return out


def docker_archive(oci_tar: Path, out: Path) -> Path:
    """`oci_tar` (oci_archive's) with a manifest.json added: Docker 26's own image store (no
    containerd snapshotter) loads only that layout, podman loads either, the blobs are shared."""
    with tarfile.open(oci_tar) as tar:
        members = {}
        for m in tar.getmembers():
            f = tar.extractfile(m) if m.isfile() else None
            if f is not None:
                members[m.name] = f.read()
    entries = []
    for desc in json.loads(members["index.json"])["manifests"]:
        manifest = json.loads(members["blobs/sha256/" + desc["digest"].split(":", 1)[1]])
        entries.append({"Config": "blobs/sha256/" + manifest["config"]["digest"].split(":", 1)[1],
                        "RepoTags": [desc["annotations"]["io.containerd.image.name"]],
                        "Layers": ["blobs/sha256/" + layer["digest"].split(":", 1)[1]
                                   for layer in manifest["layers"]]})
    members["manifest.json"] = json.dumps(entries).encode()
    with tarfile.open(out, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out
