"""The OCI state an nvidia-cdi-hook entry is given and the container root it names, as NVIDIA's
hook reads them (its oci.LoadContainerState and GetContainerRoot)."""

from __future__ import annotations

import os
import sys

# The state carries the spec's annotations, as large as a podman user or a CRI-O pod makes them
# (NVIDIA's hook reads any size): a state cut at 1 MiB failed the container.
MAX_STATE = 64 << 20


class Entry:
    """What every subcommand of one entry works on: the state, the container root (its path and
    an fd on it), nvhook's config and the event log."""

    __slots__ = ("state", "rootfs", "root", "cfg", "log")

    def __init__(self, state: dict, rootfs: str, root, cfg: dict, log):
        self.state = state
        self.rootfs = rootfs
        self.root = root
        self.cfg = cfg
        self.log = log


def read_state(spec: str | None) -> tuple[dict, bytes]:
    """The container state, and its bytes as read: from `--container-spec PATH`, else stdin
    (NVIDIA: empty or "-")."""
    from ...base import jsonfast as json
    from ...base.errors import HookError

    try:
        if spec and spec != "-":
            with open(spec, "rb") as f:
                data = f.read(MAX_STATE + 1)
        else:
            data = sys.stdin.buffer.read(MAX_STATE + 1)
        if len(data) > MAX_STATE:
            raise ValueError(f"more than {MAX_STATE >> 20} MiB")
        state = json.loads(data)
    except (OSError, ValueError) as e:
        raise HookError(f"failed to load container state: {e}") from None
    if not isinstance(state, dict) or not isinstance(state.get("bundle"), str):
        raise HookError("failed to load container state: no bundle in it")
    return state, data


def container_root(state: dict, bundle_spec: dict | None = None) -> str:
    """root.path of the bundle's config.json, joined to the bundle when relative (NVIDIA's
    GetContainerRoot). `bundle_spec`: that config.json when already read (bundle_config)."""
    from ...base.errors import HookError

    bundle = state["bundle"]
    try:
        spec = bundle_config(state) if bundle_spec is None else bundle_spec
        path = spec["root"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise HookError(f"failed to determine container root from bundle {bundle}: {e}") from None
    if not isinstance(path, str) or not path:
        raise HookError(f"failed to determine container root: bundle {bundle} has no root.path")
    root = os.path.normpath(path if path.startswith("/") else os.path.join(bundle, path))
    if root == "/":
        raise HookError("refusing a container root of / (the host's)")
    return root


def bundle_config(state: dict) -> dict:
    """The bundle's config.json (OSError, ValueError as json raises them)."""
    from ...base import jsonfast as json

    with open(os.path.join(state["bundle"], "config.json"), "rb") as f:
        spec = json.loads(f.read())
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    return spec


def open_root(path: str):
    from ...apply.paths import Root
    from ...base.errors import HookError

    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise HookError(f"cannot open the container root {path}: {e.strerror}") from None
    return Root(fd)
