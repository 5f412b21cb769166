"""One decision for policy "predicted" (contract 4.8): the plan of least predicted TTFT
whose TPOT meets the class's target, ties to the lower load."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import PredictionConfig
from narwhal.core.plans import TIE_S, TIE_SHARE, Plan, Side, best, plans
from narwhal.core.prediction import CostModel

PROMPT = 16_000  # tokens: 2 s at the prior's 8,000 tokens a second


def idle(engine: str, uncached: int = PROMPT, **kw: float) -> Side:
    values = {"queued": 0.0, "running": 0.0, "load": 0.0, **kw}
    return Side(engine, uncached=uncached, **values)  # type: ignore[arg-type]


def model() -> CostModel:
    return CostModel(PredictionConfig())


def test_a_long_prompt_goes_to_the_producer_that_holds_it_over_an_idle_one() -> None:
    chosen = best(plans([idle("p0", 800), idle("p1")], [idle("d0")], model(), local=False))
    assert chosen is not None
    assert chosen.producer == "p0"


def test_and_to_the_idle_one_when_the_holder_is_deeply_queued() -> None:
    costs = model()
    chosen = best(plans([idle("p0", 800, queued=12), idle("p1")], [idle("d0")], costs, local=False))
    assert chosen is not None
    assert chosen.producer == "p1"


def test_a_short_uncached_part_is_computed_by_the_consumer_itself() -> None:
    """The next turn of a conversation its consumer served: a transfer would cost more
    than the few tokens left."""
    chosen = best(plans([idle("p0")], [idle("d0", uncached=16)], model(), local=True))
    assert chosen is not None
    assert chosen.producer is None
    assert chosen.consumer == "d0"


def test_a_busy_producer_sends_the_prompt_to_a_consumer_with_room() -> None:
    found = plans([idle("p0", queued=8)], [idle("d0")], model(), local=True)
    chosen = best(found)
    assert chosen is not None
    assert chosen.producer is None
    assert best(plans([idle("p0", queued=8)], [idle("d0")], model(), local=False)) is not None


def test_a_tpot_target_passes_over_a_crowded_consumer() -> None:
    costs = model()
    for i in range(40):  # d0 runs 10 ms a step per running request
        costs.saw_step("d0", 1 + i % 30, 0.01 * (1 + i % 30), now=float(i))
    consumers = [idle("d0", uncached=0, running=20), idle("d1", running=1)]
    fastest = best(plans([idle("p0")], consumers, costs, local=True))
    assert fastest is not None
    assert fastest.consumer == "d0"
    chosen = best(plans([idle("p0")], consumers, costs, local=True), tpot_slo_s=0.1)
    assert chosen is not None
    assert chosen.consumer == "d1"


def test_ties_go_to_the_lower_load() -> None:
    producers = [idle("p0", load=3), idle("p1", load=1)]
    chosen = best(plans(producers, [idle("d0")], model(), local=False))
    assert chosen is not None
    assert chosen.producer == "p1"


def test_no_consumer_no_plan() -> None:
    assert best(plans([idle("p0")], [], model(), local=True)) is None
    assert best(plans([idle("e0")], [idle("e0")], model(), local=False)) is None  # itself


sides = st.builds(
    Side,
    id=st.sampled_from(["e0", "e1", "e2", "e3"]),
    queued=st.floats(0, 20),
    running=st.floats(0, 64),
    uncached=st.integers(0, 100_000),
    load=st.floats(0, 50),
)


@given(
    st.lists(sides, max_size=4, unique_by=lambda s: s.id),
    st.lists(sides, max_size=4, unique_by=lambda s: s.id),
    st.booleans(),
    st.none() | st.floats(0.001, 0.2),
)
def test_the_choice_is_within_a_tie_of_the_fastest_that_meets_the_target(
    producers: list[Side], consumers: list[Side], local: bool, target: float | None
) -> None:
    found = plans(producers, consumers, model(), local=local)
    chosen = best(found, target)
    if not found:
        assert chosen is None
        return
    assert chosen is not None
    assert all(p.producer != p.consumer for p in found)
    meets = [p for p in found if target is None or p.tpot_s <= target]
    if not meets:  # none can: the least TPOT
        assert chosen.tpot_s == min(p.tpot_s for p in found)
        return
    least = min(p.ttft_s for p in meets)
    assert chosen in meets
    assert chosen.ttft_s <= least + max(TIE_S, TIE_SHARE * least)
    tied: list[Plan] = [p for p in meets if p.ttft_s <= least + max(TIE_S, TIE_SHARE * least)]
    assert chosen.load == min(p.load for p in tied)


def test_an_engine_that_only_decodes_computes_no_prompt_unless_it_may() -> None:
    """While a producer has room, a consumer's prefill would stall every stream it decodes:
    its local plan is not offered (``Side.alone`` False), however fast it looks."""
    busy, idle_consumer = idle("p0", queued=8), idle("d0", uncached=16, alone=False)
    chosen = best(plans([busy], [idle_consumer], model(), local=True))
    assert chosen is not None
    assert chosen.producer == "p0"
