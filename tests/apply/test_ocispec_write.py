"""apply.ocispec.write_atomic: how nvhook-runtime replaces a bundle's config.json (issue 13:
"writes config.json atomically"). Real files in a temp bundle directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvhook.apply import ocispec
from nvhook.base.errors import HookError
from nvhook.base.files import temp_name


def _bundle(tmp_path: Path, mode: int = 0o640) -> tuple[Path, int]:
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"ociVersion": "1.0.2"}\n')
    os.chmod(cfg, mode)
    return cfg, os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)


def test_config_is_replaced_by_rename_with_its_mode(tmp_path):
    cfg, dfd = _bundle(tmp_path)
    before = os.stat(cfg)
    reader = open(cfg, "rb")  # a reader of the old file keeps the old bytes, whole
    try:
        ocispec.write_atomic(dfd, b'{"ociVersion": "1.0.2", "hooks": {}}\n')
    finally:
        os.close(dfd)
    after = os.stat(cfg)
    assert after.st_ino != before.st_ino  # a new file renamed over it, never written in place
    assert after.st_mode & 0o777 == 0o640
    assert cfg.read_bytes() == b'{"ociVersion": "1.0.2", "hooks": {}}\n'
    assert reader.read() == b'{"ociVersion": "1.0.2"}\n'
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temp file left


def test_a_link_planted_at_the_temp_name_is_never_written_through(tmp_path):
    """A link at the temporary name (left, or planted by whoever can write the bundle
    directory): removed, never followed; the config is written."""
    cfg, dfd = _bundle(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    os.symlink(victim, tmp_path / temp_name("config.json"))
    try:
        ocispec.write_atomic(dfd, b"{}")
    finally:
        os.close(dfd)
    assert victim.read_bytes() == b"untouched"
    assert cfg.read_bytes() == b"{}" and oct(os.stat(cfg).st_mode & 0o777) == "0o640"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "victim"]


def test_a_directory_at_the_temp_name_is_one_line_and_the_config_is_kept(tmp_path):
    cfg, dfd = _bundle(tmp_path)
    (tmp_path / temp_name("config.json")).mkdir()
    try:
        with pytest.raises(HookError, match=r"^cannot write bundle config: creating \.config\.json\.nvhook-\d+: "
                                            r"Is a directory$"):
            ocispec.write_atomic(dfd, b"{}")
    finally:
        os.close(dfd)
    assert cfg.read_bytes() == b'{"ociVersion": "1.0.2"}\n'


def test_a_missing_config_is_one_line_and_nothing_is_created(tmp_path):
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(HookError, match=r"^cannot write bundle config config\.json: does not exist$"):
            ocispec.write_atomic(dfd, b"{}")
    finally:
        os.close(dfd)
    assert list(tmp_path.iterdir()) == []
