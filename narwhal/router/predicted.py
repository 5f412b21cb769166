"""Policy "predicted" in the shell (docs/contract.md 4.8): the candidates' sides as the cost
model reads them (``narwhal.core.plans``), the plan for an attempt, and what its legs teach
the model once they ended.

A ``Forecast`` is what an attempt's plan predicted and the inputs it was predicted from;
the legs' times are matched against those same inputs when they are learned, so a fit
learns the cost of what was actually asked of the engine.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from narwhal.core.config import FleetConfig
from narwhal.core.disaggregation import wants_prompt_side
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import Overloaded, Phase
from narwhal.core.fleet import Fleet
from narwhal.core.placement import Holdings, with_room
from narwhal.core.plans import Plan, Side, best, plans
from narwhal.core.policies import EngineLoad
from narwhal.core.prediction import CostModel
from narwhal.observe.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Forecast:
    """An attempt's plan and the sides it was predicted from."""

    plan: Plan
    producer: Side | None
    consumer: Side
    at: float  # when it was planned: its TTFT counts from here


def side(
    engine: EngineState, holdings: Holdings, now: float, interval_s: float, alone: bool = True
) -> Side:
    """One candidate as the cost model reads it for this request; ``alone``: an engine
    that only decodes may compute the prompt itself (one that may prefill always may)."""
    report = engine.report
    fresh = report is not None and report.fresh(now, interval_s)
    others = report.others if fresh and report is not None else 0.0
    return Side(
        engine.id,
        queued=engine.queued(now, interval_s),
        running=engine.running(now, interval_s),
        uncached=holdings.uncached(engine.id),
        load=EngineLoad(engine.id, engine.load, others).cost(consumer=False),
        alone=alone or engine.spec.can_prefill,
    )


def consumers_compute(fleet: Fleet, config: FleetConfig, now: float, model: str | None) -> bool:
    """Whether an engine that only decodes may compute a prompt itself: when every producer
    is saturated. A consumer's prefill stalls every stream it decodes, a cost to the others
    that one request's predicted TTFT and TPOT do not weigh: on the Mooncake replay, local
    plans on idle consumers doubled the TTFT p50 and raised TPOT from 241 to 427 ms
    (bench/results/replay). An engine of role ``both`` always may."""
    flow = config.admission
    limits = (config.placement.metrics_interval_s, flow.engine_waiting_limit, flow.kv_usage_limit)
    return fleet.saturated("prefill", now, *limits, model=model)


def candidates(
    fleet: Fleet,
    leg: Leg,
    model: str | None,
    avoid: Collection[str],
    now: float,
    config: FleetConfig,
) -> list[EngineState]:
    """The engines a plan may use for ``leg``: the placeable ones serving ``model``, of
    them those the attempt need not avoid (unless none is left), and of those the ones
    with room (unless none has: contract 4.5)."""
    pool, _ = fleet.placeable(leg, now, model)
    kept = [e for e in pool if e.id not in avoid] or pool
    if not kept:
        return kept
    return with_room(kept, leg, now, config.placement.metrics_interval_s, config.admission)


def plan_attempt(
    fleet: Fleet,
    config: FleetConfig,
    holdings: Holdings,
    now: float,
    *,
    model: str | None,
    avoid: Collection[str],
    cls: str,
    body: Mapping[str, Any],
) -> Forecast | None:
    """An attempt's plan for a request of class ``cls`` asking for ``model``, avoiding the
    engines its earlier attempts failed on (None: there is none)."""
    producers = candidates(fleet, "prefill", model, avoid, now, config)
    consumers = candidates(fleet, "decode", model, avoid, now, config)
    return forecast(
        producers,
        consumers,
        fleet.costs,
        holdings,
        now,
        config.placement.metrics_interval_s,
        local=not wants_prompt_side(body),
        alone=consumers_compute(fleet, config, now, model),
        tpot_slo_s=config.admission.targets(cls).tpot_slo_s,
        turn=fleet.turn,
    )


def beyond(target: float, least: float | None) -> Overloaded | None:
    """The 429 for a request whose fastest plan (``least``: its predicted TTFT with
    nothing queued, ``unqueued_ttft``) misses its class's TTFT ``target`` (contract 4.8);
    None: it may queue."""
    if least is None or least <= target:
        return None
    why = f"cannot meet ttft_slo_s={target:g}: the fastest plan takes {least:.3g}s"
    return Overloaded(why + " with nothing queued", phase=Phase.ADMISSION)


def unqueued_ttft(
    fleet: Fleet,
    config: FleetConfig,
    holdings: Holdings,
    now: float,
    model: str | None,
    body: Mapping[str, Any],
) -> float | None:
    """The least predicted TTFT of any plan with no queue ahead at any engine (None: no
    plan): what a request would take at best, whatever the queues do."""
    interval_s = config.placement.metrics_interval_s
    alone = consumers_compute(fleet, config, now, model)
    sides = [
        [replace(side(e, holdings, now, interval_s, alone), queued=0.0) for e in pool]
        for pool in (fleet.placeable(leg, now, model)[0] for leg in ("prefill", "decode"))
    ]
    found = plans(sides[0], sides[1], fleet.costs, local=not wants_prompt_side(body))
    return min((p.ttft_s for p in found), default=None)


def forecast(
    producers: Sequence[EngineState],
    consumers: Sequence[EngineState],
    costs: CostModel,
    holdings: Holdings,
    now: float,
    interval_s: float,
    *,
    local: bool,
    tpot_slo_s: float | None,
    alone: bool = True,
    turn: int = 0,
) -> Forecast | None:
    """The attempt's plan (None: there is none, such as no consumer); ``alone``: engines
    that only decode may compute a prompt too."""
    p_sides = {e.id: side(e, holdings, now, interval_s) for e in producers}
    c_sides = {e.id: side(e, holdings, now, interval_s, alone) for e in consumers}
    found = plans(list(p_sides.values()), list(c_sides.values()), costs, local=local)
    chosen = best(found, tpot_slo_s, turn)
    if chosen is None:
        return None
    producer = None if chosen.producer is None else p_sides[chosen.producer]
    return Forecast(chosen, producer, c_sides[chosen.consumer], now)


def learn_prefill(costs: CostModel, seen: Forecast, seconds: float, now: float) -> None:
    """A P/D attempt's prefill leg answered after ``seconds``."""
    producer = seen.producer
    if producer is not None:
        costs.saw_prefill(producer.id, producer.uncached, producer.queued, seconds, now)


def learn_decode(
    costs: CostModel,
    seen: Forecast,
    sent: float,
    first: float | None,
    last: float | None,
    tokens: int,
) -> None:
    """A decode leg that ended well, sent at ``sent``: its first token (a local leg's
    prefill, a P/D leg's transfer) and its time between tokens."""
    if first is None:
        return
    consumer, producer = seen.consumer, seen.producer
    if producer is None:
        costs.saw_prefill(consumer.id, consumer.uncached, consumer.queued, first - sent, first)
    else:  # less the consumer's wait for room, which the plan counts apart
        waited = costs.queued_s(consumer.id) * consumer.queued
        seconds = max(0.0, first - sent - waited)
        costs.saw_transfer(producer.id, consumer.id, consumer.uncached, seconds, first)
    if last is not None and tokens >= 2 and last > first:
        costs.saw_step(consumer.id, consumer.running + 1, (last - first) / (tokens - 1), last)


def account(
    metrics: Metrics,
    seen: Forecast,
    first: float | None,
    last: float | None,
    tokens: int,
    *,
    cls: str,
    tpot_slo_s: float | None,
) -> None:
    """A decode leg that ended well, against its plan: observed over predicted TTFT (by
    the engine that computed the prompt) and TPOT (by the consumer), and the class's TPOT
    target met or not."""
    if first is None:
        return
    plan = seen.plan
    computed = plan.producer or plan.consumer
    if plan.ttft_s > 0:
        ratio = (first - seen.at) / plan.ttft_s
        metrics.prediction_error.labels(computed, "ttft").observe(ratio)
    if last is None or tokens < 2 or last <= first:
        return
    tpot = (last - first) / (tokens - 1)
    if plan.tpot_s > 0:
        metrics.prediction_error.labels(plan.consumer, "tpot").observe(tpot / plan.tpot_s)
    if tpot_slo_s is not None:
        metrics.slo_of(cls, "tpot", "yes" if tpot <= tpot_slo_s else "no").inc()
