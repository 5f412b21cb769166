"""Which build of narwhal is running: compiled by mypyc (setup.py) or pure Python.

The compiled modules are C extensions beside their source. ``NARWHAL_PURE=1`` in the
environment makes the process import the source instead (``narwhal/__init__.py`` calls
``prefer_sources`` before any other narwhal module loads): the pure-Python build of the same
tree, without rebuilding it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = Path(__file__).parent.parent  # narwhal/, above this package
EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def pure_requested() -> bool:
    return os.environ.get("NARWHAL_PURE") == "1"


class _SourcesFirst:
    """A meta path finder: a narwhal module from its ``.py`` file, never its extension."""

    @staticmethod
    def find_spec(
        name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("narwhal.") or path is None:
            return None
        leaf = name.rpartition(".")[2]
        for entry in path:
            package = Path(entry, leaf, "__init__.py")
            if package.is_file():
                locations = [str(package.parent)]
                return importlib.util.spec_from_file_location(
                    name, package, submodule_search_locations=locations
                )
            module = Path(entry, f"{leaf}.py")
            if module.is_file():
                return importlib.util.spec_from_file_location(name, module)
        return None


def prefer_sources() -> None:
    if not any(isinstance(finder, _SourcesFirst) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourcesFirst())


def _extensions() -> list[tuple[str, Path, Path]]:
    """(module name, source, extension) of every narwhal module built beside its source."""
    found = []
    for built in PACKAGE.rglob("*.so"):
        stem = built.name.split(".", 1)[0]
        source = built.with_name(f"{stem}.py")
        if built.name.endswith(EXTENSIONS) and source.is_file():  # not the group library
            parts = source.relative_to(PACKAGE).with_suffix("").parts
            name = ".".join(("narwhal", *(parts[:-1] if stem == "__init__" else parts)))
            found.append((name, source, built))
    return sorted(found)


def compiled_modules() -> list[str]:
    """The narwhal modules with a compiled extension beside their source."""
    return [name for name, _, _ in _extensions()]


def stale_modules() -> list[str]:
    """Compiled modules whose source changed after they were built (rebuild: make compiled),
    in a source checkout (an installed package's times say nothing of its build).
    A module's code is in the group's shared library (setup.py's ``group_name``); its own
    extension is a shim that a rebuild leaves alone when only the code changed."""
    if not PACKAGE.parent.joinpath("setup.py").is_file():
        return []
    shared = [p.stat().st_mtime for p in PACKAGE.glob("compiled__mypyc.*")]
    return [
        name
        for name, source, built in _extensions()
        if max([built.stat().st_mtime, *shared]) < source.stat().st_mtime
    ]


def describe() -> str:
    """One line: the build this process runs."""
    if pure_requested():
        return "pure Python (NARWHAL_PURE=1)"
    running = [name for name in compiled_modules() if _origin(name).endswith(EXTENSIONS)]
    if not running:
        return "pure Python (not compiled)"
    stale = stale_modules()
    if stale:
        return f"compiled by mypyc ({len(running)} modules; older than their source: {stale})"
    return f"compiled by mypyc ({len(running)} modules)"


def _origin(name: str) -> str:
    spec = importlib.util.find_spec(name)
    return (spec.origin or "") if spec is not None else ""
