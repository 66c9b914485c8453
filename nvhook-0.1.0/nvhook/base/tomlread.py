"""The TOML reader: the standard library's tomllib from Python 3.11, else tomli, the package
tomllib was made from (the same API and parser), a dependency only on those older Pythons
(pyproject.toml; docs/python-versions.md says why).

Imported only where a TOML file is read: a container start whose config is cached never
imports it (base/config.py)."""

import sys

if sys.version_info >= (3, 11):
    from tomllib import TOMLDecodeError, load, loads
else:
    from tomli import TOMLDecodeError, load, loads

__all__ = ["TOMLDecodeError", "load", "loads"]
