"""The build a process runs is the one it says it runs (``narwhal --version``), compiled
modules are never older than their source, and NARWHAL_PURE=1 runs the source."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import msgspec

from narwhal.process import build

SCRIPT = (
    "import narwhal.stream.rules as rules, narwhal.process.build as build; "
    "print(rules.__file__); print(build.describe())"
)


def _run(env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.splitlines()


def test_no_compiled_module_is_older_than_its_source() -> None:
    assert build.stale_modules() == [], "rebuild the compiled modules: make compiled"


def test_the_build_named_is_the_build_running() -> None:
    origin, described = _run({"NARWHAL_PURE": ""})
    if build.compiled_modules():
        assert described.startswith("compiled by mypyc")
        assert not origin.endswith(".py")
    else:
        assert described == "pure Python (not compiled)"
        assert origin.endswith("rules.py")


def test_narwhal_pure_runs_the_source_of_a_compiled_tree() -> None:
    origin, described = _run({"NARWHAL_PURE": "1"})
    assert origin.endswith("narwhal/stream/rules.py")
    assert described == "pure Python (NARWHAL_PURE=1)"


def test_no_compiled_module_defines_a_msgspec_struct() -> None:
    """mypyc drops a struct's options (frozen, forbid_unknown_fields) and misreads its
    field types: setup.py leaves such modules pure."""
    for name in build.compiled_modules():
        module = importlib.import_module(name)
        structs = [
            cls.__name__
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, msgspec.Struct) and cls.__module__ == name
        ]
        assert structs == [], name
