"""The approximate prefix index's store (contract 4.4), pure: per engine, the blocks the router
believes it caches, as a tree of runs of blocks.

What it holds is what a flat LRU of chained block hashes held (the index before this one,
kept as the model in ``tests/unit/core/test_prefix_tree.py``): per engine, the blocks of
the prompts recorded there, a block counting only under the same whole prefix, each with
the time it was last recorded, at most ``max_blocks`` of them in LRU order (the oldest
first, and within one record its tail before its head, as vLLM's free-block queue
evicts), expiring after ``ttl_s``. A record is always a prompt from its first block, so
what an engine holds of any prompt is a leading run of its blocks, and what it holds of
all of them is a tree: each node is a run of blocks that every prompt recorded through it
holds in sequence, recorded at one time, its children the runs that go on from its end
(keyed by their first block). A block's identity is its place in the tree, so no block is
hashed: a match walks the prompt's path comparing bytes (``startswith``, one ``memcmp``
per run), and a record stamps the runs on its path and stores what is new as one slice.
The flat LRU hashed every block of a prompt and moved every one (0.5 ms for 48 KB, paid
twice a request: bench/results/long-prompt-cpu); this costs one step per place where the
recorded prompts part.

The LRU is over runs: a run's children are always older than it (a record stamps its path
deepest first), so the oldest run is a leaf, and eviction trims it from its tail, as the
flat LRU dropped its blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeAlias

MAX_BLOCKS = 65536  # per engine: 4 MiB of text, about a million tokens of KV
Data: TypeAlias = bytes | tuple[int, ...]  # a text's UTF-8, or token ids


@dataclass(frozen=True, slots=True)
class Blocks:
    """A prompt's full blocks as the index keys them: ``data`` (whole blocks of ``unit``
    bytes of UTF-8, or ``unit`` token ids) under ``root`` (a text's, token ids', a LoRA
    adapter's own): prompts under two roots never share a block."""

    root: int
    unit: int
    data: Data

    def __len__(self) -> int:
        return len(self.data) // self.unit


class _Run:
    """Blocks that every prompt recorded through here holds in sequence, recorded last at
    ``at``; ``key`` is its first block (with the root, at the top), its name among its
    parent's ``children``."""

    __slots__ = ("at", "children", "data", "key", "parent", "unit")

    def __init__(self, data: Data, unit: int, at: float, parent: _Run | None, key: object) -> None:
        self.data = data
        self.unit = unit
        self.at = at
        self.parent = parent
        self.key = key
        self.children: dict[object, _Run] = {}


class _Engine:
    """One engine's tree: its top runs by (root, first block), every run oldest first, and
    how many blocks they hold."""

    __slots__ = ("lru", "size", "top")

    def __init__(self) -> None:
        self.top: dict[object, _Run] = {}
        self.lru: OrderedDict[_Run, None] = OrderedDict()
        self.size = 0


def _same(data: Data, pos: int, run: Data, start: int, end: int) -> bool:
    """Whether ``data`` from ``pos`` holds what ``run`` holds from ``start`` to ``end``."""
    if isinstance(data, bytes) and isinstance(run, bytes):
        return data.startswith(memoryview(run)[start:end], pos + start)  # no copy of either
    return data[pos + start : pos + end] == run[start:end]


def _held(run: Data, data: Data, pos: int, unit: int) -> int:
    """How much of ``run`` (whole blocks) ``data`` holds from ``pos``; its first block is
    known to (it was the key). Each step compares only what the one before left open, so
    a search costs about twice the run's length in ``memcmp``, never its square."""
    blocks = min(len(run), len(data) - pos) // unit
    if _same(data, pos, run, 0, blocks * unit):
        return blocks * unit
    lo, hi = 1, blocks - 1  # data holds run's first lo blocks, and not more than hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _same(data, pos, run, lo * unit, mid * unit):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


class PrefixIndex:
    """Per engine, a tree of the blocks it is believed to hold, LRU-bounded and expiring."""

    def __init__(self, ttl_s: float, max_blocks: int = MAX_BLOCKS) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._engines: dict[str, _Engine] = {}

    def record(self, engine_id: str, blocks: Blocks, now: float) -> None:
        """``engine_id`` computed (or received) these blocks now: its tail is touched first,
        its head last, so the head is evicted last."""
        if not blocks:
            return
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine()
        path, pos, part = _path(engine, blocks, -math.inf)
        unit, data = blocks.unit, blocks.data
        if path and part < len(path[-1].data):  # the prompt leaves its last run inside it
            path[-1] = _split(engine, path[-1], part)
        if pos < len(data):  # what is new: one run, under the last one it shares
            parent = path[-1] if path else None
            key = data[pos : pos + unit]
            at_top = parent is None
            leaf = _Run(data[pos:], unit, now, parent, (blocks.root, key) if at_top else key)
            (engine.top if parent is None else parent.children)[leaf.key] = leaf
            engine.lru[leaf] = None
            engine.size += (len(data) - pos) // unit
        for run in reversed(path):  # deepest first: a parent stays newer than its children
            run.at = now
            engine.lru.move_to_end(run)
        self._expire(engine, now)
        excess = engine.size - self.max_blocks
        while excess > 0:  # bounded: each pass drops a run or ends
            oldest = next(iter(engine.lru))
            count = len(oldest.data) // oldest.unit
            if count > excess:  # its tail goes, its head stays
                oldest.data = oldest.data[: (count - excess) * oldest.unit]
                engine.size -= excess
                return
            _drop(engine, oldest)
            excess -= count

    def match(self, engine_id: str, blocks: Blocks, now: float) -> int:
        """How many leading blocks of ``blocks`` the engine is believed to hold."""
        engine = self._engines.get(engine_id)
        if engine is None or not blocks:
            return 0
        return _path(engine, blocks, now - self.ttl_s)[1] // blocks.unit

    def recorded_at(self, engine_id: str, blocks: Blocks, held: int) -> float:
        """When the last of the ``held`` leading blocks was recorded for ``engine_id``: of
        two engines holding as much, the one that served the text last holds more of it
        (what it generated beyond the last full block, a turn's reply)."""
        engine = self._engines.get(engine_id)
        if engine is None or held <= 0:
            return -math.inf
        path, pos, _ = _path(engine, blocks, -math.inf)
        last = (held - 1) * blocks.unit  # where the last of them starts
        if last >= pos:
            return -math.inf
        start = 0
        for run in path:  # bounded: the path covers it
            start += len(run.data)
            if last < start:
                return run.at
        return -math.inf

    def forget(self, engine_id: str) -> None:
        """The engine left, or restarted: whatever it cached is gone."""
        self._engines.pop(engine_id, None)

    def keep_only(self, engine_ids: Iterable[str]) -> None:
        """Drop the index of every engine not among ``engine_ids`` (a reload removed it)."""
        keep = set(engine_ids)
        for gone in [e for e in self._engines if e not in keep]:
            del self._engines[gone]

    def size(self, engine_id: str) -> int:
        """Blocks held for ``engine_id``, expired ones not yet dropped included."""
        engine = self._engines.get(engine_id)
        return 0 if engine is None else engine.size

    def _expire(self, engine: _Engine, now: float) -> None:
        oldest = now - self.ttl_s
        while engine.lru:  # bounded: each pass drops a run or ends
            run = next(iter(engine.lru))
            if run.at > oldest:
                return
            _drop(engine, run)


def _path(engine: _Engine, blocks: Blocks, oldest: float) -> tuple[list[_Run], int, int]:
    """The runs the prompt goes through from its first block, each recorded after
    ``oldest``; how much of its data they hold; how much of the last run it holds."""
    unit, data = blocks.unit, blocks.data
    path: list[_Run] = []
    pos = part = 0
    run = engine.top.get((blocks.root, data[:unit]))
    while run is not None and run.at > oldest:  # bounded: each run moves pos on
        path.append(run)
        part = _held(run.data, data, pos, unit)
        pos += part
        if part < len(run.data) or pos >= len(data):
            break
        run = run.children.get(data[pos : pos + unit])
    return path, pos, part


def _split(engine: _Engine, run: _Run, part: int) -> _Run:
    """``run`` cut after its first ``part``: a new run takes that head and run's place in
    the tree, run keeps the rest (and its children, and its place in the LRU: the head
    goes to the end until the record stamps it)."""
    head = _Run(run.data[:part], run.unit, run.at, run.parent, run.key)
    (engine.top if run.parent is None else run.parent.children)[run.key] = head
    run.data = run.data[part:]
    run.key = run.data[: run.unit]
    run.parent = head
    head.children[run.key] = run
    engine.lru[head] = None
    return head


def _drop(engine: _Engine, run: _Run) -> None:
    """The oldest run goes (a leaf: its children, older still, went before it)."""
    del engine.lru[run]
    siblings = engine.top if run.parent is None else run.parent.children
    if siblings.get(run.key) is run:
        del siblings[run.key]
    engine.size -= len(run.data) // run.unit
