"""`nvhook config import` and `nvhook config check` on a hostile config.toml (one handed over
with a node to migrate): nesting deeper than any parser's stack, NVIDIA's tables written as
numbers. Each is one line naming the file or the key (exit 1 where nothing can be read, else the
import goes on), never a traceback's "internal error"."""

from __future__ import annotations

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
