"""Python code for a test's own .proto (the CRI client, the fake NRI runtime), made by
grpcio-tools' protoc the first time a process needs it; nothing generated is committed.

Generated code is for the protobuf runtime that generated it, so there is one directory per
proto, interpreter and protobuf release (each test venv has its own), in the temp directory."""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path


def compiled(proto: Path, tag: str):
    """The module protoc makes of `proto` (<stem>_pb2)."""
    from google.protobuf import __version__ as protobuf_version
    from grpc_tools import protoc

    key = f"{proto.read_bytes()!r}{sys.version_info[:2]}{protobuf_version}".encode()
    out = Path(tempfile.gettempdir()) / f"nvhook-{tag}-{hashlib.sha256(key).hexdigest()[:12]}"
    module = f"{proto.stem}_pb2"
    if not (out / f"{module}.py").exists():
        tmp = Path(tempfile.mkdtemp(prefix=f"nvhook-{tag}-build-"))
        include = Path(protoc.__file__).parent / "_proto"
        rc = protoc.main(["protoc", f"-I{proto.parent}", f"-I{include}", f"--python_out={tmp}", str(proto)])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        try:
            os.rename(tmp, out)
        except OSError:  # another process compiled it meanwhile
            pass
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(out))
