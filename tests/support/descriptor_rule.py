"""The descriptor rule, read from the source (docs/architecture.md, "Descriptors"): no
descriptor *number* is held across a checkpoint. A socket closed by another task frees its
number, the kernel gives it to the next socket opened, and a number kept across an ``await``
then names that other socket.

What counts as a number: a ``fileno()`` call, ``zmq.FD``, and any name or attribute called
``fd`` or ending in ``_fd``. Three shapes break the rule:

- **held**: in an ``async def``, a name bound to a number and read after an ``await`` that
  can run between its binding and the read (later in the body, or anywhere in a loop the
  binding is outside of);
- **handed**: an ``async def`` that takes a number as a parameter (it waits with it);
- **kept**: a number stored on an object (``self.fd = sock.fileno()``), where it outlives
  every checkpoint of its owner;
- **passed**: a number handed to an awaited call (``await read(sock.fileno())``), which
  keeps it across its own checkpoints. Trio's ``wait_readable`` and ``wait_writable`` are
  the exception: trio's ``notify_closing``, which a trio socket's ``close`` calls, ends
  their wait before the number is freed.

A checkpoint is an ``await``, an ``async for`` and an ``async with``. The check reads each
function's body in source order and ignores branches: it is strict, never lenient, about
code that may run in either order. A line that keeps a number on purpose says why in a
comment, on it or just above it, that starts with ``# descriptor kept:`` (the number's
socket is one that nothing but its holder can close, or its holder is told before the
close); the check passes that line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

Position = tuple[int, int]
EXEMPT = "# descriptor kept:"


@dataclass(frozen=True)
class Breach:
    path: str
    line: int
    shape: str  # "held", "handed", "kept" or "passed"
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: descriptor number {self.name!r} {self.shape}"


def _is_number_name(name: str) -> bool:
    return name == "fd" or name.endswith("_fd")


def is_number(node: ast.AST) -> bool:
    """Whether ``node`` evaluates to a descriptor number (or a tuple holding one)."""
    match node:
        case ast.Call(func=ast.Attribute(attr="fileno" | "getsockopt" as attr), args=args):
            return attr == "fileno" or any(_is_zmq_fd(arg) for arg in args)
        case ast.Call(func=ast.Attribute(value=ast.Name(id="os"), attr="open" | "dup")):
            return True
        case ast.Call(func=ast.Name(id=name) | ast.Attribute(attr=name)):
            return _is_number_name(name)  # _fd(sock), park_fd()
        case ast.Attribute(attr=name) | ast.Name(id=name):
            return _is_number_name(name)
        case ast.IfExp(body=body, orelse=orelse):
            return is_number(body) or is_number(orelse)
        case ast.Tuple(elts=elts):
            return any(is_number(one) for one in elts)
    return False


TRIO_WAITS = frozenset({"wait_readable", "wait_writable"})


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_zmq_fd(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "FD"


def _start(node: ast.AST) -> Position:
    return (node.lineno, node.col_offset)  # type: ignore[attr-defined]


def _end(node: ast.AST) -> Position:
    return (node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]


class _Body(ast.NodeVisitor):
    """One function's own body (nested functions and classes are theirs): the bindings of
    number names, their reads, the checkpoints and the loops, by source position."""

    def __init__(self) -> None:
        self.bindings: dict[str, list[tuple[Position, bool]]] = {}  # (where, a number)
        self.reads: list[tuple[str, Position, int]] = []
        self.checkpoints: list[Position] = []
        self.loops: list[tuple[Position, Position]] = []
        self.passed: list[tuple[str, int]] = []  # numbers handed to an awaited call

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        return  # another scope

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = visit_FunctionDef  # type: ignore[assignment]
    visit_ClassDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Await(self, node: ast.Await) -> None:
        self.generic_visit(node)
        self.checkpoints.append(_end(node))  # it suspends once its operand is evaluated
        call = node.value
        if isinstance(call, ast.Call) and _callee(call) not in TRIO_WAITS:
            for arg in [*call.args, *(keyword.value for keyword in call.keywords)]:
                if is_number(arg):
                    self.passed.append((ast.unparse(arg), node.lineno))

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item)
        self.checkpoints.append(_end(node.items[-1].context_expr))
        for statement in node.body:
            self.visit(statement)
        self.checkpoints.append(_end(node))

    def visit_AsyncFor(self, node: ast.AsyncFor) -> None:
        self.loops.append((_start(node), _end(node)))
        self.visit(node.iter)
        self.checkpoints.append(_end(node.iter))
        self._bind(node.target, number=False)
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    def visit_For(self, node: ast.For) -> None:
        self.loops.append((_start(node), _end(node)))
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self.loops.append((_start(node), _end(node)))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._assign(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self._assign(node.target, node.value)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self._assign(node.target, node.value)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.reads.append((node.id, _start(node), node.lineno))

    def _assign(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for one, its in zip(target.elts, value.elts, strict=False):
                self._assign(one, its)
            return
        self._bind(target, number=is_number(value))

    def _bind(self, target: ast.expr, *, number: bool) -> None:
        for part in ast.walk(target):
            if isinstance(part, ast.Name):  # rebound to something else: no longer a number
                kept = number or _is_number_name(part.id)
                self.bindings.setdefault(part.id, []).append((_start(part), kept))


def _held(body: _Body) -> list[tuple[str, int]]:
    """Reads of a number name that a checkpoint may separate from its binding: the last
    binding before the read holds a number and a checkpoint lies between them, or the read
    is in a loop with a checkpoint and the number comes from outside the loop or from later
    in it (the next turn reads the last turn's)."""
    out = []
    for name, at, line in body.reads:
        bindings = body.bindings.get(name, [])
        earlier = [(pos, number) for pos, number in bindings if pos < at]
        last = max(earlier) if earlier else None
        if last is not None and last[1] and any(last[0] < c < at for c in body.checkpoints):
            out.append((name, line))
            continue
        for start, end in body.loops:
            if not start <= at <= end or not any(start <= c <= end for c in body.checkpoints):
                continue
            from_outside = last is not None and last[1] and not start <= last[0] <= end
            from_later = any(number and at < pos <= end for pos, number in bindings)
            if from_outside or from_later:
                out.append((name, line))
                break
    return out


def breaches(source: str, path: str = "<source>") -> list[Breach]:
    """Every breach of the rule in one module's source."""
    found: list[Breach] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in args:
                if _is_number_name(arg.arg):
                    found.append(Breach(path, arg.lineno, "handed", arg.arg))
            body = _Body()
            for statement in node.body:
                body.visit(statement)
            for name, line in _held(body):
                found.append(Breach(path, line, "held", name))
            for expression, line in body.passed:
                found.append(Breach(path, line, "passed", expression))
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for attribute in _stored_numbers(target, node.value):
                    found.append(Breach(path, node.lineno, "kept", attribute))
    lines = source.splitlines()
    found = [b for b in found if EXEMPT not in "".join(lines[max(0, b.line - 2) : b.line])]
    return sorted(set(found), key=lambda b: (b.path, b.line, b.name))


def _stored_numbers(target: ast.expr, value: ast.expr) -> list[str]:
    """The attributes that an assignment stores a number in."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        pairs = zip(target.elts, value.elts, strict=False)
        return [name for one, its in pairs for name in _stored_numbers(one, its)]
    if isinstance(target, ast.Attribute) and is_number(value):
        return [target.attr]
    return []


def package_breaches(root: Path) -> list[Breach]:
    """Every breach in the modules under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        found += breaches(path.read_text(), path.relative_to(root.parent).as_posix())
    return found
