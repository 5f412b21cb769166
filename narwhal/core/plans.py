"""One decision for policy "predicted", pure (docs/contract.md 4.8): the plan, local on one
engine or prefill on P and decode on C, with the least predicted TTFT whose predicted TPOT
meets the class's target.

* a local plan on C: C's queue ahead and its compute of the prompt tokens it does not hold
  (only where C may compute prompts, ``Side.alone``);
* a P/D plan: P's queue ahead and its compute of the tokens P does not hold, the transfer
  of the tokens C does not hold (a consumer pulls only what it lacks), and C's wait for
  room (its own queue ahead at its time per queued request);
* TPOT: C's step time at its running count plus this one.

Plans whose TTFTs differ by less than ``TIE_S`` or ``TIE_SHARE`` are tied, and a tie goes
to the lower load, then by rotation (equal engines share the work instead of the first one
taking it all).
With no plan that meets the TPOT target, the one of least TPOT is the answer: the request
is served as well as the fleet can, and its class's attainment says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.core.prediction import CostModel

TIE_S = 0.005
TIE_SHARE = 0.02


@dataclass(frozen=True, slots=True)
class Side:
    """One candidate engine as the model sees it for one request."""

    id: str
    queued: float  # its predicted waiting queue (contract 4.5) ahead of this request
    running: float  # the requests it runs now
    uncached: int  # the request's prompt tokens it does not hold
    load: float  # placement's load (ties)
    alone: bool = True  # it may compute a prompt itself (a local plan)


@dataclass(frozen=True, slots=True)
class Plan:
    producer: str | None  # None: local on the consumer
    consumer: str
    ttft_s: float
    tpot_s: float
    load: float


def local_plan(consumer: Side, model: CostModel) -> Plan:
    ttft = model.prefill_s(consumer.id, consumer.uncached, consumer.queued)
    tpot = model.step_s(consumer.id, consumer.running + 1)
    return Plan(None, consumer.id, ttft, tpot, consumer.load)


def split_plan(producer: Side, consumer: Side, model: CostModel) -> Plan:
    ttft = (
        model.prefill_s(producer.id, producer.uncached, producer.queued)
        + model.transfer_s(producer.id, consumer.id, consumer.uncached)
        + model.queued_s(consumer.id) * consumer.queued
    )
    tpot = model.step_s(consumer.id, consumer.running + 1)
    return Plan(producer.id, consumer.id, ttft, tpot, producer.load + consumer.load)


def plans(
    producers: Sequence[Side], consumers: Sequence[Side], model: CostModel, *, local: bool
) -> list[Plan]:
    """Every plan: local on each consumer that may compute prompts (``local``: the request
    may go local), and each producer with each consumer other than itself."""
    found = [local_plan(c, model) for c in consumers if c.alone] if local else []
    found += [split_plan(p, c, model) for p in producers for c in consumers if p.id != c.id]
    return found


def best(found: Sequence[Plan], tpot_slo_s: float | None = None, turn: int = 0) -> Plan | None:
    """The plan to run (None: there is none); ``turn`` rotates plans tied in load too, so
    engines the model cannot tell apart (none has samples yet) share the work and each is
    learned."""
    if not found:
        return None
    meets = [p for p in found if tpot_slo_s is None or p.tpot_s <= tpot_slo_s]
    if not meets:
        return min(found, key=lambda p: (p.tpot_s, p.ttft_s))
    least = min(p.ttft_s for p in meets)
    tied = [p for p in meets if p.ttft_s <= least + max(TIE_S, TIE_SHARE * least)]
    lightest = min(p.load for p in tied)
    tied = [p for p in tied if p.load == lightest]
    return tied[turn % len(tied)]
