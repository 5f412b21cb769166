"""The build: the pure core, the stream code and the per-token path compiled by mypyc
(``COMPILED``).

The same source is the pure-Python build. It is what you get with ``NARWHAL_PURE=1``, without
a C compiler, or when the compile fails; ``narwhal --version`` says which build is installed.

A module that defines a msgspec struct, or passes keywords on a ``class`` line, stays pure:
mypyc compiles such a class as a plain Python class but drops its keywords without a word
(``frozen=True``, ``forbid_unknown_fields=True``: python/mypy#21938), and msgspec then reads
its fields' types wrong. Every module left pure is named in the build's output with its
reason; docs/build.md says which and why.
"""

from __future__ import annotations

import ast
import os
import shlex
import shutil
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

HERE = Path(__file__).parent
# the pure core, the pure stream code, and the module that owns the per-token path
COMPILED = (
    "narwhal/core",
    "narwhal/stream",
    "narwhal/router/token_path.py",
    # what the profile names on the per-token path around it (bench/results/relay-compiled)
    "narwhal/router/stream_reactor.py",
    "narwhal/lowlevel/fast_io.py",
)
# modules kept pure for a reason of their own (docs/build.md)
PURE = {
    # the fault hierarchy is subclassed by the shells and tests, and a fault is copied with
    # its attributes (RequestFault.at): a compiled class allows neither; faults are rare
    "narwhal/core/faults.py": "exceptions subclassed outside the compiled modules",
    # the cross-key rules also run over a file with bad keys, each standing at None in its
    # struct (config_parse's _cross_field_over_valid_keys): a compiled module refuses None
    # where the struct's type says str
    "narwhal/core/config_rules.py": "reads structs holding None where a key was invalid",
}


def say(line: str) -> None:
    print(f"narwhal build: {line}", flush=True)


def _is_struct(base: ast.expr) -> bool:
    return (isinstance(base, ast.Name) and base.id == "Struct") or (
        isinstance(base, ast.Attribute) and base.attr == "Struct"
    )


def classes_mypyc_breaks(path: Path) -> list[str]:
    """The classes of ``path`` that mypyc would compile wrongly: msgspec structs, and any
    class passing keywords (other than ``metaclass``) to its base."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and (
            any(_is_struct(base) for base in node.bases)
            or any(k.arg != "metaclass" for k in node.keywords)
        )
    ]


def candidates() -> list[Path]:
    paths: list[Path] = []
    for entry in COMPILED:
        path = HERE / entry
        # a package's __init__ stays pure: compiled, its __path__ is computed from the group
        # library's place, which is inside the narwhal package (mypyc gets it wrong there)
        paths.extend(
            sorted(p for p in path.glob("*.py") if p.name != "__init__.py")
            if path.is_dir()
            else [path]
        )
    return paths


def compiled_sources() -> list[str]:
    sources = []
    for path in candidates():
        name = str(path.relative_to(HERE))
        if name in PURE:
            say(f"{name} stays pure ({PURE[name]})")
            continue
        kept_pure = classes_mypyc_breaks(path)
        if kept_pure:
            say(f"{name} stays pure (msgspec structs or class keywords: {', '.join(kept_pure)})")
        else:
            sources.append(name)
    return sources


def have_compiler() -> bool:
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    return bool(compiler) and shutil.which(compiler[0]) is not None


def extensions() -> list[Extension]:
    if os.environ.get("NARWHAL_PURE") == "1":
        say("pure Python (NARWHAL_PURE=1)")
        return []
    if not have_compiler():
        say("pure Python (no C compiler)")
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        say("pure Python (mypyc is not installed)")
        return []
    sources = compiled_sources()
    say(f"compiling {len(sources)} modules with mypyc")
    try:
        # the group's shared library inside the package (narwhal/compiled__mypyc...), where
        # an editable install's finder sees it
        return list(mypycify(sources, opt_level="3", group_name="narwhal.compiled"))
    except SystemExit:  # mypyc reports a type error of the source this way; it printed it
        say("pure Python (mypyc refused the source, above)")
        return []


def remove_compiled() -> None:
    """Every compiled module beside its source: the import would take a stale build over
    the source (a module mypyc refused once ran an earlier build's code)."""
    for built in HERE.glob("narwhal/**/*" + sysconfig.get_config_var("EXT_SUFFIX")):
        built.unlink()


class BuildOrFallBack(build_ext):
    """Builds the extensions, or none: a compile that fails part way leaves the pure build
    (one missing shared library would break every compiled module that needs it)."""

    def run(self) -> None:
        if not self.extensions:  # pure: a compiled module left in place would shadow it
            if self.inplace:
                remove_compiled()
            return
        try:
            super().run()
            if self.inplace:
                # a rebuild copies only what changed; the group's library is marked built
                # from today's source (narwhal.process.build.stale_modules reads this time)
                for library in HERE.glob("narwhal/compiled__mypyc.*"):
                    library.touch()
        except (CCompilerError, CompileError, ExecError, PlatformError) as exc:
            say(f"pure Python (the compile failed: {exc})")
            for ext in self.extensions:
                for built in (self.get_ext_fullpath(ext.name), self._inplace_path(ext.name)):
                    Path(built).unlink(missing_ok=True)

    def _inplace_path(self, name: str) -> str:
        return str(HERE / (name.replace(".", "/") + sysconfig.get_config_var("EXT_SUFFIX")))


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildOrFallBack})
