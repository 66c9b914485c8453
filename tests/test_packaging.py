"""What an operator installs (issue 15): the wheel carries the default config, the hooks file,
the tmpfiles and logrotate entries and the license, with the metadata pip shows; the sdist can
run the tests; `make deb` lays nvhook out without a venv and the unpacked package runs; a second
`make demo` only prints the plan."""

from __future__ import annotations

import email
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from waiting import cpu_seconds

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import cdihookbox  # noqa: E402


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("nvhook-*.whl")
    return whl


def test_wheel_carries_data_license_and_urls(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert z.read("nvhook/data/hook.toml") == (REPO / "config/hook.toml").read_bytes()
        assert z.read("nvhook/data/nvhook.json") == (REPO / "oci-hooks.d/nvhook.json").read_bytes()
        assert b"d /run/nvhook 0700 root root" in z.read("nvhook/data/tmpfiles.conf")
        assert b"/var/log/nvhook.log" in z.read("nvhook/data/logrotate")
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
        lic = next(n for n in names if n.endswith("dist-info/licenses/LICENSE"))
        assert z.read(lic) == (REPO / "LICENSE").read_bytes()
    assert b"Apache License" in (REPO / "LICENSE").read_bytes()[:200]
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Summary"] and meta["Requires-Python"] == ">=3.9"  # docs/python-versions.md
    # the TOML reader: tomllib from 3.11, its backport before
    assert any(r.startswith("tomli") and 'python_version < "3.11"' in r for r in meta.get_all("Requires-Dist"))
    # launchers, not console-script wrappers (they would import re on the start path)
    assert {"nvhook-0.1.0.data/scripts/nvhook", "nvhook-0.1.0.data/scripts/nvhook-runtime",
            "nvhook-0.1.0.data/scripts/nvidia-cdi-hook"} <= set(names)
    # nvidia-cdi-hook: the shell first stage naming the set-group-ID copies `nvhook setup` makes in
    # /usr/local/lib/nvhook (before that, a #! the kernel cannot find: nothing runs), never a
    # script of the venv's dynamically linked python (issue 35 item 5)
    with zipfile.ZipFile(wheel) as z:
        hook = z.read("nvhook-0.1.0.data/scripts/nvidia-cdi-hook").decode()
        assert z.read("nvhook/data/nvidia-cdi-hook.py") == (REPO / "bin/nvidia-cdi-hook").read_bytes()
    from nvhook.commands.hookstages import setup_first_stage

    assert hook == setup_first_stage() == (REPO / "packaging/wheel/nvidia-cdi-hook").read_text()
    assert hook.startswith("#!/usr/local/lib/nvhook/libexec/sh\n")


def test_sdist_can_run_the_tests(tmp_path):
    out = tmp_path / "sdist"
    proc = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (sd,) = out.glob("nvhook-*.tar.gz")
    with tarfile.open(sd) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for want in ("Makefile", "LICENSE", ".ci/run", ".ci/deps", "tests/conftest.py", "tests/fixtures/make_fixtures.py",
                 "tests/e2e/runcbox.py", "config/hook.toml", "oci-hooks.d/nvhook.json", "packaging/build-deb",
                 "README.md", "docs/troubleshooting.md", "tests/test_docs.py"):
        assert want in names, want
    assert not [n for n in names if n.startswith("tests/fixtures/rootfs/host-")]


NO_DEB = not shutil.which("dpkg-deb") or not shutil.which("fakeroot")


@pytest.fixture(scope="module")
def deb(wheel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deb")
    proc = subprocess.run([str(REPO / "packaging/build-deb"), str(wheel), str(out)], capture_output=True,
                          text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("nvhook_*_all.deb")
    return path


def _no_gpu_state(bundle: Path) -> str:
    """The OCI state runc hands a prestart hook, for a bundle whose container asks for no GPU."""
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                                    "process": {"env": ["PATH=/bin"]}}))
    return json.dumps({"ociVersion": "1.0.2", "id": "deb", "status": "created", "pid": os.getpid(),
                       "bundle": str(bundle)})


def find_python(version: str) -> str | None:
    """pyenv's build of Python `version` (X.Y), else pythonX.Y on PATH (as .ci/test-pythons)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for p in [*sorted(root.glob(f"{version}.*/bin/python{version}")), shutil.which(f"python{version}")]:
        if p and os.access(p, os.X_OK):
            return str(p)
    return None


@pytest.mark.skipif(NO_DEB, reason="dpkg-deb/fakeroot missing")
def test_deb_layout_and_the_unpacked_package_runs(deb, tmp_path, fixtures_root):
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True).stdout
    paths = {line.split()[-1].lstrip(".") for line in listing.splitlines()}
    for want in ("/usr/bin/nvhook", "/usr/bin/nvhook-runtime", "/usr/bin/nvhookd", "/usr/lib/nvhook/nvhook/start/hook.py",
                 "/usr/lib/systemd/system/nvhookd.socket", "/usr/lib/systemd/system/nvhookd.service",
                 "/usr/lib/systemd/system/nvhook-cdi.service", "/usr/lib/systemd/system/nvhook-cdi.path",
                 "/usr/lib/systemd/system/nvhook-cdi.timer", "/usr/lib/systemd/system/nvhook-nri.service",
                 "/usr/lib/nvhook/click/__init__.py", "/etc/nvhook/hook.toml",
                 "/usr/share/containers/oci/hooks.d/nvhook.json", "/usr/lib/tmpfiles.d/nvhook.conf",
                 "/etc/logrotate.d/nvhook", "/usr/share/doc/nvhook/copyright", "/usr/share/doc/nvhook/README.md",
                 "/usr/share/doc/nvhook/docs/troubleshooting.md", "/usr/share/man/man1/nvhook.1.gz",
                 "/usr/lib/udev/rules.d/71-nvhook-dev-char.rules"):
        assert want in paths, want
    docs = {p.rsplit("/", 1)[1] for p in paths if p.startswith("/usr/share/doc/nvhook/docs/")} - {""}
    assert docs == {p.name for p in (REPO / "docs").glob("*.md")}
    assert not [p for p in paths if "/venv" in p or p.startswith("/usr/local")]
    info = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    assert "Architecture: all" in info and "Depends: python3 (>= 3.9)\n" in info
    # byte-compiled files and the start-path bundle are per Python: postinst writes them with
    # the node's python3 (libexec/byte-compile), prerm removes them
    assert not [p for p in paths if p.endswith((".pyc", ".bundle"))]
    assert "/usr/lib/nvhook/tomli/_parser.py" in paths  # for python3 < 3.11, whatever built the package
    conffiles = subprocess.run(["dpkg-deb", "-I", str(deb), "conffiles"], capture_output=True, text=True).stdout
    assert conffiles.split() == ["/etc/nvhook/hook.toml", "/etc/logrotate.d/nvhook"]
    root = tmp_path / "unpacked"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    subprocess.run([str(root / "usr/lib/nvhook/libexec/byte-compile"), sys.executable], check=True)
    with gzip.open(root / "usr/share/man/man1/nvhook.1.gz", "rt") as f:
        # the packaged commands' own (their click is the one resolved for python3 3.9)
        assert f.read() == _manpage(str(root / "usr/lib/nvhook")), "the packaged man page is not the commands'"
    # the udev rule README recommends, as it recommends it (docs/device-cgroups.md)
    rule = (root / "usr/lib/udev/rules.d/71-nvhook-dev-char.rules").read_text()
    assert 'RUN+="/usr/bin/nvhook system create-dev-char-links"' in rule
    hooks = json.loads((root / "usr/share/containers/oci/hooks.d/nvhook.json").read_text())
    assert hooks["hook"]["path"] == "/usr/bin/nvhook"
    v = subprocess.run([str(root / "usr/bin/nvhook"), "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("nvhook, version"), v.stderr
    conf = tmp_path / "hook.toml"  # caches in tmp_path, not the host's /run/nvhook
    conf.write_text(f'cache_dir = "{tmp_path / "cache"}"\nlog_file = ""\n')
    plan = subprocess.run([str(root / "usr/bin/nvhook"), "--config", str(conf),
                           "--root", str(fixtures_root / "host-gpu8"), "--dry-run",
                           "--bundle", str(fixtures_root / "bundle-container-debian"), "--format", "json"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert plan.returncode == 0 and json.loads(plan.stdout)["mounts"], plan.stderr
    # The launchers run the system interpreter isolated and without `site` (-IS), as bin/nvhook
    # does; the units name the package's launchers, not /usr/local.
    for name in ("nvhook", "nvhook-runtime", "nvhookd"):
        assert (root / "usr/bin" / name).read_text().startswith("#!/usr/bin/python3 -IS\n"), name
    for unit in (root / "usr/lib/systemd/system").iterdir():
        text = unit.read_text()
        assert "/usr/local" not in text, unit.name
    assert "ExecStart=/usr/bin/nvhookd\n" in (root / "usr/lib/systemd/system/nvhookd.service").read_text()
    # nvhook's modules come from the package's start-path bundle (python -v names the loader)
    bundles = list((root / "usr/lib/nvhook/nvhook/__pycache__").glob("modbundle.*.bundle"))
    assert len(bundles) == 1
    first = (root / "usr/bin/nvhook").read_text().split("\n", 1)[0][2:].split()
    v = subprocess.run([first[0], "-v", *first[1:], str(root / "usr/bin/nvhook"), "--version"], capture_output=True,
                       text=True)
    assert v.returncode == 0, v.stderr[-2000:]
    if f".{sys.implementation.cache_tag}." in bundles[0].name and sys.version_info[:2] == (3, 11):
        assert "import 'nvhook.start.client' # <nvhook.base.modbundle.Finder" in v.stderr
    # nvidia-cdi-hook: off PATH (never shadows NVIDIA's package); the shell first stage, its #!
    # the setgid copy of /bin/sh that postinst makes, handing what it does not end itself to
    # the python stage under the setgid copy of python3 (docs/cdi-hook.md); the python stage
    # run here with the plain interpreter.
    assert "/usr/bin/nvidia-cdi-hook" not in paths and "/usr/lib/nvhook/bin/nvidia-cdi-hook" in paths
    cdi_hook = (root / "usr/lib/nvhook/bin/nvidia-cdi-hook").read_text()
    assert cdi_hook == cdihookbox.render_shell_stage("/usr/lib/nvhook/libexec/sh", "/usr/lib/nvhook/libexec/python3",
                                                     "/usr/lib/nvhook/libexec/nvidia-cdi-hook.py", "/run/nvhook/cdi-hook")
    assert cdi_hook.startswith("#!/usr/lib/nvhook/libexec/sh\n") and "@" not in cdi_hook.replace('"$@"', "")
    assert subprocess.run(["sh", "-n", str(root / "usr/lib/nvhook/bin/nvidia-cdi-hook")]).returncode == 0
    stage2 = root / "usr/lib/nvhook/libexec/nvidia-cdi-hook.py"
    assert stage2.read_text().startswith("#!/usr/lib/nvhook/libexec/python3 -IS\n")
    v = subprocess.run([sys.executable, "-IS", str(stage2), "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("nvidia-cdi-hook (nvhook) version"), v.stderr
    scripts = {n: subprocess.run(["dpkg-deb", "-I", str(deb), n], capture_output=True, text=True).stdout
               for n in ("postinst", "prerm", "postrm", "triggers")}
    # the group and the copies' mode from hookgroup (a refused group fails postinst with its line);
    # no package script ever deletes the group (docs/security.md)
    assert 'chmod "$mode"' in scripts["postinst"] and "got=$(/usr/bin/python3 -IS /usr/lib/nvhook/libexec/hook-group)" \
        in scripts["postinst"]
    assert "from nvhook.commands import hookgroup" in (root / "usr/lib/nvhook/libexec/hook-group").read_text()
    code = [ln for n in scripts for ln in scripts[n].splitlines() if not ln.lstrip().startswith("#")]
    assert not [ln for ln in code if any(w in ln for w in ("groupdel", "delgroup", "addgroup", "groupadd"))]
    assert "setgid_copy /usr/bin/python3 /usr/lib/nvhook/libexec/python3" in scripts["postinst"]
    assert "setgid_copy /bin/sh /usr/lib/nvhook/libexec/sh" in scripts["postinst"]
    assert "/usr/lib/nvhook/libexec/byte-compile /usr/bin/python3" in scripts["postinst"]
    assert "-name __pycache__" in scripts["prerm"]
    assert "/usr/lib/nvhook/libexec/sh " in scripts["postrm"] and "/run/nvhook/cdi-hook" in scripts["postrm"]
    assert scripts["triggers"].split() == ["interest-noawait", "/usr/bin", "interest-noawait", "/bin"]
    d = subprocess.run([str(root / "usr/bin/nvhookd"), "--help"], capture_output=True, text=True)
    assert d.returncode == 0 and d.stdout.startswith("usage: nvhookd"), d.stderr
    # Hook mode through the package's launcher: a container that asks for no GPU starts (exit
    # 0, nothing on stderr) and its decision is logged.
    log = tmp_path / "hook.jsonl"
    conf.write_text(f'cache_dir = "{tmp_path / "cache"}"\nlog_file = "{log}"\n[daemon]\nmode = "off"\n')
    state = _no_gpu_state(tmp_path / "bundle")
    h = subprocess.run([str(root / "usr/bin/nvhook"), "--config", str(conf), "prestart"], input=state,
                       capture_output=True, text=True)
    assert h.returncode == 0 and h.stderr == "", h.stderr
    done = [json.loads(x) for x in log.read_text().splitlines() if '"hook.done"' in x]
    assert done and done[-1]["reason"] == "not a GPU container: NVIDIA_VISIBLE_DEVICES is not set"


@pytest.mark.skipif(NO_DEB, reason="dpkg-deb/fakeroot missing")
@pytest.mark.parametrize("version", ["3.9", "3.10", "3.12", "3.13"])
def test_the_deb_runs_on_each_python3(deb, version, tmp_path, fixtures_root):
    """The package's files as postinst leaves them on a distribution whose python3 is
    `version` (Debian 11 and RHEL 9's 3.9, Ubuntu 22.04's 3.10, Ubuntu 24.04's 3.12, Debian
    13's 3.13): byte-compile with that Python, then the launchers run by it as their #! runs
    them (-IS): every dependency resolved for it (click 8.1 on 3.9), tomli where tomllib is
    missing, the modules served from that Python's bundle. tests/node/test_deb.py installs the
    package with dpkg on Debian 13."""
    py = find_python(version)
    if py is None:
        pytest.skip(f"no Python {version} (pyenv or python{version} on PATH; .ci/deps pythons)")
    root = tmp_path / "root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    subprocess.run([str(root / "usr/lib/nvhook/libexec/byte-compile"), py], check=True)
    tag = subprocess.run([py, "-c", "import sys; print(sys.implementation.cache_tag)"], capture_output=True,
                         text=True, check=True).stdout.strip()
    lib = root / "usr/lib/nvhook"
    assert {p.name for p in lib.glob("nvhook/__pycache__/modbundle.*.bundle")} == {f"modbundle.{tag}.bundle"}
    assert {p.name.split(".")[-2] for p in lib.rglob("*.pyc")} == {tag}
    launcher = str(root / "usr/bin/nvhook")
    v = subprocess.run([py, "-IS", "-v", launcher, "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("nvhook, version"), v.stderr[-3000:]
    assert "import 'nvhook.start.client' # <nvhook.base.modbundle.Finder" in v.stderr
    conf = tmp_path / "hook.toml"  # read by tomllib, or by the bundled tomli before 3.11
    conf.write_text(f'cache_dir = "{tmp_path / "cache"}"\nlog_file = ""\n')
    plan = subprocess.run([py, "-IS", launcher, "--config", str(conf), "--root", str(fixtures_root / "host-gpu8"),
                           "--dry-run", "--bundle", str(fixtures_root / "bundle-container-debian"), "--format", "json"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert plan.returncode == 0 and json.loads(plan.stdout)["mounts"], plan.stderr
    toml = subprocess.run([py, "-IS", "-c", "import sys; sys.path.insert(0, sys.argv[1]); from nvhook.base import "
                           "tomlread; print(tomlread.loads.__module__)", str(lib)], capture_output=True, text=True)
    assert toml.stdout.strip() == ("tomli._parser" if version in ("3.9", "3.10") else "tomllib._parser"), toml.stderr
    # a hook started as runc starts it: a container without a GPU request starts
    state = _no_gpu_state(tmp_path / "bundle")
    h = subprocess.run([py, "-IS", launcher, "--config", str(conf), "--root", str(fixtures_root / "host-gpu8"),
                        "prestart"], input=state, capture_output=True, text=True)
    assert h.returncode == 0 and h.stderr == "", h.stderr


def test_second_make_demo_only_prints_the_plan(tmp_path):
    stamp = REPO / ".venv/.nvhook-installed"
    if not stamp.exists() or stamp.stat().st_mtime < (REPO / "pyproject.toml").stat().st_mtime:
        pytest.skip("the venv was not made by `make` (or pyproject.toml changed since)")
    # the demo's nvhook reads NVHOOK_CONFIG: caches in tmp_path, not the host's /run/nvhook
    (tmp_path / "hook.toml").write_text(f'cache_dir = "{tmp_path / "cache"}"\nlog_file = ""\n')
    env = dict(os.environ, NVHOOK_CONFIG=str(tmp_path / "hook.toml"))
    subprocess.run(["make", "-s", "demo"], cwd=REPO, capture_output=True, text=True, env=env)  # settles the stamps
    with cpu_seconds(children=True) as took:  # make and what it ran; wall time would measure the machine
        p = subprocess.run(["make", "demo"], cwd=REPO, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert "pip install" not in p.stdout and "make_fixtures" not in p.stdout, p.stdout
    assert "nvhook plan for container bundle-container-debian" in p.stdout
    assert "Warning" not in p.stderr and "!!" not in p.stderr
    assert took.seconds < 10, f"a second make demo took {took.seconds:.1f} s of CPU"


def _manpage(lib: str = "") -> str:
    """nvhook(1) as packaging/manpage.py makes it from the commands in `lib` (the venv's: "")."""
    proc = subprocess.run([sys.executable, "-B", str(REPO / "packaging/manpage.py"), lib, _version()],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("nvhook")


def test_manpage_names_every_command_and_option():
    """nvhook(1) is written from the click commands: each command and each of its options is in
    it, and groff reads it without a warning."""
    import click

    from nvhook.commands.cli import cli

    page = _manpage().replace("\\-", "-")
    missing = []

    def walk(cmd, path):
        for p in cmd.params:
            if isinstance(p, click.Option) and p.name != "help":
                missing.extend(f"{path} {o}" for o in p.opts if o not in page)
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                if f'.SS "{path} {name}"' not in page:
                    missing.append(f"{path} {name}")
                walk(sub, f"{path} {name}")

    walk(cli, "nvhook")
    assert not missing, missing
    if shutil.which("groff"):
        proc = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z"], input=_manpage(), capture_output=True,
                              text=True)
        assert proc.returncode == 0 and not proc.stderr, proc.stderr

