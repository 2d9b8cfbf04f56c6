"""A package's names loaded on first use (PEP 562): a package whose `__init__` re-exports names
from heavy modules lets a light module of it (a table of defaults, a dataclass) be imported
without importing torch and the rest. The pytest plugin reads such modules at every start."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, homes: dict[str, tuple[str, ...]]):
    """`(__getattr__, __dir__, __all__)` for `package`, where `homes` maps each submodule to the
    names it exports; a name is imported from its submodule on first access, then cached."""
    module_of = {name: module for module, names in homes.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__, sorted(module_of)
