"""The prefix index's tree (contract 4.4) believes what the flat index of chained block hashes
it replaced believed: the same matches, times and sizes after any sequence of records,
expiries and evictions. The flat index is kept here, as it was, as the model."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.prefix_index import (
    BLOCK_BYTES,
    Blocks,
    PrefixIndex,
    prompt_of,
    text_blocks,
    token_blocks,
)
from narwhal.core.prefix_tree import _Run


def chain(blocks: Blocks) -> tuple[int, ...]:
    """The flat index's keys for ``blocks``: each block's hash chained to its parent's."""
    out, parent, data, unit = [], blocks.root, blocks.data, blocks.unit
    for start in range(0, len(data), unit):
        piece = data[start : start + unit]
        parent = hash((parent, piece)) if isinstance(piece, bytes) else hash((parent, *piece))
        out.append(parent)
    return tuple(out)


class FlatIndex:
    """The index before the tree: per engine, an LRU of chained block hashes."""

    def __init__(self, ttl_s: float, max_blocks: int) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._engines: dict[str, OrderedDict[int, float]] = {}

    def record(self, engine_id: str, blocks: Sequence[int], now: float) -> None:
        if not blocks:
            return
        lru = self._engines.setdefault(engine_id, OrderedDict())
        for block in reversed(blocks):
            lru[block] = now
            lru.move_to_end(block)
        oldest = now - self.ttl_s
        while lru:
            block, at = next(iter(lru.items()))
            if at > oldest:
                break
            del lru[block]
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def match(self, engine_id: str, blocks: Sequence[int], now: float) -> int:
        lru = self._engines.get(engine_id)
        if not lru or not blocks:
            return 0
        oldest = now - self.ttl_s
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = lru.get(blocks[mid - 1])
            if at is not None and at > oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def recorded_at(self, engine_id: str, blocks: Sequence[int], held: int) -> float:
        lru = self._engines.get(engine_id)
        at = lru.get(blocks[held - 1]) if lru and held else None
        return -math.inf if at is None else at

    def size(self, engine_id: str) -> int:
        return len(self._engines.get(engine_id, ()))


# texts that share prefixes and part at every offset: pieces of a few base texts
BASES = ["a" * 700, "ab" * 350, "a" * 130 + "b" * 500, "é" * 300]
texts = st.builds(
    lambda base, cut, more: BASES[base][:cut] + more,
    st.integers(0, len(BASES) - 1),
    st.integers(0, 700),
    st.text(alphabet="abé", max_size=200),
)
ids = st.lists(st.integers(0, 3), max_size=120)
prompts = st.one_of(
    texts.map(lambda t: text_blocks(t.encode())),
    ids.map(lambda i: token_blocks(i)),
    # the same text under an adapter's root: never the base's blocks
    texts.map(lambda t: prompt_of({"prompt": t}, chat=False, adapter="lora-a").blocks),
)
steps = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "match", "forget"]),
        st.sampled_from(["e0", "e1"]),
        prompts,
        st.sampled_from([0.0, 0.5, 1.0, 3.0, 11.0]),  # time passing: ttl 10 expires some
    ),
    min_size=4,
    max_size=40,
)


def check_tree(index: PrefixIndex, max_blocks: int) -> None:
    """The tree's own rules: sizes add up, the bound holds, every run's children are older
    than it (so the oldest run is a leaf), each run is its parent's child by its key."""
    for engine in index._engines.values():
        runs = list(engine.lru)
        place = {id(run): i for i, run in enumerate(runs)}
        assert engine.size == sum(len(run.data) // run.unit for run in runs) <= max_blocks
        for run in runs:
            assert run.data
            assert len(run.data) % run.unit == 0
            assert all(place[id(child)] < place[id(run)] for child in run.children.values())
            siblings: dict[object, _Run] = run.parent.children if run.parent else engine.top
            assert siblings[run.key] is run


@settings(max_examples=200)
@given(steps, st.integers(1, 60))
def test_the_tree_believes_what_the_flat_index_believed(
    script: list[tuple[str, str, Blocks, float]], max_blocks: int
) -> None:
    tree, flat = PrefixIndex(10.0, max_blocks), FlatIndex(10.0, max_blocks)
    now = 0.0
    seen: list[Blocks] = []
    for op, engine, blocks, dt in script:
        now += dt
        if op == "record":
            tree.record(engine, blocks, now)
            flat.record(engine, chain(blocks), now)
        elif op == "forget":
            tree.forget(engine)
            flat._engines.pop(engine, None)
        seen.append(blocks)
        for asked in seen:  # every prompt so far, asked again now
            keys = chain(asked)
            assert tree.match(engine, asked, now) == flat.match(engine, keys, now)
            for n in range(len(asked) + 1):
                assert tree.recorded_at(engine, asked, n) == flat.recorded_at(engine, keys, n)
        assert tree.size(engine) == flat.size(engine)
        check_tree(tree, max_blocks)


@given(texts, texts)
def test_the_blocks_of_two_texts_are_the_same_as_far_as_their_chained_hashes(
    a: str, b: str
) -> None:
    x, y = text_blocks(a.encode()), text_blocks(b.encode())
    same = 0
    while same < min(len(x), len(y)) and chain(x)[same] == chain(y)[same]:
        same += 1
    index = PrefixIndex(ttl_s=60.0)
    index.record("e", x, 0.0)
    assert index.match("e", y, 0.0) == same


def test_a_long_prompt_after_a_shared_head_costs_one_run_not_a_block_each() -> None:
    head = "s" * (32 * BLOCK_BYTES)
    index = PrefixIndex(ttl_s=60.0)
    for i in range(20):
        index.record("e", text_blocks((head + f"{i:04d}" * 4000).encode()), float(i))
    (top,) = index._engines["e"].top.values()
    assert len(top.data) == len(head)
    assert len(top.children) == 20
    asked = text_blocks((head + "new" * 5000).encode())
    assert index.match("e", asked, 20.0) == 32
    assert index.recorded_at("e", asked, 32) == 19.0
