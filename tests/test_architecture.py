"""The package's shape: no import cycle inside ``narwhal/`` (every import counts, lazy and
``TYPE_CHECKING`` ones included: a cycle hidden from the interpreter is still one a
newcomer must untangle), and the pure modules that docs/architecture.md names import no
I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "narwhal"
# the sans-IO core (docs/architecture.md): decisions and parsers, no sockets, no clocks
PURE = (
    "narwhal.sse",
    "narwhal.faults",
    "narwhal.config",
    "narwhal.engines.chunked",
    "narwhal.engines.stream",
    "narwhal.engines.relay",
    "narwhal.engines.connector",
    "narwhal.router.lifecycle",
    "narwhal.router.breaker",
    "narwhal.router.retry",
    "narwhal.router.placement",
    "narwhal.router.requests",
    "narwhal.router.assemble",
    "narwhal.router.handoff",
    "narwhal.router.policies",
)
IO = ("trio", "hypercorn", "h11", "httpcore", "socket", "asyncio")


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


@pytest.mark.parametrize("name", PURE)
def test_the_pure_core_imports_no_io(name: str) -> None:
    path = PACKAGE.joinpath(*name.split(".")[1:]).with_suffix(".py")
    edges = graph()
    seen, todo = set(), [name]
    while todo:  # what it imports from the package must be pure too
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += edges[current]
    for module in seen:
        file = PACKAGE.joinpath(*module.split(".")[1:])
        file = file / "__init__.py" if file.is_dir() else file.with_suffix(".py")
        io = {m for m in imports_of(file) if m.split(".")[0] in IO}
        assert not io, f"{name} reaches {module}, which imports {sorted(io)}"
    assert path.exists()
