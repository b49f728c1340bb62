"""What ``pyproject.toml`` declares matches what the code imports and what ``constraints.txt`` pins.

A module that imports a distribution the project does not declare works on the machine that
happens to have it (pulled in by some other package) and fails on a fresh install; a pin that
falls outside the declared range makes README's install command fail.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# package modules that belong to an optional extra (everything else in zbsearch/ uses only the base)
EXTRA_MODULES = {"zbsearch/models/hf": "hf"}  # a module, or a package (every file in it)
# folders outside the package: the extras they may use besides the base
# (tests that need the docs extra skip without it, as the site's own checks do)
SUPPORT = {"tests": ("dev", "hf", "docs"), "bench": ("dev", "hf"), "examples": ("hf",), "docs": ("docs",), "cli.py": ()}


def _requirements(extra: str | None) -> list[Requirement]:
    lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def _declared(extras: tuple[str, ...]) -> set[str]:
    return {canonicalize_name(r.name) for e in (None, *extras) for r in _requirements(e)}


def _imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file, at any depth (lazy imports count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _third_party(path: Path, names: set[str]) -> set[str]:
    """The names that are neither the standard library nor first-party (the project's own
    packages, or a module beside the file, as bench/ scripts import each other)."""
    local = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
    first_party = {"zbsearch", "tests", "bench"} | local
    return {n for n in names if n not in sys.stdlib_module_names and n not in first_party}


def _files() -> list[tuple[Path, tuple[str, ...]]]:
    out: list[tuple[Path, tuple[str, ...]]] = []
    for path in sorted((ROOT / "zbsearch").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        extra = next((e for m, e in EXTRA_MODULES.items() if rel == m or rel.startswith(m + "/")), None)
        out.append((path, (extra,) if extra else ()))
    for folder, extras in SUPPORT.items():
        target = ROOT / folder
        paths = [target] if target.is_file() else sorted(target.rglob("*.py")) if target.is_dir() else []
        out += [(p, extras) for p in paths]
    return out


def test_every_imported_distribution_is_declared():
    providers = importlib.metadata.packages_distributions()
    problems = []
    for path, extras in _files():
        declared = _declared(extras)
        for name in sorted(_third_party(path, _imports(path))):
            dists = {canonicalize_name(d) for d in providers.get(name, [])}
            if not dists:
                problems.append(f"{path.relative_to(ROOT)} imports {name!r}, which no installed distribution provides")
            elif not dists & declared:
                where = "base dependencies" + "".join(f" or [{e}]" for e in extras)
                problems.append(f"{path.relative_to(ROOT)} imports {name!r} ({', '.join(sorted(dists))}), "
                                f"not in the {where} of pyproject.toml")
    assert not problems, "\n".join(problems)


def test_every_base_dependency_is_imported_by_the_package():
    providers = importlib.metadata.packages_distributions()
    used = set()
    for path, extras in _files():
        if path.is_relative_to(ROOT / "zbsearch") and not extras:
            for name in _third_party(path, _imports(path)):
                used |= {canonicalize_name(d) for d in providers.get(name, [])}
    unused = _declared(()) - used
    assert not unused, f"base dependencies no package module imports: {sorted(unused)}"


def test_the_extras_modules_exist():
    for module, extra in EXTRA_MODULES.items():
        assert (ROOT / module).exists() and extra in PROJECT["optional-dependencies"], module


def _pins() -> dict[str, tuple[str, Requirement]]:
    """constraints.txt's pins that apply to this Python: name -> (version, the line)."""
    env = default_environment()
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = re.sub(r"#.*", "", line).strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            (spec,) = req.specifier
            assert spec.operator == "==", line
            assert canonicalize_name(req.name) not in pins, f"two pins for {req.name} on this Python"
            pins[canonicalize_name(req.name)] = (spec.version, req)
    return pins


def test_constraints_pin_every_dependency_inside_its_declared_range():
    pins = _pins()
    env = default_environment()
    assert "torch" not in pins, "constraints.txt must not pin torch: install.sh keeps the torch a machine has"
    for extra in (None, *PROJECT["optional-dependencies"]):
        for req in _requirements(extra):
            name = canonicalize_name(req.name)
            if name == "torch" or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            assert name in pins, f"constraints.txt has no pin for {req} (refresh it: bash .ci/lock.sh)"
            version = pins[name][0]
            assert req.specifier.contains(version, prereleases=True), (
                f"constraints.txt pins {req.name}=={version}, outside pyproject's {req} (refresh it: bash .ci/lock.sh)")
