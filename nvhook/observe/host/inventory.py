"""Observe the host: every driver file and device the host root provides, for all
capabilities and all GPUs.

The file part depends only on the driver install, so it is cached (see cache.py) and only
re-validated with a stat per file on each container start; the GPU list is read from procfs
on every run (a few small files), and NVML facts are added only when a decision needs them.
"""

from __future__ import annotations

import os
import stat

from ...base import catalog
from ...base.errors import HookError
from ...base.rootpath import join, resolve
from ...base.versions import parse_version
from . import ldcache, procfs

LIB_KIND = {"x86_64": "library", "i386": "library32", "aarch64": "library"}
ELF_EXPECT = {"x86_64": (64, "x86_64"), "i386": (32, "i386"), "aarch64": (64, "aarch64")}


def _problem(problems: list, level: str, event: str, **fields) -> None:
    problems.append({"level": level, "event": event, **fields})


def _plain_name(soname: str | None) -> str | None:
    """A SONAME becomes a symlink name in the container: only a plain file name will do (a
    crafted '../../pwn' would otherwise name a path outside the library directory)."""
    if not soname or "/" in soname or soname in (".", "..") or not soname.isprintable():
        return None
    return soname


def _version_from_libraries(entries, root: str) -> str | None:
    for key, path, _arch in entries:
        if key in ("libnvidia-ml.so.1", "libcuda.so.1"):
            real = resolve(root, path)
            if real:
                name = os.path.basename(real)
                stem = key[:-2]  # drop ".1"
                if name.startswith(stem + ".") and name != key:
                    version = name[len(stem) + 1:]
                    try:
                        parse_version(version)
                    except ValueError:
                        continue  # libcuda.so.1.bak is no driver version
                    return version
    return None


def _libraries(root: str, entries, version: str, problems: list) -> list[dict]:
    from . import elf  # pyelftools: only on a cache miss

    out = []
    by_name: dict[tuple[str, str], list] = {}
    for key, path, arch in entries:
        for cap, names in catalog.LIBRARIES.items():
            for name in names:
                if key == name or key.startswith(name + "."):
                    by_name.setdefault((name, arch), []).append((key, path, cap))
    for cap, names in catalog.LIBRARIES.items():
        for name in names:
            found_any = False
            for arch in ("x86_64", "i386", "aarch64"):
                cands = by_name.get((name, arch))
                if not cands:
                    continue
                found_any = True
                chosen = None
                for _key, path, _ in cands:
                    real = resolve(root, path)
                    if real is None:
                        _problem(problems, "warning", "library.skipped", library=name, capability=cap, entry=path,
                                 reason="dangling link or missing file")
                        continue
                    if chosen and real == chosen["path"]:
                        continue  # another cache key (soname, dev link) for the same file
                    fname = os.path.basename(real)
                    if not fname.startswith(name + "."):
                        _problem(problems, "warning", "library.skipped", library=name, capability=cap, entry=path,
                                 file=real,
                                 reason=f"the cache entry leads to another library's file ({fname})")
                        continue
                    if not fname.endswith("." + version):
                        _problem(problems, "warning", "library.skipped", library=name, capability=cap, entry=path,
                                 file=real,
                                 reason=f"file name does not carry the driver version {version}")
                        continue
                    host_path = join(root, real)
                    try:
                        st = os.stat(host_path)
                        if not stat.S_ISREG(st.st_mode):
                            raise ValueError("not a regular file")
                        facts = elf.elf_facts(host_path)
                    except (OSError, ValueError) as e:
                        _problem(problems, "warning", "library.skipped", library=name, capability=cap, file=real,
                                 reason=str(e))
                        continue
                    want = ELF_EXPECT.get(arch)
                    if want and (facts["class"], facts["machine"]) != want:
                        _problem(problems, "warning", "library.skipped", library=name, capability=cap, file=real,
                                 reason=f"ELF {facts['class']}-bit {facts['machine']} does not match the cache "
                                        f"entry ({arch})")
                        continue
                    if chosen:
                        _problem(problems, "info", "library.duplicate", library=name, capability=cap, arch=arch,
                                 chosen=chosen["path"], skipped=real,
                                 reason="an earlier ld.so.cache entry (higher search priority) was chosen")
                        continue
                    chosen = {"name": name, "cap": cap, "arch": arch, "kind": LIB_KIND.get(arch, "library"),
                              "path": real, "source": host_path, "file": fname,
                              "soname": _plain_name(facts["soname"]) or fname}
                if chosen:
                    out.append(chosen)
            if not found_any:
                level = "debug" if name in catalog.OPTIONAL_LIBRARIES else "warning"
                _problem(problems, level, "library.missing", library=name, capability=cap)
    return out


def _binaries(root: str, libraries: list[dict], problems: list) -> list[dict]:
    """Each program from the first of BIN_DIRS that has it, then the `bin` beside the driver's
    library directories (/usr/local/nvidia/lib64 -> /usr/local/nvidia/bin, where a driver
    container or a runfile install keeps them). An ELF program wins over an earlier
    non-ELF file: hosts that keep the driver outside /usr put wrapper scripts in /usr/bin
    (`exec /usr/local/nvidia/bin/nvidia-smi "$@"`, seen on a real H200 host), and the path such
    a wrapper execs is not in the container. A script is still taken where there is nothing
    else (the test fixtures' programs are scripts)."""
    dirs = list(catalog.BIN_DIRS)
    for lib in libraries:
        beside = os.path.dirname(os.path.dirname(lib["path"])) + "/bin"
        if beside not in dirs:
            dirs.append(beside)
    out = []
    for cap, names in catalog.BINARIES.items():
        for name in names:
            script = None
            for d in dirs:
                real = resolve(root, f"{d}/{name}")
                if not real or not os.path.isfile(join(root, real)):
                    continue
                found = {"name": name, "cap": cap, "path": real, "source": join(root, real)}
                if _is_elf(found["source"]):
                    if script is not None:
                        _problem(problems, "info", "binary.wrapper_skipped", binary=name, capability=cap,
                                 skipped=script["path"], chosen=real,
                                 reason="not an ELF program (a wrapper script would exec a path the container "
                                        "does not have): the ELF program found later is mounted instead")
                    out.append(found)
                    break
                if script is None:
                    script = found
            else:
                if script is not None:
                    out.append(script)
                else:
                    level = "debug" if name in catalog.OPTIONAL_BINARIES else "warning"
                    _problem(problems, level, "binary.missing", binary=name, capability=cap)
    return out


def _is_elf(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError:
        return False
    finally:
        os.close(fd)


def _chardev(root: str, path: str) -> dict | None:
    real = resolve(root, path)
    if real is None:
        return None
    try:
        st = os.stat(join(root, real))
    except OSError:
        return None
    if not stat.S_ISCHR(st.st_mode):
        return {"path": path, "error": "not a character device"}
    return {"path": path, "source": join(root, real), "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
            "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid}


def _numbered(dev: dict, major: int | None, minor: int, problems: list) -> bool:
    """A MIG capability or IMEX channel node is the one its name says: channel<N> is the IMEX
    module's minor N, nvidia-cap<N> the caps module's minor N. Anything else there (a link to
    a GPU's node, say) is not handed to a container under that name."""
    if dev["minor"] == minor and (major is None or dev["major"] == major):
        return True
    _problem(problems, "warning", "device.unexpected", device=dev["path"], found=f"{dev['major']}:{dev['minor']}",
             want=f"{major if major is not None else '?'}:{minor}")
    return False


def _devices(root: str, majors: dict, migs: dict, problems: list) -> list[dict]:
    """Control devices and MIG/IMEX capability nodes. GPU nodes come with the GPU list."""
    out = []
    for path, role, gate, absence in catalog.FIXED_DEVICES:
        dev = _chardev(root, path)
        if dev is None:
            # A node behind a capability (modeset: display) concerns only containers asking for it.
            gated = {"capability": gate} if gate in catalog.CAPABILITIES else {}
            _problem(problems, absence, "device.missing", device=path, **gated)
            continue
        if "error" in dev:
            _problem(problems, "warning", "device.invalid", device=path, reason=dev["error"])
            continue
        if role in ("uvm", "uvm-tools") and "nvidia-uvm" in majors and dev["major"] != majors["nvidia-uvm"]:
            _problem(problems, "warning", "device.major_mismatch", device=path, major=dev["major"],
                     proc_devices=majors["nvidia-uvm"])
        dev["role"] = role
        out.append(dev)
    for name, minor in sorted(migs.items(), key=lambda kv: kv[1]):
        path = f"/dev/nvidia-caps/nvidia-cap{minor}"
        dev = _chardev(root, path)
        if dev and "error" not in dev and _numbered(dev, majors.get("nvidia-caps"), minor, problems):
            dev["role"] = "mig-cap"
            dev["cap_name"] = name
            out.append(dev)
    imex_dir = join(root, "/dev/nvidia-caps-imex-channels")
    try:
        channels = sorted(os.listdir(imex_dir), key=lambda n: (len(n), n))
    except OSError:
        channels = []
    for ch in channels:
        dev = _chardev(root, f"/dev/nvidia-caps-imex-channels/{ch}")
        number = ch[len("channel"):]
        minor = int(number) if ch.startswith("channel") and number.isascii() and number.isdigit() else -1
        if dev and "error" not in dev and _numbered(dev, majors.get("nvidia-caps-imex-channels"), minor, problems):
            dev["role"] = "imex"
            out.append(dev)
    return out


def _ipc(root: str, problems: list) -> list[dict]:
    out = []
    for cap, paths in catalog.IPC.items():
        for path in paths:
            real = resolve(root, path)
            if real is None:
                _problem(problems, "debug", "ipc.missing", path=path, capability=cap)
                continue
            st = os.stat(join(root, real))
            if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                _problem(problems, "warning", "ipc.invalid", path=path, reason="neither a socket nor a directory")
                continue
            out.append({"path": path, "source": join(root, real), "cap": cap,
                        "socket": stat.S_ISSOCK(st.st_mode)})
    return out


def _graphics_configs(root: str) -> list[dict]:
    out = []
    for path in catalog.GRAPHICS_CONFIGS:
        real = resolve(root, path)
        if real is not None and os.path.isfile(join(root, real)):
            out.append({"path": path, "source": join(root, real), "cap": "graphics"})
    return out


def _firmware(root: str, version: str, problems: list) -> list[dict]:
    d = catalog.FIRMWARE_DIR.format(version=version)
    real = resolve(root, d)
    if real is None:
        _problem(problems, "debug", "firmware.missing", path=d)
        return []
    out = []
    for name in sorted(os.listdir(join(root, real))):
        if name.startswith("gsp") and name.endswith(".bin") and os.path.isfile(join(root, f"{real}/{name}")):
            out.append({"path": f"{d}/{name}", "source": join(root, f"{real}/{name}")})
    return out


def build_files(root: str) -> dict:
    """Everything that depends only on the driver install (cacheable)."""
    problems: list = []
    cache_path = join(root, "/etc/ld.so.cache")
    try:
        entries = ldcache.read(cache_path)
    except FileNotFoundError:
        raise HookError(f"no ld.so.cache at {cache_path}: is the host root {root!r} right?") from None
    except OSError as e:
        raise HookError(f"cannot read {cache_path}: {e.strerror}") from None
    except ValueError as e:
        raise HookError(f"corrupt ld.so.cache {cache_path}: {e}") from None

    version = procfs.driver_version(root)
    version_source = "procfs"
    if version is None:
        version = _version_from_libraries(entries, root)
        version_source = "library file names"
        if version is None:
            raise HookError(f"cannot tell the host driver version: {join(root, procfs.NVIDIA + '/version')} "
                            "is missing and ld.so.cache lists no libnvidia-ml.so.1 or libcuda.so.1")
        _problem(problems, "warning", "driver.version_guessed", version=version,
                 reason="no /proc/driver/nvidia/version (NVIDIA kernel module not loaded?)")

    majors = procfs.char_majors(root)
    migs = procfs.mig_minors(root)
    proc_files = [n for n in catalog.PROCFS_FILES
                  if os.path.isfile(join(root, f"{procfs.NVIDIA}/{n}"))]
    libraries = _libraries(root, entries, version, problems)
    return {
        "root": root,
        "driver": {"version": version, "source": version_source},
        "libraries": libraries,
        "binaries": _binaries(root, libraries, problems),
        "devices": _devices(root, majors, migs, problems),
        "ipc": _ipc(root, problems),
        "firmware": _firmware(root, version, problems),
        "configs": _graphics_configs(root),
        "procfs": proc_files,
        "mig_minors": migs,
        "problems": problems,
    }


def gpu_devices(root: str, gpus: list[dict], problems: list) -> None:
    """Attach /dev/nvidia<minor> to each GPU (read each run: cheap, and GPUs come and go)."""
    for g in gpus:
        dev = _chardev(root, f"/dev/nvidia{g['minor']}")
        if dev is None or "error" in dev:
            _problem(problems, "warning", "device.missing", device=f"/dev/nvidia{g['minor']}", gpu=g["index"],
                     reason=(dev or {}).get("error", "missing"))
            g["device"] = None
        else:
            g["device"] = dev
