"""The core stays free of torch: every module outside the torch layers imports without it.

Checked in a fresh interpreter (this one may have torch loaded by other tests), over the
package as it is on disk, so a new core module is covered the day it is added.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import zbsearch

_TORCH_LAYERS = ("distributed", "models", "profiler", "runtime", "app")


def _core_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(zbsearch.__path__, "zbsearch.")]
    return [n for n in names if n.split(".")[1] not in _TORCH_LAYERS and n != "zbsearch.__main__"]


def test_core_modules_never_import_torch():
    core = _core_modules()
    assert {"zbsearch.simulator", "zbsearch.solver.solve", "zbsearch.compare", "zbsearch.formats.schedule"} <= set(core)
    probe = (f"import importlib, sys\nfor n in {core!r}: importlib.import_module(n)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_every_core_module_imports_first():
    # a user's first import may be any module: each top-level one (a sub-package imports its
    # modules), imported first into a fresh package (the zbsearch modules dropped between
    # imports), must not meet a circular import
    core = [n for n in _core_modules() if n.count(".") == 1]
    assert {"zbsearch.bounds", "zbsearch.clock", "zbsearch.reduction_times", "zbsearch.solver"} <= set(core)
    probe = (f"import importlib, sys\nfor n in {core!r}:\n"
             "    for k in [k for k in sys.modules if k.split('.')[0] == 'zbsearch']: del sys.modules[k]\n"
             "    try:\n        importlib.import_module(n)\n"
             "    except ImportError as e:\n        print(n, e)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "", r.stdout


def test_a_torch_layer_is_seen_to_import_torch():
    # the probe can fail: the runtime does load torch
    r = subprocess.run([sys.executable, "-c", "import sys, zbsearch.runtime.runtime; print('torch' in sys.modules)"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "True"
