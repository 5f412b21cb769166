"""The package's shape, by directory: no import cycle inside ``narwhal/`` (every import
counts, lazy and ``TYPE_CHECKING`` ones included: a cycle hidden from the interpreter is
still one a newcomer must untangle); ``narwhal/core/`` and ``narwhal/stream/`` import
nothing from the shells (``core`` not even from ``stream``); and no I/O (trio, hypercorn,
h11, httpcore, sockets, asyncio, threads, subprocesses) is reachable from them. Above them,
each directory imports only from the ones below it: ``lowlevel/`` nothing of the package,
``observe/`` nothing of the shells that report through it, and nothing but the process
shell (``process/``) imports the process shell."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.paths import ROOT

PACKAGE = ROOT / "narwhal"
# the sans-IO directories and what each may import from the package besides itself
PURE_DIRS = {
    "narwhal.core": ("narwhal.core",),
    "narwhal.stream": ("narwhal.core", "narwhal.stream"),
}
# the directories above them, lowest first, and what each may import from the package
# besides itself: no arrow runs back up (the process shell, at the top, starts the router)
CORE = ("narwhal.core", "narwhal.stream")
SHELL_DIRS = {
    "narwhal.lowlevel": (),
    "narwhal.observe": ("narwhal.core", "narwhal.lowlevel"),
    "narwhal.frontdoor": (*CORE, "narwhal.lowlevel", "narwhal.observe"),
    "narwhal.engines": (*CORE, "narwhal.lowlevel", "narwhal.observe"),
    "narwhal.fake_engine": (*CORE, "narwhal.lowlevel", "narwhal.observe"),
    "narwhal.router": (
        *CORE,
        "narwhal.lowlevel",
        "narwhal.observe",
        "narwhal.engines",
        "narwhal.frontdoor",
        # the one arrow back: a reload reads the fleet file through the loader every start
        # and ``narwhal check`` go through (``Router.reload`` in router/service.py)
        "narwhal.process.config_files",
    ),
    "narwhal.process": (
        *CORE,
        "narwhal.lowlevel",
        "narwhal.observe",
        "narwhal.engines",
        "narwhal.frontdoor",
        "narwhal.fake_engine",
        "narwhal.router",
    ),
}
# the only modules at the top of the package: everything else lives in a directory above
TOP = ("narwhal", "narwhal.__main__")
IO = (
    "trio",
    "hypercorn",
    "h11",
    "httpcore",
    "h2",
    "socket",
    "asyncio",
    "threading",
    "subprocess",
    "selectors",
    "select",
    "outcome",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file, resolved to absolute names."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` imports the module; anything else, the base
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if _is_module(submodule) else base)
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in imports_of(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_inside_the_package() -> None:
    assert cycles(graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def pure_modules() -> list[str]:
    return sorted(
        m for m in graph() if m.split(".")[:2] in (["narwhal", "core"], ["narwhal", "stream"])
    )


def upward_imports(
    edges: dict[str, set[str]], rules: dict[str, tuple[str, ...]] = PURE_DIRS
) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a directory of ``rules`` (the pure ones unless
    told) imports outside itself and what it may."""
    found = []
    for module, imported in edges.items():
        for directory, others in rules.items():
            allowed = (directory, *others)
            if module == directory or module.startswith(directory + "."):
                found += [
                    (module, m)
                    for m in sorted(imported)
                    if m != "narwhal" and not any(m == a or m.startswith(a + ".") for a in allowed)
                ]
    return found


def io_reached(edges: dict[str, set[str]], io_of: dict[str, set[str]], start: str) -> set[str]:
    """Every I/O module reachable from ``start`` through the package's imports."""
    seen, todo = set(), [start]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += edges.get(current, ())
    return {io for module in seen for io in io_of.get(module, ())}


def io_imports() -> dict[str, set[str]]:
    found = {}
    for name in graph():
        file = PACKAGE.joinpath(*name.split(".")[1:])
        file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
        found[name] = {m for m in imports_of(file) if m.split(".")[0] in IO}
    return found


def test_the_pure_directories_exist_and_hold_the_core() -> None:
    names = pure_modules()
    for expected in ("narwhal.core.config", "narwhal.core.lifecycle", "narwhal.stream.rules"):
        assert expected in names


def test_no_upward_import_into_the_pure_directories() -> None:
    assert upward_imports(graph()) == []


def test_the_upward_check_finds_one() -> None:
    edges = {
        "narwhal.core.a": {"narwhal.stream.b"},  # core may not import stream
        "narwhal.stream.b": {"narwhal.core.a", "narwhal.router.c"},  # nor stream a shell
        "narwhal.router.c": {"narwhal.core.a"},  # shells import down freely
    }
    assert upward_imports(edges) == [
        ("narwhal.core.a", "narwhal.stream.b"),
        ("narwhal.stream.b", "narwhal.router.c"),
    ]


def test_every_module_lives_in_a_directory_with_a_place() -> None:
    """Nothing loose at the top: a module belongs to a pure directory or to one of
    ``SHELL_DIRS``, so the rules above place every module."""
    placed = (*PURE_DIRS, *SHELL_DIRS)
    loose = [
        m
        for m in graph()
        if m not in TOP and not any(m == d or m.startswith(d + ".") for d in placed)
    ]
    assert loose == []


def test_no_back_arrow_between_the_shell_directories() -> None:
    assert upward_imports(graph(), SHELL_DIRS) == []


def test_the_back_arrow_check_finds_one() -> None:
    edges = {
        "narwhal.lowlevel.a": {"narwhal.router.b", "narwhal.core.c"},  # lowlevel: nothing
        "narwhal.observe.d": {"narwhal.lowlevel.a", "narwhal.process.e"},  # nor the shell
        "narwhal.router.b": {"narwhal.process.config_files", "narwhal.process.e"},
        "narwhal.process.e": {"narwhal.router.b", "narwhal.observe.d"},  # the top: anything
    }
    assert upward_imports(edges, SHELL_DIRS) == [
        ("narwhal.lowlevel.a", "narwhal.core.c"),
        ("narwhal.lowlevel.a", "narwhal.router.b"),
        ("narwhal.observe.d", "narwhal.process.e"),
        ("narwhal.router.b", "narwhal.process.e"),
    ]


def test_the_front_door_imports_nothing_of_the_router() -> None:
    """The router hands the front door its app, hooks and settings
    (``narwhal.router.serving``): no import runs back up from the front door."""
    back = [
        (module, imported)
        for module, imports in graph().items()
        if module.startswith("narwhal.frontdoor")
        for imported in sorted(imports)
        if imported.startswith("narwhal.router")
    ]
    assert back == []


@pytest.mark.parametrize("name", pure_modules())
def test_the_pure_core_reaches_no_io(name: str) -> None:
    assert io_reached(graph(), io_imports(), name) == set()


def test_the_io_check_follows_imports() -> None:
    edges = {"narwhal.core.a": {"narwhal.core.b"}, "narwhal.core.b": set()}
    assert io_reached(edges, {"narwhal.core.b": {"trio"}}, "narwhal.core.a") == {"trio"}


# what reads or writes files, or builds TLS contexts: the shell's (narwhal/process/config_files.py
# reads the fleet file and loads its CA bundle), never the pure directories'
FILE_IO = ("ssl", "pathlib", "os", "io", "shutil", "tempfile", "mmap")


def file_io_of(source: str) -> list[str]:
    """Every file or TLS module ``source`` imports, and every call of the builtin ``open``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FILE_IO]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [node.module] if node.module.split(".")[0] in FILE_IO else []
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            found += ["open()"] if node.func.id == "open" else []
    return found


@pytest.mark.parametrize("name", pure_modules())
def test_the_pure_core_touches_no_file(name: str) -> None:
    path = PACKAGE.joinpath(*name.split(".")[1:])
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    assert file_io_of(path.read_text()) == []


def test_the_file_check_finds_reads_and_tls() -> None:
    source = "import ssl\nfrom pathlib import Path\nwith open('f') as f: pass\n"
    assert file_io_of(source) == ["ssl", "pathlib", "open()"]


def test_no_test_module_imports_another() -> None:
    """Shared helpers live in ``tests/support/``; a test module (or a conftest) imported by
    another ties their fixtures and collection order together."""
    offenders = []
    for folder in ("tests", "fuzz"):  # e2e/vllm is its own suite, with its own conftest
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                leaves = {n.rsplit(".", 1)[-1] for n in names if n.split(".")[0] in TEST_ROOTS}
                if any(leaf.startswith("test_") or leaf == "conftest" for leaf in leaves):
                    offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


TEST_ROOTS = ("tests", "fuzz", "e2e")


MAX_MODULE_LINES = 500


def test_no_module_in_the_package_is_longer_than_a_reader_takes_in() -> None:
    """A module over 500 lines holds more than one thing: split it along its seams."""
    long = {
        module_name(path): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


# the machines that own a request's lifecycle: nothing else moves it (h11's Connection is
# the only writer of a connection's state)
LIFECYCLE_OWNERS = {"narwhal.core.request", "narwhal.core.fanout_parent", "narwhal.core.lifecycle"}


def lifecycle_writes(source: str) -> list[int]:
    """The lines of ``source`` that call ``.advance(...)``: a lifecycle moved."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "advance"
    ]


def test_only_the_request_machines_move_a_request_s_lifecycle() -> None:
    writers = {
        module_name(path): lines
        for path in PACKAGE.rglob("*.py")
        if module_name(path) not in LIFECYCLE_OWNERS
        and (lines := lifecycle_writes(path.read_text()))
    }
    assert writers == {}


def test_the_writer_check_finds_one() -> None:
    source = "def end(record):\n    record.lifecycle.advance(Input.FAIL)\n"
    assert lifecycle_writes(source) == [2]
