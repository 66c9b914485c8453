"""Observe the host under a root directory.

The package itself stays empty so that importing one small module (procfs, cache)
does not load the whole inventory machinery; `nvhook.observe.host.observe`, `add_nvml` and
`BRAND_NAMES` are the entry points, loaded on first use.
"""

_PUBLIC = ("observe", "add_nvml", "BRAND_NAMES")


def __getattr__(name: str):
    if name in _PUBLIC:
        from . import discover

        return getattr(discover, name)
    raise AttributeError(f"module 'nvhook.observe.host' has no attribute {name!r}")
