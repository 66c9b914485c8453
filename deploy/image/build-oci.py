"""Build the DaemonSet's image (deploy/kubernetes/daemonset.yaml) from local files, no registry:
an OCI image archive that `podman load -i` and `ctr -n k8s.io images import` take.

    python deploy/image/build-oci.py OUT.tar [--tag localhost/nvhook-node:VERSION] [--python /usr/bin/python3]

Run it with the interpreter whose nvhook it should carry (the project's venv, or an install of
the wheel): the image gets that nvhook and its pure-Python dependencies in /opt/nvhook, laid out
as `nvhook node install` lays them out on a node (its own code, nvhook.commands.nodehost.wanted_tree),
with launchers run by the image's python3. The image's python3 is --python of this machine: the
binary, the shared libraries it and its extension modules load, and its standard library (less
tests, IDLE, Tk). Plus chroot(8), which node install runs to act as the node. One layer, every
file owned by root with time 0, so the same inputs give the same image digest.

Containerfile beside this script builds an equivalent image with podman/docker from a registry's
python base, where one is reachable.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

SKIP_STDLIB = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "__pycache__",
               "site-packages", "dist-packages"}
CHROOT = "/usr/sbin/chroot"


def shared_libs(binary: str) -> set[str]:
    """What the dynamic loader maps for `binary` (ldd), the loader itself included."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
    libs = set()
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0] if parts else ""
        if path.startswith("/"):
            libs.add(path)
    return libs


def python_files(python: str) -> dict[str, str]:
    """image path -> this machine's path, for the interpreter and its standard library."""
    info = json.loads(subprocess.run(
        [python, "-I", "-c", "import json, sys, sysconfig; print(json.dumps({'exe': sys.executable, "
         "'stdlib': sysconfig.get_paths()['stdlib'], 'dynload': sysconfig.get_config_var('DESTSHARED'), "
         "'version': '%d.%d' % sys.version_info[:2]}))"], capture_output=True, text=True, check=True).stdout)
    exe = os.path.realpath(info["exe"])
    files = {exe: exe, "/usr/bin/python3": exe}
    binaries = [exe, CHROOT]
    for top in (info["stdlib"], info["dynload"]):
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_STDLIB and not d.startswith("config-"))
            for fn in sorted(filenames):
                p = os.path.join(dirpath, fn)
                if os.path.isfile(p):
                    files[p] = p
                    if fn.endswith(".so"):
                        binaries.append(p)
    files[CHROOT] = CHROOT
    for b in binaries:
        for lib in shared_libs(b):
            files[lib] = os.path.realpath(lib)
    return files


def layer(python: str) -> bytes:
    from nvhook.commands.nodehost import INSTALL_DIR, wanted_tree

    buf = io.BytesIO()
    dirs: set[str] = set()

    def add_dirs(path: str, tar: tarfile.TarFile) -> None:
        parent = os.path.dirname(path)
        if parent in ("/", "") or parent in dirs:
            return
        add_dirs(parent, tar)
        dirs.add(parent)
        info = tarfile.TarInfo(parent.lstrip("/"))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
        tar.addfile(info)

    def add_file(path: str, data: bytes, mode: int, tar: tarfile.TarFile) -> None:
        add_dirs(path, tar)
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode, info.mtime = len(data), mode, 0
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        entries: dict[str, tuple[bytes, int]] = {}
        for image_path, src in python_files(python).items():
            with open(src, "rb") as f:
                entries[image_path] = (f.read(), os.stat(src).st_mode & 0o777)
        for rel, (data, mode) in wanted_tree("/usr/bin/python3").items():
            entries[f"{INSTALL_DIR}/{rel}"] = (data, mode)
        # the usual merged-/usr links, so that the loader's /lib64 path and /bin resolve
        for link in ("/lib", "/lib64", "/bin", "/sbin"):
            entries = {(k.replace(link + "/", "/usr" + link + "/", 1) if k.startswith(link + "/") else k): v
                       for k, v in entries.items()}
        for path in sorted(entries):
            add_file(path, *entries[path], tar)
        for link, target in (("lib", "usr/lib"), ("lib64", "usr/lib64"), ("bin", "usr/bin"), ("sbin", "usr/sbin")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname, info.mode, info.mtime = tarfile.SYMTYPE, target, 0o777, 0
            tar.addfile(info)
        for d in ("tmp", "host", "proc", "dev", "sys", "run", "etc"):
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755, 0
            tar.addfile(info)
    return buf.getvalue()


def blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    import nvhook

    # the tag deploy/kubernetes's DaemonSets name: the version of the nvhook the image carries
    tag = f"localhost/nvhook-node:{nvhook.__version__}"
    ap.add_argument("--tag", default=tag, help=f"the image's name [default: {tag}]")
    ap.add_argument("--python", default="/usr/bin/python3", help="the interpreter the image runs nvhook with")
    args = ap.parse_args()

    raw = layer(args.python)
    diff_id = "sha256:" + hashlib.sha256(raw).hexdigest()
    layer_digest, layer_gz = blob(gzip.compress(raw, mtime=0))
    config = {"architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine),
              "os": "linux",
              "config": {"Env": ["PATH=/opt/nvhook/bin:/usr/sbin:/usr/bin", "LC_ALL=C.UTF-8"],
                         "Cmd": ["nvhook", "--help"],
                         "Labels": {"org.opencontainers.image.title": "nvhook-node",
                                    "org.opencontainers.image.version": nvhook.__version__}},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]},
              "history": [{"created_by": "deploy/image/build-oci.py"}]}
    config_digest, config_json = blob(json.dumps(config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest,
                           "size": len(config_json)},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest,
                            "size": len(layer_gz)}]}
    manifest_digest, manifest_json = blob(json.dumps(manifest, sort_keys=True).encode())
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest,
                            "size": len(manifest_json),
                            "annotations": {"org.opencontainers.image.ref.name": args.tag,
                                            "io.containerd.image.name": args.tag}}]}
    with tarfile.open(args.out, "w", format=tarfile.PAX_FORMAT) as tar:
        def put(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))

        put("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        put("index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in ((layer_digest, layer_gz), (config_digest, config_json), (manifest_digest, manifest_json)):
            put(f"blobs/sha256/{digest.split(':')[1]}", data)
    print(f"{args.out}: {args.tag} ({len(layer_gz) >> 20} MiB, {manifest_digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
