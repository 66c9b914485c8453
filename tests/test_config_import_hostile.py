"""`nvhook config import` and `nvhook config check` on a hostile config.toml (one handed over
with a node to migrate): nesting deeper than any parser's stack, NVIDIA's tables written as
numbers. Each is one line naming the file or the key (exit 1 where nothing can be read, else the
import goes on), never a traceback's "internal error"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvhook.base import config, tomlread


def nvhook_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("nvhook")
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("text", [
    "x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n",
    "disable-require = " + "[" * 3000 + "]" * 3000 + "\n",
], ids=["inline-tables", "arrays"])
def test_nesting_too_deep_to_parse_is_one_line(tmp_path, text):
    src = tmp_path / "config.toml"
    src.write_text(text)
    for args in (("config", "import"), ("config", "check")):
        p = nvhook_cli(*args, str(src))
        assert p.returncode == 1 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
        assert "internal error" not in p.stderr and f"{src} is not valid TOML: RecursionError" in p.stderr, p.stderr


@pytest.mark.parametrize("parts", [900, 5000])
def test_dotted_keys_nested_past_any_of_nvidia_s_are_one_key_left_out(tmp_path, parts):
    """Thousands of tables deep in dotted keys parse fine: the key is named (its first 9 parts),
    the rest of the file is imported. (Python 3.9 and 3.10 have no tomllib: nvhook's own reader
    takes keys of up to 1000 parts and refuses a longer one in one line.)"""
    src = tmp_path / "config.toml"
    src.write_text("a" + ".a" * (parts - 1) + " = 1\ndisable-require = true\n")
    p = nvhook_cli("config", "import", str(src))
    if parts > 1000 and sys.version_info < (3, 11):
        assert p.returncode == 1 and len(p.stderr.splitlines()) == 1, p.stderr
        assert p.stderr.endswith("is not valid TOML: RecursionError: TOML key has more than the allowed 1000 "
                                 "parts\n"), p.stderr
        return
    assert p.returncode == 0, p.stderr
    assert p.stderr == "nvhook: a.a.a.a.a.a.a.a.a: not carried over: not a key of NVIDIA's config.toml (1.17 to 1.20)\n"
    assert tomlread.loads(p.stdout)["request"] == {"disable_require": True}
    check = nvhook_cli("config", "check", str(src))
    assert check.returncode == 1 and "internal error" not in check.stderr and len(check.stderr.splitlines()) == 1


@pytest.mark.parametrize("text", [
    "nvidia-container-runtime = 5\ndisable-require = true\n",
    "features = 5\nnvidia-container-runtime = 5\ndisable-require = true\n",
    "[nvidia-container-runtime]\nmodes = 5\n[features]\nallow-cuda-compat-libs-from-container = true\n",
], ids=["runtime-table-a-number", "both-tables-numbers", "modes-a-number"])
def test_nvidia_s_tables_written_as_numbers_are_left_out_and_the_rest_imported(tmp_path, text):
    src = tmp_path / "config.toml"
    src.write_text(text)
    p = nvhook_cli("config", "import", str(src))
    assert p.returncode == 0 and "internal error" not in p.stderr, p.stderr
    got = config.merge(tomlread.loads(p.stdout), "imported")
    if "disable-require" in text:
        assert got["request"]["disable_require"] is True
    else:
        assert got["compat"]["mode"] == "auto"
    assert all(": not carried over: " in line for line in p.stderr.splitlines()), p.stderr


def _not_a_file(tmp_path: Path, kind: str) -> Path:
    """A config path naming a FIFO (no writer ever comes), a link to /dev/zero (endless) or a
    file over the 1 MiB a config may have."""
    p = tmp_path / f"{kind}.toml"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "zero":
        p.symlink_to("/dev/zero")
    else:
        with open(p, "wb") as f:
            f.truncate(2 << 20)
    return p


NOT_A_FILE = {"fifo": "is a FIFO, not a regular file: name nvhook's TOML config, a regular file",
              "zero": "(-> /dev/zero) is a character device, not a regular file: name nvhook's TOML config",
              "huge": "is 2097152 bytes long, more than a config's 1 MiB: is it nvhook's config?"}


@pytest.mark.parametrize("kind", sorted(NOT_A_FILE))
def test_a_config_that_is_no_regular_file_is_one_line_never_a_wait(tmp_path, kind):
    """Every command that reads nvhook's config (or NVIDIA's): one line naming the file, what
    it is and the fix, exit 1 (`nvhook nri`: EX_CONFIG), at once: the timeout is the failure."""
    src = _not_a_file(tmp_path, kind)
    for args in (("config", "check", str(src)), ("config", "set", "--config", str(src), "log_level=debug"),
                 ("--config", str(src), "info"), ("--config", str(src), "nri")):
        p = nvhook_cli(*args)
        assert p.returncode == (78 if args[-1] == "nri" else 1), (args, p.stderr)
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and f"config {src} " in lines[0] and NOT_A_FILE[kind] in lines[0], (args, p.stderr)
    if kind != "huge":  # NVIDIA's config.toml has no size bound of nvhook's
        p = nvhook_cli("config", "import", str(src))
        assert p.returncode == 1 and p.stderr.splitlines() == [
            f"nvhook: {src}{' (-> /dev/zero)' if kind == 'zero' else ''} "
            f"is a {'FIFO' if kind == 'fifo' else 'character device'}, not a regular file: "
            "name NVIDIA's config.toml (nvhook config import FILE)"], p.stderr
    assert (src.is_fifo() if kind == "fifo" else True) and not (tmp_path / f".{src.name}.tmp").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="nvhookd runs as root")
def test_nvhookd_with_a_fifo_as_config_says_so_and_exits(tmp_path):
    src = _not_a_file(tmp_path, "fifo")
    exe = Path(sys.executable).with_name("nvhookd")
    p = subprocess.run([str(exe), "--config", str(src), "--log-file", str(tmp_path / "d.jsonl"),
                        "--socket", str(tmp_path / "d.sock")], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and p.stderr == (f"nvhookd: config {src} {NOT_A_FILE['fifo']} "
                                              "(`nvhook config default` prints one)\n"), p.stderr


def test_runtime_wrapper_passes_through_with_a_fifo_as_config(tmp_path):
    """nvhook-runtime reads `[runtime] path` from the config on every call the engine makes: a
    FIFO there is no runtime path (runc), not a call that never returns."""
    src = _not_a_file(tmp_path, "fifo")
    exe = Path(sys.executable).with_name("nvhook-runtime")
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_RUNTIME"}
    env["NVHOOK_CONFIG"] = str(src)
    p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=30, env=env)
    runc = subprocess.run(["runc", "--version"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.endswith("(nvhook's OCI runtime wrapper; the real runtime: runc)\n"
                                                   + runc.stdout), (p.stdout, p.stderr)


def test_the_commands_own_piped_stdin_is_read_a_planted_fifo_is_not(tmp_path):
    """`nvhook config default | nvhook config check /dev/stdin` (what CI and operators pipe) is
    read to its end; so is NVIDIA's config piped into `config import /dev/stdin`. A FIFO at a
    path is still refused (test above): only this process's own standard input is a pipe it
    reads. A start path never reads its stdin as config: the hook's stdin is the OCI state."""
    exe = str(Path(sys.executable).with_name("nvhook"))
    env = {k: v for k, v in os.environ.items() if k != "NVHOOK_CONFIG"}

    def piped(text: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, *args], input=text, capture_output=True, text=True, timeout=60, env=env)

    p = piped(f'root = "{tmp_path / "nowhere"}"\nlog_level = "debug"\n', "config", "check", "/dev/stdin")
    assert p.returncode == 0 and p.stdout == "/dev/stdin: ok (1 warning)\n", p
    assert f"(root in /dev/stdin): {tmp_path / 'nowhere'} does not exist" in p.stderr, p.stderr  # read twice, same bytes
    p = piped("log_level = 3\n", "config", "check", "/dev/stdin")
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "log_level" in p.stderr, p
    p = piped('[nvidia-container-cli]\ndebug = "/var/log/x.log"\n', "config", "import", "/dev/stdin")
    assert p.returncode == 0, p
    state = json.dumps({"ociVersion": "1.0.2", "id": "x", "status": "creating", "pid": 1, "bundle": str(tmp_path)})
    p = piped(state, "--config", "/dev/stdin", "info")
    assert p.returncode == 1 and "is a FIFO, not a regular file" in p.stderr, p
