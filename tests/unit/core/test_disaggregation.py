"""Conditional disaggregation (contract 4.4, decode first) as a pure decision."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import PlacementConfig
from narwhal.core.disaggregation import decode_first, local_or_remote, wants_prompt_side

ALWAYS = PlacementConfig()
SHORT = PlacementConfig(local_prefill_tokens=256)
BUSY = PlacementConfig(local_prefill_when_busy=True)


def test_always_pd_by_default() -> None:
    assert not decode_first(ALWAYS)
    assert local_or_remote(1, ALWAYS, producers_saturated=True, consumer_saturated=False) == (
        "disaggregated"
    )


def test_below_the_threshold_is_local_at_or_above_is_not() -> None:
    assert decode_first(SHORT)
    assert local_or_remote(255, SHORT, producers_saturated=False, consumer_saturated=False) == (
        "local_short"
    )
    assert local_or_remote(256, SHORT, producers_saturated=False, consumer_saturated=True) == (
        "disaggregated"
    )


def test_busy_producers_send_it_to_a_consumer_with_room_only() -> None:
    assert decode_first(BUSY)
    assert local_or_remote(10_000, BUSY, producers_saturated=True, consumer_saturated=False) == (
        "local_busy"
    )
    assert local_or_remote(10_000, BUSY, producers_saturated=True, consumer_saturated=True) == (
        "disaggregated"
    )
    assert local_or_remote(10_000, BUSY, producers_saturated=False, consumer_saturated=False) == (
        "disaggregated"
    )


@given(
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=10_000),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_local_only_when_a_rule_says_so(
    uncached: int, threshold: int, when_busy: bool, producers: bool, consumer: bool
) -> None:
    config = PlacementConfig(local_prefill_tokens=threshold, local_prefill_when_busy=when_busy)
    decision = local_or_remote(
        uncached, config, producers_saturated=producers, consumer_saturated=consumer
    )
    short = threshold > 0 and uncached < threshold
    busy = when_busy and producers and not consumer
    assert (decision != "disaggregated") == (short or busy)
    assert decision != "local_busy" or not short


def test_the_prompt_side_needs_the_producer() -> None:
    assert wants_prompt_side({"echo": True})
    assert wants_prompt_side({"prompt_logprobs": 0})
    assert wants_prompt_side({"return_token_ids": True})
    assert not wants_prompt_side({"echo": False, "logprobs": 2, "prompt": "x"})
