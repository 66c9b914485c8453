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
from ...base.rootpath import FACT_ERRNOS, is_fact, join, listing, resolve
from ...base.versions import parse_version
from . import ldcache, procfs

LIB_KIND = {"x86_64": "library", "i386": "library32", "aarch64": "library"}
ELF_EXPECT = {"x86_64": (64, "x86_64"), "i386": (32, "i386"), "aarch64": (64, "aarch64")}


def _problem(problems: list, level: str, event: str, **fields) -> None:
    problems.append({"level": level, "event": event, **fields})


class Inputs:
    """Everything a scan of the host root looked at, for the cache stamp (cache.py): the
    identity of each entry on each path it resolved (links followed, alternatives included,
    directories crossed, the entries it skipped, the lookups that failed), the listings of the
    directories whose contents it used; and `unsure`, what it could not look at for reasons
    that are no fact about the driver (no /proc, EMFILE, EACCES), which keeps the result out
    of the cache."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.seen: dict[str, list] = {}
        self.listings: dict[str, list] = {}
        self.unsure: list[str] = []

    def resolve(self, path: str) -> str | None:
        return resolve(self.root, path, self.seen)

    def listdir(self, inside: str) -> list[str]:
        host = join(self.root, inside)
        seen = self.listings[host] = listing(host)
        if seen[0] == "error":
            if not is_fact(seen):
                self.unsure.append(f"cannot list {host}: {seen[1]}")
            return []
        return list(seen[1])

    def unsure_lookups(self) -> list[str]:
        return [*self.unsure, *(f"cannot look at {path}: {ident[1]}" for path, ident in self.seen.items()
                                if not is_fact(ident))]


def _plain_name(soname: str | None) -> str | None:
    """A SONAME becomes a symlink name in the container: only a plain file name will do (a
    crafted '../../pwn' would otherwise name a path outside the library directory)."""
    if not soname or "/" in soname or soname in (".", "..") or not soname.isprintable():
        return None
    return soname


def _version_from_libraries(entries, inp: Inputs) -> str | None:
    for key, path, _arch in entries:
        if key in ("libnvidia-ml.so.1", "libcuda.so.1"):
            real = inp.resolve(path)
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


def _libraries(inp: Inputs, entries, version: str, problems: list) -> list[dict]:
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
                other_version = []  # files of another driver version: leftovers of an upgrade
                for _key, path, _ in cands:
                    real = inp.resolve(path)
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
                        other_version.append({"library": name, "capability": cap, "entry": path, "file": real,
                                              "reason": f"file name does not carry the driver version {version}"})
                        continue
                    host_path = join(inp.root, real)
                    try:
                        st = os.stat(host_path)
                        if not stat.S_ISREG(st.st_mode):
                            raise ValueError("not a regular file")
                        facts = elf.elf_facts(host_path)
                    except (OSError, ValueError) as e:
                        if isinstance(e, elf.Unreadable) or (isinstance(e, OSError) and e.errno not in FACT_ERRNOS):
                            inp.unsure.append(f"cannot read {host_path}: {e}")
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
                for skipped in other_version:
                    # Beside this driver's own file, another version's is what a driver upgrade
                    # leaves in ld.so.cache: nothing to act on (info). Alone, the library is
                    # missing for this driver (a warning).
                    _problem(problems, "info" if chosen else "warning", "library.skipped",
                             **dict(skipped, reason=skipped["reason"] + ("; this driver's own file is used"
                                                                         if chosen else "")))
                if chosen:
                    out.append(chosen)
            if not found_any:
                level = "debug" if name in catalog.OPTIONAL_LIBRARIES else "warning"
                _problem(problems, level, "library.missing", library=name, capability=cap)
    return out


def _binaries(inp: Inputs, libraries: list[dict], problems: list) -> list[dict]:
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
                real = inp.resolve(f"{d}/{name}")
                if not real or not os.path.isfile(join(inp.root, real)):
                    continue
                found = {"name": name, "cap": cap, "path": real, "source": join(inp.root, real)}
                if _is_elf(found["source"], inp):
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


def _is_elf(path: str, inp: Inputs) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in FACT_ERRNOS:  # EMFILE, EACCES: not an answer about the file
            inp.unsure.append(f"cannot read {path}: {e.strerror}")
        return False
    try:
        return os.read(fd, 4) == b"\x7fELF"
    except OSError as e:
        inp.unsure.append(f"cannot read {path}: {e.strerror}")
        return False
    finally:
        os.close(fd)


def chardev(root: str, path: str, inp: Inputs | None = None) -> dict | None:
    real = resolve(root, path) if inp is None else inp.resolve(path)
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


def _devices(inp: Inputs, majors: dict, migs: dict, problems: list) -> list[dict]:
    """Control devices and MIG/IMEX capability nodes. GPU nodes come with the GPU list."""
    root = inp.root
    out = []
    for path, role, gate, absence in catalog.FIXED_DEVICES:
        dev = chardev(root, path, inp)
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
        dev = chardev(root, path, inp)
        if dev and "error" not in dev and _numbered(dev, majors.get("nvidia-caps"), minor, problems):
            dev["role"] = "mig-cap"
            dev["cap_name"] = name
            out.append(dev)
    channels = sorted(inp.listdir("/dev/nvidia-caps-imex-channels"), key=lambda n: (len(n), n))
    for ch in channels:
        dev = chardev(root, f"/dev/nvidia-caps-imex-channels/{ch}", inp)
        number = ch[len("channel"):]
        minor = int(number) if ch.startswith("channel") and number.isascii() and number.isdigit() else -1
        if dev and "error" not in dev and _numbered(dev, majors.get("nvidia-caps-imex-channels"), minor, problems):
            dev["role"] = "imex"
            out.append(dev)
    return out


def _ipc(inp: Inputs, problems: list) -> list[dict]:
    root = inp.root
    out = []
    for cap, paths in catalog.IPC.items():
        for path in paths:
            real = inp.resolve(path)
            if real is None:
                _problem(problems, "debug", "ipc.missing", path=path, capability=cap)
                continue
            try:
                st = os.stat(join(root, real))
            except OSError as e:  # gone since it was resolved, or not ours to look at
                inp.unsure.append(f"cannot look at {join(root, real)}: {e.strerror}")
                continue
            if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                _problem(problems, "warning", "ipc.invalid", path=path, reason="neither a socket nor a directory")
                continue
            out.append({"path": path, "source": join(root, real), "cap": cap,
                        "socket": stat.S_ISSOCK(st.st_mode)})
    return out


def _configs(inp: Inputs) -> list[dict]:
    out = []
    for path, cap, _ in catalog.CONFIG_ROWS:
        real = inp.resolve(path)
        if real is not None and os.path.isfile(join(inp.root, real)):
            out.append({"path": path, "source": join(inp.root, real), "cap": cap})
    return out


def _firmware(inp: Inputs, version: str, problems: list) -> list[dict]:
    root = inp.root
    d = catalog.FIRMWARE_DIR.format(version=version)
    real = inp.resolve(d)
    if real is None:
        _problem(problems, "debug", "firmware.missing", path=d)
        return []
    out = []
    for name in sorted(inp.listdir(real)):
        if not (name.startswith("gsp") and name.endswith(".bin")):
            continue
        inside = inp.resolve(f"{real}/{name}")
        if inside is not None and os.path.isfile(join(root, inside)):
            out.append({"path": f"{d}/{name}", "source": join(root, f"{real}/{name}")})
    return out


def build_files(root: str) -> dict:
    """Everything that depends only on the driver install (cacheable). "inputs" is what it was
    read from (the cache's stamp); "incomplete" lists what could not be looked at for reasons
    that are no fact about the driver: such an inventory serves this run only."""
    problems: list = []
    inp = Inputs(root)
    version_line = procfs.version_line(root)
    cache_path = join(root, "/etc/ld.so.cache")
    inp.resolve("/etc/ld.so.cache")
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
        version = _version_from_libraries(entries, inp)
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
    libraries = _libraries(inp, entries, version, problems)
    files = {
        "root": root,
        "driver": {"version": version, "source": version_source},
        "libraries": libraries,
        "binaries": _binaries(inp, libraries, problems),
        "devices": _devices(inp, majors, migs, problems),
        "ipc": _ipc(inp, problems),
        "firmware": _firmware(inp, version, problems),
        "configs": _configs(inp),
        "procfs": proc_files,
        "mig_minors": migs,
        "problems": problems,
    }
    for rel in (procfs.NVIDIA + "/version", "/proc/devices", "/proc/driver/nvidia-caps/mig-minors"):
        why = procfs.unreadable(join(root, rel))
        if why is not None:
            inp.unsure.append(why)
    files["inputs"] = {"entries": inp.seen, "listings": inp.listings, "version_line": version_line}
    files["incomplete"] = inp.unsure_lookups()
    return files


def gpu_devices(root: str, gpus: list[dict], problems: list) -> None:
    """Attach /dev/nvidia<minor> to each GPU (read each run: cheap, and GPUs come and go)."""
    for g in gpus:
        dev = chardev(root, f"/dev/nvidia{g['minor']}")
        if dev is None or "error" in dev:
            _problem(problems, "warning", "device.missing", device=f"/dev/nvidia{g['minor']}", gpu=g["index"],
                     reason=(dev or {}).get("error", "missing"))
            g["device"] = None
        else:
            g["device"] = dev


# The kernel's DRM major (drm_core registers 226 for every DRM driver, nvidia-drm included).
DRM_MAJOR = 226
_DRM_KINDS = (("card", "card"), ("renderD", "render"))  # node name prefix -> by-path suffix


def _drm_name(name: str) -> str | None:
    """The by-path suffix of a DRM node name the kernel gives (card1 -> card, renderD128 ->
    render), None for anything else in the directory (controlD64 of old kernels, a crafted
    name): only such names become paths in the container."""
    for prefix, kind in _DRM_KINDS:
        number = name[len(prefix):]
        if name.startswith(prefix) and number.isascii() and number.isdigit() and len(number) <= 6:
            return kind
    return None


def _sysfs_number(root: str, path: str) -> tuple[int, int] | None:
    text = procfs.read_small(join(root, path))
    major, sep, minor = (text or "").strip().partition(":")
    if sep and major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit() \
            and len(major) <= 10 and len(minor) <= 10:
        return int(major), int(minor)
    return None


def gpu_drm(root: str, gpus: list[dict], problems: list) -> None:
    """Attach each GPU's DRM nodes (/dev/dri/cardN, renderDN) as g["drm"]: the names the kernel
    lists under the GPU's PCI device in sysfs (/sys/bus/pci/devices/<bus id>/drm/, which
    nvidia-drm fills), each the /dev/dri node of that name when its number is the one sysfs
    gives for it (a node under that name that belongs to another device is never handed out),
    with "by_path": /dev/dri/by-path/pci-<bus id>-card|render when the host has that link and it
    leads to the same node. Read under the host root like /proc and /dev; each run, only for
    containers that ask for graphics (GPUs and nvidia-drm come and go).

    No drm directory (nvidia-drm not loaded, or a GPU it does not drive) is common on compute
    hosts: logged at debug level."""
    for g in gpus:
        g["drm"] = []
        bus = g["bus_id"]
        # A bus id from procfs becomes a path: only the PCI address form, no "/" or "..".
        if not bus or "/" in bus or bus.startswith(".") or not bus.isprintable():
            continue
        sys_dir = f"/sys/bus/pci/devices/{bus}/drm"
        real = resolve(root, sys_dir)
        names = listing(join(root, real)) if real is not None else ["error", "ENOENT"]
        if names[0] == "error":
            _problem(problems, "debug", "gpu.drm_missing", gpu=g["index"], bus_id=bus, path=sys_dir,
                     reason=f"{names[1]} (nvidia-drm not loaded?)", capability="graphics")
            continue
        for name in names[1]:
            kind = _drm_name(name)
            if kind is None:
                continue
            node = f"/dev/dri/{name}"
            dev = chardev(root, node)
            if dev is None or "error" in dev:
                _problem(problems, "warning", "device.missing", device=node, gpu=g["index"], capability="graphics",
                         reason=(dev or {}).get("error", f"sysfs lists {name} for {bus}; no node in /dev/dri"))
                continue
            want = _sysfs_number(root, f"{real}/{name}/dev")
            have = (dev["major"], dev["minor"])
            if have != (want or (DRM_MAJOR, have[1])) or have[0] != DRM_MAJOR:
                _problem(problems, "warning", "device.unexpected", device=node, gpu=g["index"],
                         found=f"{have[0]}:{have[1]}",
                         want=f"{want[0]}:{want[1]}" if want else f"{DRM_MAJOR}:?",
                         reason=f"not the DRM node sysfs lists for {bus}; not given to containers")
                continue
            dev["role"] = "drm"
            link = f"/dev/dri/by-path/pci-{bus}-{kind}"
            led = chardev(root, link)
            if led is not None and "error" not in led and (led["major"], led["minor"]) == have:
                dev["by_path"] = link
            g["drm"].append(dev)
