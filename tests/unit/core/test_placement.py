"""Placement is a pure function of fleet state (contract 4.4)."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import AdmissionConfig, EngineSpec, PlacementConfig, RecoveryConfig
from narwhal.core.engine_report import EngineReport
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.fleet import Fleet
from narwhal.core.placement import Placed, choose
from narwhal.core.prefix_index import prompt_of

LEAST = PlacementConfig(prefix_affinity=False)
ROTATE = PlacementConfig(policy="round_robin", prefix_affinity=False)
AFFINITY = PlacementConfig()


def _fleet(*roles: str) -> Fleet:
    specs = tuple(EngineSpec(f"e{i}", f"http://h:{i + 1}", r) for i, r in enumerate(roles))  # type: ignore[arg-type]
    return Fleet(specs, RecoveryConfig())


def _id(fleet: Fleet, leg: Leg, config: PlacementConfig = LEAST, **kw: object) -> str:
    pool = fleet.producers if leg == "prefill" else fleet.consumers
    placed = choose(pool, leg, config, rng=random.Random(0), now=0.0, **kw)  # type: ignore[arg-type]
    assert placed is not None
    return placed.engine.id


def test_roles_decide_the_candidates() -> None:
    fleet = _fleet("prefill", "decode", "both")
    assert [e.id for e in fleet.producers] == ["e0", "e2"]
    assert [e.id for e in fleet.consumers] == ["e1", "e2"]


def test_fewest_legs_of_two_and_ties_rotate() -> None:
    fleet = _fleet("both", "both")
    fleet.engines[0].inflight["decode"] = 2
    assert _id(fleet, "decode") == "e1"
    fleet.engines[0].inflight["decode"] = 0
    assert [_id(fleet, "decode", turn=t) for t in range(4)] == ["e0", "e1", "e0", "e1"]
    assert _id(fleet, "decode", turn=0, other_leg="e0") == "e1"


def test_the_engines_own_queue_counts_while_fresh() -> None:
    fleet = _fleet("both", "both")
    fleet.engines[0].report = EngineReport(at=0.0, running=4, waiting=6, kv_usage=0.0)
    fleet.engines[1].inflight["prefill"] = 3
    assert _id(fleet, "prefill") == "e1"  # 10 queued there against 3 legs here
    stale = choose(fleet.producers, "prefill", LEAST, rng=random.Random(0), now=3.5)
    assert stale is not None
    assert stale.engine.id == "e0"


def test_our_own_legs_count_once() -> None:
    """The engine's queue counts the legs this router sent it: only the rest is added."""
    fleet = _fleet("both", "both")
    fleet.engines[0].inflight["prefill"] = 5  # ours, and all the engine runs
    fleet.engines[0].report = EngineReport(at=0.0, running=5, waiting=0, kv_usage=0.0, ours=5)
    fleet.engines[1].inflight["prefill"] = 2
    fleet.engines[1].report = EngineReport(at=0.0, running=2, waiting=4, kv_usage=0.0, ours=2)
    assert _id(fleet, "prefill") == "e0"  # 5 against 2 + 4 others (counted twice: 10 to 8)


def test_a_full_kv_cache_steers_decode_only() -> None:
    fleet = _fleet("both", "both")
    fleet.engines[0].report = EngineReport(at=0.0, running=0, waiting=0, kv_usage=0.9)
    fleet.engines[1].inflight["decode"] = 2
    assert _id(fleet, "decode") == "e1"
    assert _id(fleet, "prefill") == "e0"


def test_avoided_engines_only_when_nothing_else_is_left() -> None:
    fleet = _fleet("both", "both")
    fleet.engines[1].inflight["decode"] = 5
    assert _id(fleet, "decode", avoid={"e0"}) == "e1"
    assert _id(fleet, "decode", avoid={"e0", "e1"}) == "e0"
    assert choose([], "decode", LEAST, rng=random.Random(0), now=0.0) is None


def test_round_robin_rotates_over_the_role_wherever_it_sits_in_the_fleet() -> None:
    fleet = _fleet("prefill", "decode", "prefill", "decode", "prefill")
    picks = [_id(fleet, "prefill", ROTATE, turn=t) for t in range(6)]
    assert picks == ["e0", "e2", "e4", "e0", "e2", "e4"]
    assert [_id(fleet, "decode", LEAST, turn=t) for t in range(4)] == ["e1", "e3", "e1", "e3"]


def test_round_robin_rotates_whatever_the_load() -> None:
    fleet = _fleet("both", "both", "both")
    fleet.engines[1].inflight["prefill"] = 9
    picks = [_id(fleet, "prefill", ROTATE, turn=t) for t in range(6)]
    assert picks == ["e0", "e1", "e2", "e0", "e1", "e2"]


def test_a_shared_prefix_stays_on_one_producer_until_it_is_loaded() -> None:
    fleet = _fleet("prefill", "prefill", "prefill", "decode")
    key = "system: you are a helpful assistant " * 10
    home = _id(fleet, "prefill", AFFINITY, key=key, ring=fleet.ring)
    assert {
        _id(fleet, "prefill", AFFINITY, key=key, ring=fleet.ring, turn=t) for t in range(5)
    } == {home}
    fleet.by_id[home].inflight["prefill"] = 10  # far past 1.25 x the mean
    placed = choose(
        fleet.producers,
        "prefill",
        AFFINITY,
        rng=random.Random(0),
        now=0.0,
        key=key,
        ring=fleet.ring,
    )
    assert placed is not None
    assert placed.engine.id != home
    assert placed.reason == "spill"


@given(
    inflight=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    unhealthy=st.sets(st.integers(0, 5)),
    avoid=st.sets(st.integers(0, 5)),
    seed=st.integers(0, 2**32),
    policy=st.sampled_from(["least_loaded", "round_robin"]),
    affinity=st.booleans(),
    key=st.text(max_size=20),
)
def test_never_an_engine_that_is_not_placeable(
    inflight: list[int],
    unhealthy: set[int],
    avoid: set[int],
    seed: int,
    policy: str,
    affinity: bool,
    key: str,
) -> None:
    """Whatever the loads, policy and avoid set: a placeable engine, and one outside the
    avoid set whenever there is one."""
    fleet = _fleet(*["prefill"] * len(inflight))
    for i, (engine, legs) in enumerate(zip(fleet.engines, inflight, strict=True)):
        engine.inflight["prefill"] = legs
        if i in unhealthy:
            engine.breaker.quarantined_until = 1e9
            engine.breaker.quarantine_s = 1e9
    candidates, _ = fleet.placeable("prefill", 0.0)
    avoided = {f"e{i}" for i in avoid}
    config = PlacementConfig(policy=policy, prefix_affinity=affinity)  # type: ignore[arg-type]
    placed = choose(
        candidates,
        "prefill",
        config,
        rng=random.Random(seed),
        now=0.0,
        avoid=avoided,
        key=key,
        ring=fleet.ring,
    )
    assert isinstance(placed, Placed)
    assert placed.engine in candidates
    if any(e.id not in avoided for e in candidates):
        assert placed.engine.id not in avoided


def test_equal_engines_share_the_load_under_least_loaded() -> None:
    fleet = _fleet(*["decode"] * 4)
    rng, seen = random.Random(7), Counter[str]()
    for turn in range(400):
        placed = choose(fleet.consumers, "decode", LEAST, rng=rng, now=0.0, turn=turn)
        assert placed is not None
        placed.engine.inflight["decode"] += 1
        seen[placed.engine.id] += 1
    assert max(seen.values()) - min(seen.values()) <= 4, seen


async def test_reservations_release_on_every_exit_path() -> None:
    fleet = _fleet("both")
    engine = fleet.engines[0]
    async with fleet.reserve(engine, "prefill"):
        assert engine.inflight == {"prefill": 1, "decode": 0}
    try:
        async with fleet.reserve(engine, "decode"):
            raise RuntimeError("leg failed")
    except RuntimeError:
        pass
    assert fleet.reserved() == 0


def _held(fleet: Fleet, engine: str, text: str) -> None:
    fleet.prefixes.record(engine, prompt_of({"prompt": text}, chat=False).blocks, 0.0)


def _indexed(fleet: Fleet, leg: Leg, text: str, **kw: object) -> Placed:
    pool = fleet.producers if leg == "prefill" else fleet.consumers
    prompt = prompt_of({"prompt": text}, chat=False)
    placed = choose(
        pool,
        leg,
        AFFINITY,
        rng=random.Random(0),
        now=1.0,
        key=text[:512],
        ring=fleet.ring,
        prompt=prompt,
        index=fleet.prefixes,
        **kw,  # type: ignore[arg-type]
    )
    assert placed is not None
    return placed


def test_both_legs_go_to_the_longest_indexed_match() -> None:
    fleet = _fleet("prefill", "prefill", "decode", "decode", "decode")
    shared = "s" * 1024
    _held(fleet, "e0", shared)
    _held(fleet, "e1", shared + "t" * 640)  # the conversation's last turn went here
    _held(fleet, "e3", shared + "t" * 640 + "reply" * 40)
    text = shared + "t" * 640 + "reply" * 40 + "next question"
    assert _indexed(fleet, "prefill", text) == Placed(fleet.by_id["e1"], "prefix_match")
    assert _indexed(fleet, "decode", text) == Placed(fleet.by_id["e3"], "prefix_match")


def test_a_match_over_the_load_bound_falls_back() -> None:
    fleet = _fleet("decode", "decode", "decode")
    text = "q" * 2048
    _held(fleet, "e0", text)
    fleet.by_id["e0"].inflight["decode"] = 9  # far over the mean and the lightest + 4
    placed = _indexed(fleet, "decode", text)
    assert placed.engine.id != "e0"
    assert placed.reason == "least_loaded"


def test_a_text_never_seen_still_goes_by_the_ring() -> None:
    fleet = _fleet("prefill", "prefill", "prefill")
    text = "never seen " * 100
    assert _indexed(fleet, "prefill", text).reason == "affinity"
    assert _indexed(fleet, "prefill", text).engine.id == fleet.ring.order(text[:512])[0]


def test_equal_matches_keep_the_ring_order_for_producers() -> None:
    fleet = _fleet("prefill", "prefill", "prefill")
    text = "system prompt " * 100
    for engine in ("e0", "e1", "e2"):
        _held(fleet, engine, text)
    home = fleet.ring.order(text[:512])[0]
    assert _indexed(fleet, "prefill", text + " a question") == Placed(
        fleet.by_id[home], "prefix_match"
    )


def test_equal_matches_go_to_the_consumer_that_recorded_them_last() -> None:
    fleet = _fleet("both", "decode")
    text = "a conversation so far " * 30
    blocks = prompt_of({"prompt": text}, chat=False).blocks
    fleet.prefixes.record("e1", blocks, 0.5)  # the last turn's decode, after ...
    fleet.prefixes.record("e0", blocks, 0.2)  # ... its prefill on the other engine
    fleet.by_id["e1"].inflight["decode"] = 2  # a little busier: still under the bound
    assert _indexed(fleet, "decode", text + " next") == Placed(fleet.by_id["e1"], "prefix_match")


# ---- saturated engines (contract 4.5) --------------------------------------------------------

LIMITS = AdmissionConfig()  # saturated at 2 waiting, or a consumer at 95% of its KV cache
NEVER_FULL = AdmissionConfig(engine_waiting_limit=10**6, kv_usage_limit=1.0)
SHARED = "".join(f"{n:063d}\n" for n in range(4))  # four 64-byte blocks every prompt starts with


def _saturate(fleet: Fleet, engine: str, waiting: int = 2, kv: float = 0.0) -> None:
    """The engine's fresh report: ``waiting`` legs in its queue (another router's)."""
    fleet.by_id[engine].report = EngineReport(at=0.0, running=1, waiting=waiting, kv_usage=kv)


def test_a_saturated_holder_of_the_prefix_is_passed_over_while_another_has_room() -> None:
    fleet = _fleet("prefill", "prefill")
    _held(fleet, "e0", SHARED)  # a block every prompt shares: e0 matches every request
    assert _indexed(fleet, "prefill", SHARED + "own").engine.id == "e0"
    _saturate(fleet, "e0")
    assert _indexed(fleet, "prefill", SHARED + "own") == Placed(fleet.by_id["e1"], "room")


def test_among_several_with_room_the_rules_still_choose() -> None:
    fleet = _fleet("prefill", "prefill", "prefill")
    text = SHARED + "own"
    home, second, third = fleet.ring.order(text[:512])
    for engine in (home, second):
        _held(fleet, engine, SHARED)
    _held(fleet, home, text)  # the longest match of all
    _saturate(fleet, home)
    assert _indexed(fleet, "prefill", text) == Placed(fleet.by_id[second], "prefix_match")
    _saturate(fleet, second)
    _held(fleet, third, SHARED)
    fleet.by_id[home].report = None  # room again: the longest match takes it back
    assert _indexed(fleet, "prefill", text) == Placed(fleet.by_id[home], "prefix_match")


def test_a_saturated_home_on_the_ring_spills_to_the_next_with_room() -> None:
    fleet = _fleet("prefill", "prefill", "prefill")
    text = "never seen " * 100
    home, second, _ = fleet.ring.order(text[:512])
    _saturate(fleet, home)
    assert _indexed(fleet, "prefill", text) == Placed(fleet.by_id[second], "spill")


def test_a_saturated_consumer_is_passed_over_whatever_it_holds() -> None:
    fleet = _fleet("decode", "decode", "decode")
    text = SHARED + "the conversation so far"
    _held(fleet, "e0", text)
    assert _indexed(fleet, "decode", text + ", and more").engine.id == "e0"
    _saturate(fleet, "e0")  # under the load bound still: only its queue says no
    assert _indexed(fleet, "decode", text + ", and more").engine.id != "e0"


def test_with_every_candidate_saturated_affinity_works_as_before() -> None:
    fleet = _fleet("prefill", "prefill")
    _held(fleet, "e0", SHARED)
    _saturate(fleet, "e0", waiting=4)
    _saturate(fleet, "e1", waiting=2)
    assert _indexed(fleet, "prefill", SHARED + "own") == Placed(fleet.by_id["e0"], "prefix_match")
    text = "never seen " * 100
    home = fleet.ring.order(text[:512])[0]
    assert _indexed(fleet, "prefill", text) == Placed(fleet.by_id[home], "affinity")


def test_the_limits_given_say_when_an_engine_is_saturated() -> None:
    fleet = _fleet("prefill", "prefill")
    _held(fleet, "e0", SHARED)
    _saturate(fleet, "e0", waiting=2)  # saturated at the default limit, 2
    roomier = AdmissionConfig(engine_waiting_limit=3)
    assert _indexed(fleet, "prefill", SHARED + "own", limits=roomier).engine.id == "e0"
    assert _indexed(fleet, "prefill", SHARED + "own").engine.id == "e1"


@given(
    loads=st.lists(
        st.tuples(
            st.integers(0, 6),  # this router's legs on it
            st.integers(0, 3),  # its scraped waiting queue
            st.sampled_from([0.0, 0.5, 0.97]),  # its KV cache usage
            st.integers(0, 4),  # how many of the shared blocks it is believed to hold
        ),
        min_size=2,
        max_size=5,
    ),
    leg=st.sampled_from(["prefill", "decode"]),
    avoid=st.sets(st.integers(0, 4)),
    seed=st.integers(0, 2**32),
    policy=st.sampled_from(["least_loaded", "round_robin"]),
    affinity=st.booleans(),
    own=st.text(max_size=30),
)
def test_never_a_saturated_engine_while_another_has_room(
    loads: list[tuple[int, int, float, int]],
    leg: Leg,
    avoid: set[int],
    seed: int,
    policy: str,
    affinity: bool,
    own: str,
) -> None:
    """Whatever the policy, the loads, what each engine holds and the avoid set: an engine
    with room whenever one outside the avoid set has room; and when none has room or all
    have, the placed is the one the rules make with saturation left out."""
    fleet = _fleet(*["both"] * len(loads))
    for engine, (legs, waiting, kv, blocks) in zip(fleet.engines, loads, strict=True):
        engine.inflight[leg] = legs
        engine.report = EngineReport(at=0.0, running=legs, waiting=waiting, kv_usage=kv, ours=legs)
        if blocks:
            _held(fleet, engine.id, SHARED[: 64 * blocks])
    config = PlacementConfig(policy=policy, prefix_affinity=affinity)  # type: ignore[arg-type]
    avoided = {f"e{i}" for i in avoid}
    text = SHARED + own

    def place(limits: AdmissionConfig) -> Placed | None:
        return choose(
            fleet.engines,
            leg,
            config,
            rng=random.Random(seed),
            now=1.0,
            avoid=avoided,
            key=text[:512] if leg == "prefill" else None,
            ring=fleet.ring,
            prompt=prompt_of({"prompt": text}, chat=False),
            index=fleet.prefixes,
            limits=limits,
        )

    placed = place(LIMITS)
    assert placed is not None
    allowed = [e for e in fleet.engines if e.id not in avoided] or fleet.engines

    def room(engine: EngineState) -> int:
        return engine.room(1.0, 1.0, LIMITS.engine_waiting_limit, LIMITS.kv_usage_limit, leg)[0]

    roomy = [e for e in allowed if room(e) > 0]
    if roomy:
        assert placed.engine in roomy
    if len(roomy) in (0, len(allowed)):
        unchanged = place(NEVER_FULL)
        assert unchanged is not None
        assert placed.engine is unchanged.engine


@given(
    producers=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=4),
    consumers=st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1)), min_size=1, max_size=4),
    blocks=st.integers(0, 4),
    seed=st.integers(0, 2**32),
)
def test_when_the_queue_sees_room_placement_goes_where_the_room_is(
    producers: list[tuple[int, int]],
    consumers: list[tuple[int, float]],
    blocks: int,
    seed: int,
) -> None:
    """The admission queue dispatches a request while the fleet has room for it
    (``Fleet.headroom``); its legs then go to engines with room, never to a saturated one
    that holds its prefix."""
    fleet = _fleet(*["prefill"] * len(producers), *["decode"] * len(consumers))
    states = [*producers, *[(waiting, 0.0) for waiting, _ in consumers]]
    kvs = [0.0] * len(producers) + [kv for _, kv in consumers]
    for engine, (legs, waiting), kv in zip(fleet.engines, states, kvs, strict=True):
        engine.report = EngineReport(at=0.0, running=legs, waiting=waiting, kv_usage=kv)
        _held(fleet, engine.id, SHARED[: 64 * max(1, blocks)])
    limits = (1.0, LIMITS.engine_waiting_limit, LIMITS.kv_usage_limit)
    if not fleet.headroom(1.0, *limits):
        return
    text = SHARED + "own"
    for leg in ("prefill", "decode"):
        candidates, _ = fleet.placeable(leg, 1.0)  # type: ignore[arg-type]
        placed = choose(
            candidates,
            leg,  # type: ignore[arg-type]
            AFFINITY,
            rng=random.Random(seed),
            now=1.0,
            key=text[:512] if leg == "prefill" else None,
            ring=fleet.ring,
            prompt=prompt_of({"prompt": text}, chat=False),
            index=fleet.prefixes,
        )
        assert placed is not None
        assert placed.engine.room(1.0, *limits, leg)[0] > 0  # type: ignore[arg-type]
