"""What an operator meets at a terminal (issue 15): `config check` / `config default`, `setup`,
doctor's verdicts and exit codes, the CLI's options wherever they are typed, a terminal or
Ctrl-C in hook mode, completion, NO_COLOR, and interactive commands that keep out of the
production log. The installed console script runs in a subprocess, as users run it."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest
from hostfix import (
    NVHOOK,
    assert_one_line_error,
    bundle,
    config_check,
    events,
    nvhook,
    private_dir,
    scratch_config,
    write_config,
)
from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fx(fixtures_root) -> Path:
    """The fixture hosts and images, read only here (caches and logs go to tmp paths)."""
    return fixtures_root


@pytest.fixture(scope="module")
def conf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("opcfg")
    return scratch_config(d)


# --- config check / default ---------------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("log_level = 3\n", "log_level must be a string, not number 3"),
    ("[nvml]\ntimeout = \"5\"\n", "nvml.timeout must be a number, not string '5'"),
    ("[nvml]\nenabled = 1\n", "nvml.enabled must be true or false, not number 1"),
    ("devices = 1\n", "devices must be a table ([devices]), not number 1"),
    ("log_file = \"nvhook.log\"\n", "log_file must be an absolute path, not 'nvhook.log'"),
    ("cache_dir = \"run/nvhook\"\n", "cache_dir must be an absolute path"),
    ("root = \".\"\n", "root must be an absolute path"),
    ("[ldconfig]\npath = \"@sbin/ldconfig\"\n", "ldconfig.path must be an absolute path"),
    ("[runtime]\npath = \"./runc\"\n", "runtime.path must be an absolute path"),
])
def test_config_check_names_the_problem(tmp_path, text, needle):
    f = tmp_path / "hook.toml"
    assert_one_line_error(config_check(f, text), 1, str(f), needle)


def test_config_check_accepts_good_files_and_reads_nvhook_config(tmp_path):
    f = tmp_path / "hook.toml"
    p = config_check(f, 'log_file = ""\n[runtime]\npath = "crun"\n[ldconfig]\npath = "@/sbin/ldconfig"\n')
    assert p.returncode == 0 and p.stdout.startswith(f"{f}: ok"), p.stderr
    p = nvhook("config", "check", "--format", "json", env={"NVHOOK_CONFIG": str(f)})
    assert p.returncode == 0 and json.loads(p.stdout)["config"]["runtime"]["path"] == "crun"


def test_config_default_is_the_shipped_file_and_valid(tmp_path):
    p = nvhook("config", "default")
    assert p.returncode == 0 and p.stdout == (REPO / "config/hook.toml").read_text()
    assert config_check(tmp_path / "default.toml", p.stdout).returncode == 0


# --- setup ---------------------------------------------------------------------------------------

def test_setup_installs_idempotently_and_uninstalls(tmp_path):
    pfx = tmp_path / "root"
    p = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/opt/nvhook/bin/nvhook")
    assert p.returncode == 0, p.stderr
    want = {"etc/nvhook/hook.toml", "etc/containers/oci/hooks.d/nvhook.json", "etc/tmpfiles.d/nvhook.conf",
            "etc/logrotate.d/nvhook"}
    assert {str(x.relative_to(pfx)) for x in pfx.rglob("*") if x.is_file()} == want
    assert [ln.split()[0] for ln in p.stdout.splitlines()] == ["created"] * 4
    assert (pfx / "etc/nvhook/hook.toml").read_text() == (REPO / "config/hook.toml").read_text()
    hooks = json.loads((pfx / "etc/containers/oci/hooks.d/nvhook.json").read_text())
    assert hooks["hook"]["path"] == "/opt/nvhook/bin/nvhook"
    assert "NVHOOK_CONFIG=/etc/nvhook/hook.toml" in hooks["hook"]["env"]
    assert "d /run/nvhook 0700 root root -" in (pfx / "etc/tmpfiles.d/nvhook.conf").read_text()
    assert "/var/log/nvhook.log {" in (pfx / "etc/logrotate.d/nvhook").read_text()
    # again: nothing changes
    again = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/opt/nvhook/bin/nvhook")
    assert [ln.split()[0] for ln in again.stdout.splitlines()] == ["unchanged"] * 4
    # the operator's config is theirs: kept by setup and by --uninstall
    (pfx / "etc/nvhook/hook.toml").write_text('log_level = "debug"\n')
    again = nvhook("setup", "--prefix", str(pfx), "--hook-path", "/opt/nvhook/bin/nvhook")
    assert "kept (yours)" in again.stdout and (pfx / "etc/nvhook/hook.toml").read_text() == 'log_level = "debug"\n'
    gone = nvhook("setup", "--prefix", str(pfx), "--uninstall")
    assert gone.returncode == 0, gone.stderr
    assert {str(x.relative_to(pfx)) for x in pfx.rglob("*") if x.is_file()} == {"etc/nvhook/hook.toml"}
    assert "kept (changed by you)" in gone.stdout


def test_setup_registers_the_interpreter_with_the_flags_pip_dropped(tmp_path):
    """pip writes `#!/venv/bin/python` over bin/nvhook's `#!python -IS`: the hooks file `nvhook
    setup` writes then names the interpreter with -IS and the launcher, and a hook run the way
    that file says runs without `site` (its import log). A launcher that keeps its own flags
    (the Debian package's) or is not nvhook's is registered as it is."""
    launcher = Path(NVHOOK[0])
    py = launcher.with_name("python")
    assert launcher.read_text().startswith(f"#!{py}\n"), "a launcher as pip installs it"
    pfx = tmp_path / "root"
    p = nvhook("setup", "--prefix", str(pfx), "--hook-path", str(launcher))
    assert p.returncode == 0, p.stderr
    hook = json.loads((pfx / "etc/containers/oci/hooks.d/nvhook.json").read_text())["hook"]
    assert hook["path"] == str(py) and hook["args"] == [str(py), "-IS", str(launcher), "prestart"]
    # run it as the runtime would (path, args, env; the state on stdin): a no-GPU container
    log = tmp_path / "hook.jsonl"
    (tmp_path / "c.toml").write_text(f'log_file = "{log}"\ncache_dir = "{tmp_path / "cache"}"\n'
                                     '[daemon]\nmode = "off"\n')
    b = tmp_path / "bundle"
    (b / "rootfs").mkdir(parents=True)
    (b / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "root": {"path": "rootfs"},
                                               "process": {"env": ["PATH=/bin"]}}))
    env = [e for e in hook["env"] if not e.startswith("NVHOOK_CONFIG=")] + [f"NVHOOK_CONFIG={tmp_path / 'c.toml'}"]
    r = subprocess.run([hook["args"][0], "-X", "importtime", *hook["args"][1:]], executable=hook["path"],
                       input=json.dumps({"ociVersion": "1.0.2", "id": "s", "status": "created", "pid": os.getpid(),
                                         "bundle": str(b)}),
                       env=dict(e.split("=", 1) for e in env), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    imported = {ln.split("|")[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert "nvhook.start.hook" in imported and "site" not in imported
    assert '"hook.done"' in log.read_text()
    # a launcher with its own flags, and a script that is not nvhook's launcher: as they are
    for first, body in (("#!/usr/bin/python3 -IS", "# nvhook's launcher"), (f"#!{py}", "# someone's wrapper")):
        other = tmp_path / "bin" / "nvhook"
        other.parent.mkdir(exist_ok=True)
        other.write_text(f"{first}\n{body}\n")
        other.chmod(0o755)
        p = nvhook("setup", "--prefix", str(tmp_path / "r2"), "--hook-path", str(other))
        hook = json.loads((tmp_path / "r2/etc/containers/oci/hooks.d/nvhook.json").read_text())["hook"]
        assert hook["path"] == str(other) and hook["args"] == ["nvhook", "prestart"], first


# --- doctor ----------------------------------------------------------------------------------------

def _ctr(tmp_path: Path, fx: Path, name: str, *env: str) -> Path:
    return bundle(tmp_path / name, fx / "container-debian", env)


def test_doctor_agrees_with_the_hook_on_requirements_and_legacy_images(fx, conf, tmp_path):
    host = str(fx / "host-gpu8")  # driver 535: CUDA 12.2
    for name, env in (("legacy", ("CUDA_VERSION=12.4.1",)),
                      ("require", ("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE_CUDA=cuda>=13.0"))):
        b = _ctr(tmp_path, fx, name, *env)
        dry = nvhook("--config", str(conf), "--root", host, "--dry-run", "--bundle", str(b))
        hook_line = dry.stderr.splitlines()[-1]  # after the warnings a person sees
        assert dry.returncode == 1 and hook_line.startswith("nvhook: unsatisfied requirement"), dry.stderr
        doc = nvhook("--config", str(conf), "--root", host, "doctor", "--bundle", str(b))
        assert doc.returncode == 3, (doc.stdout, doc.stderr)
        assert f"refuses the container: {hook_line}" in doc.stdout
        assert "CUDA should work" not in doc.stdout
        rep = json.loads(nvhook("--config", str(conf), "--root", host, "doctor", "--bundle", str(b),
                                "--format", "json").stdout)
        assert f"nvhook: {rep['refused']}" == hook_line


def test_doctor_reports_the_start_path_bundle(fx, conf, tmp_path):
    """doctor says whether container starts load nvhook's modules from the start-path bundle
    (a few ms of every start), and how to rewrite it when it is missing or stale."""
    w = subprocess.run([str(Path(NVHOOK[0]).with_name("python")), "-I", "-m", "nvhook.base.modbundle"],
                       capture_output=True, text=True, timeout=60)
    assert w.returncode == 0, w.stderr
    args = ("--config", str(conf), "--root", str(fx / "host-gpu8"), "doctor", "--bundle")
    p = nvhook(*args, str(_ctr(tmp_path, fx, "sp")), "--format", "json")
    sp = json.loads(p.stdout)["startpath"]
    assert sp["state"] == "current" and sp["modules"] > 40 and sp["bundle"] == w.stdout.split()[1].rstrip(":")
    t = nvhook(*args, str(_ctr(tmp_path, fx, "sp2", "NVIDIA_VISIBLE_DEVICES=0")))
    assert f"Start path      nvhook's {sp['modules']} modules load from {sp['bundle']}" in t.stdout


def test_doctor_for_a_container_without_gpu(fx, conf, tmp_path):
    b = _ctr(tmp_path, fx, "plain")
    doc = nvhook("--config", str(conf), "--root", str(fx / "host-gpu8"), "doctor", "--bundle", str(b))
    assert doc.returncode == 0, doc.stderr
    assert "libcuda" not in doc.stdout and "Host driver" not in doc.stdout
    assert "nvhook injects nothing: not a GPU container" in doc.stdout


def test_doctor_checks_the_bundle_before_the_host(fx, conf, tmp_path):
    p = nvhook("--config", str(conf), "--root", str(tmp_path / "no-host"), "doctor", "--bundle", str(tmp_path / "nope"))
    assert_one_line_error(p, 1, "cannot read bundle config", str(tmp_path / "nope"))


def test_doctor_exit_4_when_cuda_will_fail(fx, conf, tmp_path):
    """Forced forward compat on a GeForce: the container starts, CUDA fails with 804."""
    b = bundle(tmp_path / "b", fx / "container-cuda113", ("NVIDIA_VISIBLE_DEVICES=0", "NVHOOK_COMPAT_MODE=image",
                                                           "CUDA_VERSION=11.3.1", "NVIDIA_DISABLE_REQUIRE=true"))
    doc = nvhook("--config", str(conf), "--root", str(fx / "host-geforce-460"), "doctor", "--bundle", str(b))
    assert doc.returncode == 4, (doc.stdout, doc.stderr)
    assert "error 804" in doc.stdout


def test_doctor_states_where_the_cuda_version_came_from(fx, tmp_path):
    """Without NVML the CUDA version is nvhook's release table's, and doctor does not credit NVML."""
    cfg = write_config(tmp_path / "hook.toml", cache_dir=private_dir(tmp_path / "c"), extra="[nvml]\nenabled = false\n")
    b = _ctr(tmp_path, fx, "gpu", "NVIDIA_VISIBLE_DEVICES=0")
    doc = nvhook("--config", str(cfg), "--root", str(fx / "host-gpu8"), "doctor", "--bundle", str(b))
    assert "by nvhook's release table" in doc.stdout and "NVML" not in doc.stdout.split("\n")[0]


# --- the CLI at a terminal -----------------------------------------------------------------------

def _on_pty(args: list[str], env: dict | None = None, timeout: float = 20) -> tuple[int, str]:
    """Run nvhook with stdin, stdout and stderr on a pseudo-terminal, as a person at a shell."""
    master, slave = pty.openpty()
    e = dict(os.environ, **(env or {}))
    e.pop("NVHOOK_CONFIG", None)
    proc = subprocess.Popen([*NVHOOK, *args], stdin=slave, stdout=slave, stderr=slave, env=e, close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        raise AssertionError(f"nvhook {args} still running after {timeout}s: {out!r}")
    os.close(master)
    return proc.wait(timeout=5), out.decode(errors="replace")


# --log-file '': no log (the default one is the machine's /var/log/nvhook.log)
@pytest.mark.parametrize("args", [["--log-file", ""], ["prestart", "--log-file", ""], ["createRuntime", "--log-file", ""]])
def test_hook_mode_refuses_a_terminal(args):
    code, out = _on_pty(args)
    assert code == 1, out
    assert "stdin is a terminal" in out and "--dry-run --bundle DIR" in out and "Traceback" not in out


@pytest.mark.parametrize("args", [["prestart", "--log-file", ""], ["--dry-run"]])
def test_ctrl_c_is_one_line(args):
    # A shell's background job starts with SIGINT ignored, and Python keeps an ignored SIGINT
    # ignored: as a person's terminal would, the child gets the default disposition back.
    proc = subprocess.Popen([*NVHOOK, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_until(lambda: proc.poll() is not None or _reading_stdin(proc.pid),
               "nvhook blocked reading the OCI state on stdin", show=lambda: _where(proc.pid))
    assert proc.poll() is None, f"nvhook ended before reading stdin: {proc.returncode} {proc.communicate()}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and err == "nvhook: interrupted\n", err


def _where(pid: int) -> str:
    """What the process is doing instead (a failure of the wait above says it)."""
    out = []
    for name in ("syscall", "wchan", "stack"):
        try:
            out.append(f"{name}: {Path(f'/proc/{pid}/{name}').read_text().strip()}")
        except OSError as e:
            out.append(f"{name}: {e.strerror}")
    return "; ".join(out)


def _reading_stdin(pid: int) -> bool:
    """In read(0, ...): the system call number and first argument of /proc/PID/syscall."""
    return Path(f"/proc/{pid}/syscall").read_text().split()[:2] == ["0", "0x0"]


def test_shell_completion():
    env = {"_NVHOOK_COMPLETE": "bash_source"}
    p = nvhook(env=env)
    assert p.returncode == 0 and "complete " in p.stdout and "_nvhook_completion" in p.stdout, p.stderr
    p = nvhook(env={"_NVHOOK_COMPLETE": "bash_complete", "COMP_WORDS": "nvhook do", "COMP_CWORD": "1"})
    assert "doctor" in p.stdout


def test_global_options_after_the_subcommand(fx, conf):
    host = str(fx / "host-gpu8")
    before = nvhook("--config", str(conf), "--root", host, "--format", "json", "info")
    after = nvhook("info", "--root", host, "--config", str(conf), "--format", "json")
    assert before.returncode == after.returncode == 0, (before.stderr, after.stderr)
    assert json.loads(before.stdout) == json.loads(after.stdout)
    # a subcommand without such an option says where it goes
    p = nvhook("runtime", "configure", "--runtime", "docker", "--dry-run", "--root", host)
    assert_one_line_error(p, 2, "--root", "before the subcommand")


def test_stage_help():
    for stage in ("prestart", "createRuntime"):
        p = nvhook(stage, "--help")
        assert p.returncode == 0 and p.stdout.startswith(f"Usage: nvhook {stage}"), p.stderr


def test_no_color(fx, conf):
    args = ["--config", str(conf), "--root", str(fx / "host-gpu8"), "--log-level", "debug", "list"]
    _, colored = _on_pty(args)
    _, plain = _on_pty(args, env={"NO_COLOR": "1"})
    assert "\x1b[" in colored and "\x1b[" not in plain


def test_interactive_commands_stay_out_of_the_production_log(fx, tmp_path):
    log = tmp_path / "production.log"
    cfg = write_config(tmp_path / "hook.toml", cache_dir=private_dir(tmp_path / "c"), log_file=str(log))
    b = _ctr(tmp_path, fx, "gpu", "NVIDIA_VISIBLE_DEVICES=0")
    host = str(fx / "host-gpu8")
    for args in (["--dry-run", "--bundle", str(b)], ["info"], ["list"], ["doctor", "--bundle", str(b)]):
        p = nvhook("--config", str(cfg), "--root", host, *args)
        assert p.returncode == 0, p.stderr
    assert not log.exists()
    asked = tmp_path / "asked.log"
    nvhook("--config", str(cfg), "--root", host, "--log-file", str(asked), "--dry-run", "--bundle", str(b))
    evs = events(asked)
    assert evs and all(e["interactive"] is True and e["container"] == "gpu" and e["message"] for e in evs)


def test_guessed_brand_is_shown_as_a_guess(fx, tmp_path):
    cfg = write_config(tmp_path / "hook.toml", cache_dir=private_dir(tmp_path / "c"), extra="[nvml]\nenabled = false\n")
    b = _ctr(tmp_path, fx, "gpu", "NVIDIA_VISIBLE_DEVICES=6")  # host-gpu8's GPU 6: a GeForce RTX 4090
    p = nvhook("--config", str(cfg), "--root", str(fx / "host-gpu8"), "--dry-run", "--bundle", str(b),
               "--format", "json")
    (g,) = json.loads(p.stdout)["gpus"]
    assert (g["brand"], g["brand_source"]) == ("geforce", "guessed")
    text = nvhook("--config", str(cfg), "--root", str(fx / "host-gpu8"), "--dry-run", "--bundle", str(b)).stdout
    (row,) = [line for line in text.splitlines() if g["uuid"] in line]
    assert " geforce* " in row
    assert "  * brand guessed from the model name (NVML was not asked)" in text.splitlines()


# --- the config cache stays out of the host's /run/nvhook ---------------------------------------

def test_tests_keep_the_config_cache_out_of_run_nvhook(fx, conf):
    from nvhook.base import config

    assert os.environ["NVHOOK_RUN_DIR"] != "/run/nvhook"
    p = nvhook("--config", str(conf), "--root", str(fx / "host-gpu1"), "info")
    assert p.returncode == 0, p.stderr
    name = config.cache_file_name("config", str(conf))
    assert (Path(os.environ["NVHOOK_RUN_DIR"]) / name).exists()
    assert not (Path("/run/nvhook") / name).exists()


# --- journald (opt-in) ---------------------------------------------------------------------------

def _journal_fields(datagram: bytes) -> dict:
    """Parse journald's native protocol (both the NAME=value and the binary form)."""
    out, i = {}, 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        head = datagram[i:nl]
        if b"=" in head:
            k, v = head.split(b"=", 1)
            out[k.decode()] = v.decode()
            i = nl + 1
        else:
            n = int.from_bytes(datagram[nl + 1:nl + 9], "little")
            out[head.decode()] = datagram[nl + 9:nl + 9 + n].decode()
            i = nl + 9 + n + 1
    return out


def test_journal_entries(tmp_path, monkeypatch):
    import socket

    from nvhook.base import log as log_mod

    path = str(tmp_path / "journal.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    monkeypatch.setattr(log_mod, "JOURNAL_SOCKET", path)
    ev = log_mod.EventLog("info", None)
    ev.journal = True
    ev.bind(container="ctr-1")
    ev.info("library.missing", library="libnvcuvid.so", capability="video")
    ev.error("hook.failed", error="unknown device '9'\nsecond line")
    ev.debug("mount.done", target="/x")  # below the level: not sent
    ev.flush()
    assert ev.write_error is None
    server.settimeout(2)
    got = [_journal_fields(server.recv(65536)) for _ in range(2)]
    server.close()
    assert got[0]["MESSAGE"] == "libnvcuvid.so (video) is not on the host"
    assert got[0]["PRIORITY"] == "6" and got[0]["SYSLOG_IDENTIFIER"] == "nvhook"
    assert got[0]["NVHOOK_EVENT"] == "library.missing" and got[0]["NVHOOK_CONTAINER"] == "ctr-1"
    assert json.loads(got[0]["NVHOOK_JSON"])["library"] == "libnvcuvid.so"
    assert got[1]["PRIORITY"] == "3" and got[1]["MESSAGE"] == "container refused: unknown device '9'?second line"


def test_journal_unreachable_is_reported_not_fatal(tmp_path, monkeypatch):
    from nvhook.base import log as log_mod

    monkeypatch.setattr(log_mod, "JOURNAL_SOCKET", str(tmp_path / "absent.sock"))
    ev = log_mod.EventLog("info", str(tmp_path / "file.log"))
    ev.journal = True
    ev.info("hook.start", stage="prestart", root="/", nvhook_version="0")
    ev.flush()
    assert ev.write_error.startswith("cannot write to the journal")
    assert (tmp_path / "file.log").read_text().count("\n") == 1  # the file still gets the events

