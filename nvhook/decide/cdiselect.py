"""Which devices a CDI spec holds: `cdi generate --device-id ID... [--no-all-device]`, as
nvidia-ctk 1.19 has them. Pure: no I/O; decide.cdimodel builds the devices chosen here.
"""

from __future__ import annotations

# `--device-id none` (nvidia-ctk 1.19's): one device of that name that gives no GPU, only the
# spec-wide edits (NVIDIA_VISIBLE_DEVICES=none's container); CDI refuses a device without
# edits, so it carries this variable, empty.
NONE_DEVICE_ENV = "NVHOOK_CDI_NO_GPU="


def _tokens_by_id(inv: dict) -> dict[str, str]:
    """Every id `--device-id` takes (lower case) -> the request token of its device: a GPU's
    index, a MIG device's UUID (the token cdimodel.device_names pairs with each device)."""
    tokens = {str(g["index"]): str(g["index"]) for g in inv["gpus"]}
    tokens.update({g["uuid"].lower(): str(g["index"]) for g in inv["gpus"] if g.get("uuid")})
    for g in inv["gpus"]:
        for m in g.get("migs") or []:
            tokens[f"{g['index']}:{m['index']}"] = tokens[m["uuid"].lower()] = m["uuid"]
    return tokens


def chosen_devices(inv: dict, named: list[tuple[list[str], str]], device_ids: tuple[str, ...] = ("all",),
                   all_device: bool = True) -> list[tuple[list[str], list[str]]]:
    """The devices of `named` (cdimodel.device_names: ([names], token) each, `all` last) that
    the spec holds, each as (names, the request tokens it selects): only those with the ids in
    `device_ids` (GPU index or UUID, `<gpu>:<mig>`, MIG UUID) and an `all` that selects just
    them; `all` among the ids: every device; `none`: no device and no `all` (the caller writes
    its one `none` device). `all_device` False: no `all`. An id that names no device raises
    ValueError with the line to show."""
    if "none" in device_ids:
        return []
    every = [(names, [token]) for names, token in named if token != "all"]
    if "all" not in device_ids:
        tokens = _tokens_by_id(inv)
        wanted = []
        for ident in device_ids:
            if ident.lower() not in tokens:
                raise ValueError(f"--device-id {ident!r} names no device on this host (GPU indexes "
                                 f"0-{len(inv['gpus']) - 1}, GPU or MIG UUIDs, <gpu>:<mig>)")
            wanted.append(tokens[ident.lower()])
        every = [d for d in every if d[1][0] in wanted]
    if all_device and every:
        every.append((["all"], ["all"] if "all" in device_ids else [t for _, ts in every for t in ts]))
    return every
