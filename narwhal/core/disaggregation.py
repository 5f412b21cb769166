"""Conditional disaggregation (contract 4.4, decode first), pure: whether an attempt skips the
remote prefill and is served by its consumer alone.

A remote prefill pays for itself when the prompt is long and not cached where it will be
decoded: the producer computes it without slowing anyone's decode, and the consumer pulls
the blocks it lacks. When the part the consumer does not hold is short (the next turn of a
conversation it served, a short prompt), the two hops, the descriptor and the pull cost
more than the consumer computing those tokens itself. And when every producer is saturated
while the consumer has room, waiting for a producer costs more than a local prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from narwhal.core.config import PlacementConfig

# local_one_engine: the only engine that may decode is the one placement chose to prefill
# (a fleet of one ``both`` engine, or the others down or failed): a handoff to itself would
# leave the prefill's blocks held for the lease, with nobody to read them
# local_predicted: policy "predicted" found the local plan the fastest (contract 4.8)
Decision = Literal[
    "local_short", "local_busy", "local_one_engine", "local_predicted", "disaggregated"
]
DECISIONS: tuple[Decision, ...] = (
    "local_short",
    "local_busy",
    "local_one_engine",
    "local_predicted",
    "disaggregated",
)


def wants_prompt_side(body: Mapping[str, Any]) -> bool:
    """Whether the answer carries what only a prefill leg computes (an echo, prompt
    logprobs, the prompt's token ids: contract 3's prompt side): such a request is never local."""
    return (
        bool(body.get("echo"))
        or body.get("prompt_logprobs") is not None
        or (body.get("return_token_ids") is True)
    )


def decode_first(config: PlacementConfig) -> bool:
    """Whether the consumer is chosen with the producer or before it (and an attempt may be
    local): conditional disaggregation, or policy "predicted", which weighs both at once."""
    predicted = config.policy == "predicted"
    return config.local_prefill_tokens > 0 or config.local_prefill_when_busy or predicted


def local_or_remote(
    uncached_tokens: int,
    config: PlacementConfig,
    *,
    producers_saturated: bool,
    consumer_saturated: bool,
) -> Decision:
    """Local because the uncached part is short, local because the producers are busy and
    the consumer is not, or disaggregated."""
    if config.local_prefill_tokens > 0 and uncached_tokens < config.local_prefill_tokens:
        return "local_short"
    if config.local_prefill_when_busy and producers_saturated and not consumer_saturated:
        return "local_busy"
    return "disaggregated"
