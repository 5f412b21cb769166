"""Placement: which producer and which consumer, as a pure function of fleet state (SPEC 4.4).

The candidates are the placeable engines of the leg's role (``Fleet.placeable``). Engines
a retry must avoid are used only when nothing else is left; then:

* one candidate: it (reason ``only``);
* a producer with prefix affinity: the prompt prefix's home on the ring unless it carries
  more than ``affinity_load_factor`` x the mean load, then the next under the bound
  (``affinity``, ``spill``);
* ``least_loaded``: the lighter of two random candidates (``least_loaded``);
* ``round_robin``: the next in rotation (``round_robin``).

Load is this router's legs on the engine plus the rest of the engine's queue from a fresh
scrape (the engine counts our legs too: they count once); a consumer's KV cache usage
weighs in. Ties prefer a consumer other than the producer, then
rotate with ``turn``, so equal engines share the load.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from narwhal.core.config import PlacementConfig
from narwhal.core.fleet import EngineState, Leg
from narwhal.core.policies import EngineLoad, PrefixRing, least_loaded

Reason = Literal["only", "affinity", "spill", "least_loaded", "round_robin"]
REASONS: tuple[Reason, ...] = ("only", "affinity", "spill", "least_loaded", "round_robin")


@dataclass(frozen=True, slots=True)
class Choice:
    engine: EngineState
    reason: Reason


def load_of(engine: EngineState, now: float, interval_s: float) -> EngineLoad:
    """What placement weighs: the engine's own report counts only while it is fresh."""
    report = engine.report
    if report is None or not report.fresh(now, interval_s):
        return EngineLoad(engine.id, engine.load)
    return EngineLoad(engine.id, engine.load, report.others, report.kv_usage)


def choose(
    candidates: Sequence[EngineState],
    leg: Leg,
    config: PlacementConfig,
    *,
    rng: random.Random,
    now: float,
    turn: int = 0,
    avoid: Collection[str] = (),
    prefer_not: str | None = None,
    key: str | None = None,
    ring: PrefixRing | None = None,
) -> Choice | None:
    """The engine for ``leg`` and why; None when there are no candidates. ``key`` is the
    request's prompt prefix (producers only), ``ring`` the producers' ring."""
    pool = [e for e in candidates if e.id not in avoid] or list(candidates)
    if len(pool) <= 1:
        return Choice(pool[0], "only") if pool else None
    consumer = leg == "decode"
    costs = {e.id: load_of(e, now, config.metrics_interval_s).cost(consumer=consumer) for e in pool}
    if not consumer and config.prefix_affinity and key is not None and ring is not None:
        home, spilled = ring.choose(key, costs, config.affinity_load_factor)
        for engine in pool:
            if engine.id == home:
                return Choice(engine, "spill" if spilled else "affinity")
    # the rotation is over the candidates' own order: fleet positions would tie producers
    # that sit two apart in the fleet file (p0, d0, p1), and one of them would take all
    position = {id(e): i for i, e in enumerate(candidates)}
    n = len(candidates)

    def rotation(e: EngineState) -> tuple[bool, int]:
        return e.id == prefer_not, (position[id(e)] - turn) % n

    if config.policy == "round_robin":
        return Choice(min(pool, key=rotation), "round_robin")
    chosen = least_loaded(pool, rng, lambda e: (costs[e.id], *rotation(e)))
    assert chosen is not None  # the pool has two or more
    return Choice(chosen, "least_loaded")
