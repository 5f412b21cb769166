"""Placement policies (contract 4.4), as properties of pure functions (hypothesis)."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.policies import (
    AFFINITY_SLACK,
    PREFIX_CHARS,
    EngineLoad,
    PrefixRing,
    bound,
    least_loaded,
    prefix_key,
)

ids = st.lists(
    st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=8), min_size=1, max_size=8
).map(lambda xs: sorted(set(xs)))
keys = st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=60)


@given(
    loads=st.lists(
        st.tuples(st.integers(0, 50), st.floats(0, 50), st.floats(0, 1)), min_size=0, max_size=8
    ),
    seed=st.integers(0, 2**32),
    consumer=st.booleans(),
)
def test_least_loaded_picks_a_candidate_and_never_the_heavier_of_its_two(
    loads: list[tuple[int, float, float]], seed: int, consumer: bool
) -> None:
    candidates = [EngineLoad(f"e{i}", a, b, c) for i, (a, b, c) in enumerate(loads)]
    rng = random.Random(seed)
    state = rng.getstate()
    chosen = least_loaded(candidates, rng, lambda e: e.cost(consumer=consumer))
    if not candidates:
        assert chosen is None
        return
    assert chosen in candidates
    pair = candidates
    if len(candidates) > 2:
        rng.setstate(state)
        a, b = rng.sample(range(len(candidates)), 2)
        pair = [candidates[a], candidates[b]]
    assert chosen in pair
    assert chosen.cost(consumer=consumer) == min(e.cost(consumer=consumer) for e in pair)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 8), seed=st.integers(0, 2**32))
def test_under_equal_load_the_picks_spread_within_a_bound(n: int, seed: int) -> None:
    rng = random.Random(seed)
    inflight = [0] * n
    for _ in range(2000):  # each pick adds a leg to the chosen engine: load feedback
        loads = [EngineLoad(f"e{i}", inflight[i]) for i in range(n)]
        chosen = least_loaded(loads, rng, lambda e: e.cost(consumer=False))
        assert chosen is not None
        inflight[int(chosen.id[1:])] += 1
    # measured over 2,100 runs: at most 6 apart (a uniform random pick: about 40)
    assert max(inflight) - min(inflight) <= 8, inflight


def test_a_full_kv_cache_weighs_on_a_consumer_only() -> None:
    light, full = EngineLoad("a", 2, 0, 0.0), EngineLoad("b", 1, 0, 1.0)
    assert full.cost(consumer=True) > light.cost(consumer=True)
    assert full.cost(consumer=False) < light.cost(consumer=False)


@given(producers=ids, new=st.text(alphabet="klmnop", min_size=1, max_size=6), keys=keys)
def test_adding_a_producer_moves_only_keys_to_it(
    producers: list[str], new: str, keys: list[str]
) -> None:
    before = PrefixRing(producers)
    after = PrefixRing([*producers, new])
    for key in keys:
        home_before, home_after = before.order(key)[0], after.order(key)[0]
        assert home_after in (home_before, new)


@given(producers=ids.filter(lambda xs: len(xs) >= 2), keys=keys)
def test_removing_a_producer_moves_only_its_own_keys(producers: list[str], keys: list[str]) -> None:
    gone = producers[0]
    before = PrefixRing(producers)
    after = PrefixRing(producers[1:])
    for key in keys:
        home_before = before.order(key)[0]
        if home_before != gone:
            assert after.order(key)[0] == home_before


@given(
    producers=ids,
    key=st.text(max_size=40),
    loads=st.lists(st.integers(0, 30), min_size=8, max_size=8),
    factor=st.floats(1.0, 3.0),
)
def test_bounded_load_spills_only_past_the_bound(
    producers: list[str], key: str, loads: list[int], factor: float
) -> None:
    ring = PrefixRing(producers)
    load = {pid: float(loads[i]) for i, pid in enumerate(producers)}
    chosen, spilled = ring.choose(key, load, factor)
    assert chosen in load
    limit = bound(list(load.values()), factor)
    assert limit >= math.ceil(factor * (sum(load.values()) + 1) / len(load))
    assert limit >= min(load.values()) + AFFINITY_SLACK
    home = ring.order(key)[0]
    if load[home] + 1 <= limit:
        assert (chosen, spilled) == (home, False)  # the prefix stays where its KV is
    else:
        assert spilled
        assert load[chosen] + 1 <= limit or all(load[p] + 1 > limit for p in load)


def test_a_few_requests_more_than_the_lightest_never_spill() -> None:
    """At low load a spill (a full prefill elsewhere, and that producer's own prefixes
    evicted) costs more than a short queue: the home keeps its prefix up to the slack."""
    ring = PrefixRing(["p0", "p1"])
    home, other = ring.order("system prompt")
    assert ring.choose("system prompt", {home: 3.0, other: 0.0}, 1.25) == (home, False)
    assert ring.choose("system prompt", {home: 4.0, other: 0.0}, 1.25) == (other, True)
    # at high load the relative bound decides: 1.25 x the mean
    assert ring.choose("system prompt", {home: 24.0, other: 16.0}, 1.25) == (home, False)
    assert ring.choose("system prompt", {home: 30.0, other: 16.0}, 1.25) == (other, True)


def test_a_ring_takes_only_placeable_producers() -> None:
    ring = PrefixRing(["p0", "p1", "p2"])
    chosen, _ = ring.choose("system prompt", {"p1": 0.0}, 1.25)
    assert chosen == "p1"
    assert ring.choose("x", {}, 1.25) == (None, False)


def test_requests_sharing_a_system_prompt_share_a_key() -> None:
    system = {"role": "system", "content": "You are a narwhal. " * 40}
    a = {"messages": [system, {"role": "user", "content": "first question"}]}
    b = {"messages": [system, {"role": "user", "content": "another one"}]}
    assert prefix_key(a, chat=True) == prefix_key(b, chat=True)
    assert len(prefix_key(a, chat=True)) == PREFIX_CHARS
    short = {"prompt": "tiny"}
    assert prefix_key(short, chat=False) == "tiny"
    assert prefix_key({"prompt": list(range(2000))}, chat=False).startswith("0 1 2")
