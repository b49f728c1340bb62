"""Package names that load on first use (PEP 562), for ``zbsearch``, ``zbsearch.runtime`` and
``zbsearch.distributed``.

Importing any of them then costs nothing until a name is used: the command line can catch
Ctrl-C from its first instant, and torch loads only when the runtime is used. Each package
keeps its own ``__getattr__`` (so type checkers see the hook) and calls ``load``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["load"]


def load(package: str, sources: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``sources[name]`` (relative to ``package``, e.g. '.costs'),
    kept in the package's namespace so later lookups do not come here."""
    if name not in sources:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(sources[name], package), name)
    vars(sys.modules[package])[name] = value
    return value
