"""Third-party internals are touched in one place: ``narwhal/frontdoor/seams.py``. Every
private name of hypercorn or h11 it uses (an import from a private module, a private
attribute read, a private method overridden or called, a private argument) is covered by
the start-up check (``seams.DIGESTS`` or ``seams.PRESENT``); no other module of the front
door, nor the metrics modules (``narwhal/observe/metrics.py`` and its parts), uses a private name
of another library; and what the front door's subclasses of hypercorn's and h11's classes
add takes the place of nothing of theirs by accident."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import h11
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.worker_context import WorkerContext

from narwhal.frontdoor import seams
from narwhal.frontdoor.http11 import Http11Protocol, _Http11Connection
from tests.support.paths import ROOT

FRONTDOOR = ROOT / "narwhal" / "frontdoor"
SEAMS = FRONTDOOR / "seams.py"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("narwhal", "tests", "checked")


def own_names(tree: ast.AST) -> set[str]:
    """The names a module defines: its functions, classes and assignments at any level,
    and the attributes it assigns (``x._name = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def read_uses(tree: ast.AST) -> set[str]:
    """What a module's source says of other libraries' private names: imports from a
    private module or of a private name (``module:name``), private attributes it reaches
    on anything but ``self``, ``cls`` or a class of its own (``super()`` included) or does
    not define itself, private keyword arguments."""
    own = own_names(tree)
    mine = {"self", "cls"} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "narwhal":
                continue
            for alias in node.names:
                if any(map(private, node.module.split("."))) or private(alias.name):
                    found.add(f"{node.module}:{alias.name}")
        elif isinstance(node, ast.Attribute) and private(node.attr):
            through_mine = isinstance(node.value, ast.Name) and node.value.id in mine
            if node.attr not in own or not through_mine:
                found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg and private(node.arg):
            found.add(node.arg)
    return found


def class_names(tree: ast.AST) -> set[str]:
    """The private names that the module's class bodies define (methods, class attributes)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.Assign | ast.AnnAssign):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {name for name in names if private(name)}


def overrides(tree: ast.AST, module: ModuleType) -> set[str]:
    """The private names that a class of ``module`` defines over the same name of another
    library's class it extends."""
    defined = class_names(tree)
    found: set[str] = set()
    for cls in vars(module).values():
        if inspect.isclass(cls) and cls.__module__ == module.__name__:
            theirs = [base for base in cls.__mro__[1:] if not ours(base)]
            found |= {
                name
                for name in set(vars(cls)) & defined
                if any(name in vars(base) for base in theirs)
            }
    return found


def private_uses(path: Path, module: ModuleType) -> set[str]:
    tree = ast.parse(path.read_text())
    return read_uses(tree) | overrides(tree, module)


def covered() -> set[str]:
    """Every module, class and attribute name the start-up check names."""
    names: set[str] = set()
    for entry in (*seams.DIGESTS, *seams.PRESENT):
        module, _, attrs = entry.partition(":")
        names |= set(re.split(r"[.:()]", entry)) - {""}
        if attrs:
            names.add(f"{module}:{attrs.split('.')[0]}")
    return names


def test_the_check_covers_every_private_name_the_adapter_uses() -> None:
    uses = private_uses(SEAMS, seams)
    # the reads, the private argument, the private module, the hooks overridden and called
    assert {
        "_reader",
        "_writer",
        "_bytes_in_chunk",
        "_parsed",
        "h11._readers:ChunkedReader",
    } <= uses
    assert {"_check_protocol", "_send_error_response", "_close_stream"} <= uses
    assert uses - covered() == set()


def test_the_parse_finds_a_private_name_left_unchecked(tmp_path: Path) -> None:
    path = tmp_path / "checked.py"
    path.write_text(
        "from h11._util import bytesify\n"
        "from hypercorn.protocol.h11 import H11Protocol\n"
        "class Ours(H11Protocol):\n"
        "    def _mine(self) -> None:\n"
        "        self._own = 1\n"
        "    async def _maybe_recycle(self) -> None:\n"
        "        await super()._close_stream()\n"
        "        await self._send_h11_event(self._own, _hint=True)\n"
    )
    spec = importlib.util.spec_from_file_location("checked", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["checked"] = module
    try:
        spec.loader.exec_module(module)
        uses = private_uses(path, module)
    finally:
        del sys.modules["checked"]
    assert uses == {
        "h11._util:bytesify",
        "_maybe_recycle",
        "_close_stream",
        "_send_h11_event",
        "_hint",
    }
    assert uses - covered() == {"h11._util:bytesify", "_send_h11_event", "_hint"}


def test_only_the_adapter_touches_another_librarys_private_names() -> None:
    paths = [p for p in sorted(FRONTDOOR.glob("*.py")) if p != SEAMS]
    paths += [
        ROOT / "narwhal" / "observe" / name
        for name in (
            "metrics.py",
            "metric_series.py",
            "metrics_exposition.py",
            "batched_histogram.py",
        )
    ]
    touched = {}
    for path in paths:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        touched[name] = private_uses(path, importlib.import_module(name))
    assert {name: uses for name, uses in touched.items() if uses} == {}


def names_of(obj: object) -> set[str]:
    return set(dir(obj)) | set(getattr(obj, "__dict__", {}))


def added_by(cls: type, *, up_to: type) -> set[str]:
    """The names the classes from ``cls`` up to ``up_to`` (not included) define, less the
    ones Python gives every class."""
    names = set().union(*(vars(c) for c in cls.__mro__[: cls.__mro__.index(up_to)]))
    return {name for name in names if not (name.startswith("__") and name.endswith("__"))}


def a_protocol(kind: type[H11Protocol], **extra: object) -> H11Protocol:
    async def send(_: object) -> None: ...

    config, context = Config(), WorkerContext(None)
    return kind(None, config, context, None, {}, False, None, None, send, **extra)  # type: ignore[arg-type]


def test_our_subclasses_take_the_place_of_nothing_by_accident() -> None:
    """Each name that our subclasses add (on the class, or on a fresh instance) is new to
    the class they extend, but for hypercorn's hooks that the adapter overrides."""
    theirs = a_protocol(H11Protocol)
    mine = a_protocol(Http11Protocol, client=None)
    hooks = {"_check_protocol", "_send_error_response", "_close_stream"}  # seams.DIGESTS
    added = added_by(Http11Protocol, up_to=H11Protocol) | (set(vars(mine)) - set(vars(theirs)))
    assert {"check_request", "watch", "_on_close"} <= added
    assert added & (names_of(theirs) | names_of(H11Protocol)) == hooks

    connection = h11.Connection(h11.SERVER)
    replaced = {"send_with_data_passthrough", "receive_data", "next_event"}
    added = added_by(_Http11Connection, up_to=h11.Connection)
    assert {"_eof", "_body_read", "body_limit"} <= added
    assert added & (names_of(connection) | names_of(h11.Connection)) == replaced
