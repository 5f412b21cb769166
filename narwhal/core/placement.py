"""Placement: which producer and which consumer, as a pure function of fleet state (contract 4.4).

The candidates are the placeable engines of the leg's role (``Fleet.placeable``). Engines
a retry must avoid are used only when nothing else is left. Saturated candidates (no room
by ``EngineState.room``, the admission queue's own measure, contract 4.5) are passed over
whenever another candidate has room, whatever the rules below prefer. The queue dispatches
a request while any engine of the role has room; a rule that then sends it to a saturated
one leaves it waiting in that engine's queue while another idles, and when every prompt
shares a first block, prefix affinity sent every prefill to the one producer that held it
until requests were shed. So a cached prefix, however small a part of the prompt, buys at
most a queue below ``engine_waiting_limit`` while another engine has room; with every
candidate saturated the rules choose among all of them, as before. Then:

* one candidate: it (reason ``only``); one of several with room: it (``room``);
* a request for a LoRA adapter, with ``adapter_affinity``: among the candidates under the
  load bound, the cheapest for the adapter (``lora_slots.tier``): those that have it
  loaded (running or waiting on it, or idle in a slot by what this router placed there or
  saw running), else those with a free adapter slot, else those that swap out an idle
  adapter, else those where it runs but another adapter waits for its slot, else the rest
  (a swap that waits); one left: it (``adapter``), several: the rules below among them;
* with prefix affinity, the engine the prefix index believes holds the longest leading part
  of the prompt, among those under the load bound (``prefix_match``; equal matches go by
  the ring's order for producers, by load for consumers);
* else a producer with prefix affinity: the prompt prefix's home on the ring unless it
  carries more than ``affinity_load_factor`` x the mean load, then the next under the bound
  (``affinity``, ``spill``): a text never seen still lands on one producer;
* ``least_loaded``: the lighter of two random candidates (``least_loaded``);
* ``round_robin``: the next in rotation (``round_robin``).

Load is this router's legs on the engine plus the rest of the engine's queue from a fresh
scrape (the engine counts our legs too: they count once); a consumer's KV cache usage
weighs in. Ties rotate with ``turn``, so equal engines share the load; an attempt's two
legs go to two engines whenever there are two.

The shell notes the engine chosen for an adapter's request as holding that adapter
(``RecentAdapters.placed``), since the request is on its way there and the engine's series
may never show it (a prefill can end between two scrapes).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from narwhal.core.config import AdmissionConfig, PlacementConfig
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.lora_slots import SLOT_FREE, tier
from narwhal.core.policies import EngineLoad, PrefixRing, bound, least_loaded
from narwhal.core.precise_index import PreciseIndex, TokenPrompt
from narwhal.core.prefix_index import BLOCK_TOKENS, PrefixIndex, Prompt

# the queue's limits when the caller gives none: the defaults, so that no caller places on a
# saturated engine by leaving them out
DEFAULT_LIMITS = AdmissionConfig()

# predicted: policy "predicted" chose the attempt's plan (narwhal.core.plans)
Reason = Literal[
    "only",
    "room",
    "adapter",
    "prefix_match",
    "affinity",
    "spill",
    "least_loaded",
    "round_robin",
    "predicted",
]
REASONS: tuple[Reason, ...] = get_args(Reason)


@dataclass(frozen=True, slots=True)
class Placed:
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
    other_leg: str | None = None,
    key: str | None = None,
    ring: PrefixRing | None = None,
    prompt: Prompt | None = None,
    index: PrefixIndex | None = None,
    precise: PreciseIndex | None = None,
    tokens: TokenPrompt | None = None,
    adapter: str | None = None,
    limits: AdmissionConfig = DEFAULT_LIMITS,
) -> Placed | None:
    """The engine for ``leg`` and why; None when there are no candidates. ``key`` is the
    request's prompt prefix (producers only), ``ring`` the producers' ring, ``prompt`` and
    ``index`` the request's blocks and what each engine is believed to hold; ``precise``
    and ``tokens`` what engines with a live event stream say they hold, and the request's
    token ids (``held_tokens``); ``adapter`` the LoRA adapter it runs under. ``other_leg``
    is the engine that runs the attempt's other leg: it is chosen only when no other
    candidate is left, since a handoff to the producer itself would leave the prefill's
    blocks held for the lease with nobody to read them. ``limits``: the admission queue's
    ``engine_waiting_limit`` and ``kv_usage_limit``, which say when an engine is saturated."""
    pool = [e for e in candidates if e.id not in avoid] or list(candidates)
    pool = [e for e in pool if e.id != other_leg] or pool
    if len(pool) <= 1:
        return Placed(pool[0], "only") if pool else None
    roomy = with_room(pool, leg, now, config.metrics_interval_s, limits)
    if len(roomy) == 1:
        return Placed(roomy[0], "room")
    # every candidate's id when some have no room: the ring's home is the first of them
    everyone = {e.id for e in pool} if len(roomy) < len(pool) else None
    pool = roomy
    consumer = leg == "decode"
    costs = {e.id: load_of(e, now, config.metrics_interval_s).cost(consumer=consumer) for e in pool}
    if adapter is not None and config.adapter_affinity:
        pool = with_adapter(pool, adapter, costs, config, now)
        if len(pool) == 1:
            return Placed(pool[0], "adapter")
    if config.prefix_affinity and prompt is not None and index is not None:
        ranked = ring if not consumer else None  # producers' equal matches: the ring's order
        holdings = Holdings(prompt, index, now, precise, tokens)
        held = longest_match(pool, costs, config.affinity_load_factor, holdings, ranked, key)
        if held is not None:
            return Placed(held, "prefix_match")
    if not consumer and config.prefix_affinity and key is not None and ring is not None:
        home, spilled = ring.choose(key, costs, config.affinity_load_factor)
        if everyone is not None:  # a home with no room was passed over: a spill too
            spilled = spilled or home != next((p for p in ring.order(key) if p in everyone), home)
        for engine in pool:
            if engine.id == home:
                return Placed(engine, "spill" if spilled else "affinity")
    # the rotation is over the candidates' own order: fleet positions would tie producers
    # that sit two apart in the fleet file (p0, d0, p1), and one of them would take all
    position = {id(e): i for i, e in enumerate(candidates)}
    n = len(candidates)

    def rotation(e: EngineState) -> int:
        return (position[id(e)] - turn) % n

    if config.policy == "round_robin":
        return Placed(min(pool, key=rotation), "round_robin")
    chosen = least_loaded(pool, rng, lambda e: (costs[e.id], rotation(e)))
    assert chosen is not None  # the pool has two or more
    return Placed(chosen, "least_loaded")


def with_room(
    pool: Sequence[EngineState], leg: Leg, now: float, interval_s: float, limits: AdmissionConfig
) -> list[EngineState]:
    """The candidates that are not saturated for ``leg`` (contract 4.5), or all of them when
    every one is: a request is never held for a saturated engine while another has room,
    and with none left the rules weigh them all as before."""
    waiting, kv = limits.engine_waiting_limit, limits.kv_usage_limit
    roomy = [e for e in pool if e.room(now, interval_s, waiting, kv, leg)[0] > 0]
    return roomy or list(pool)


def adapter_tier(engine: EngineState, adapter: str, now: float, interval_s: float) -> int:
    """What a request for ``adapter`` costs the engine (``lora_slots.tier``), by its fresh
    report and the adapters it ran last. No fresh adapter series counts as a free slot:
    nothing says it would swap."""
    report = engine.report
    lora = report.lora if report is not None and report.fresh(now, interval_s) else None
    if lora is None:
        return SLOT_FREE
    return tier(lora, engine.adapters.recent(), adapter)


def with_adapter(
    pool: Sequence[EngineState],
    adapter: str,
    costs: dict[str, float],
    config: PlacementConfig,
    now: float,
) -> list[EngineState]:
    """The candidates that serve ``adapter`` cheapest, among those under the load bound
    (an adapter's hot engine still spills when it carries far more than the rest)."""
    limit = bound(list(costs.values()), config.affinity_load_factor)
    under = [e for e in pool if costs[e.id] + 1 <= limit] or list(pool)
    tiers = [adapter_tier(e, adapter, now, config.metrics_interval_s) for e in under]
    best = min(tiers)
    return [e for e, tier in zip(under, tiers, strict=True) if tier == best]


@dataclass(frozen=True, slots=True)
class Holdings:
    """What each engine holds of one request's prompt: the engine's own word where its
    event stream is live and the request's token ids are known, else the approximate
    index's belief."""

    prompt: Prompt
    index: PrefixIndex
    now: float
    precise: PreciseIndex | None = None
    tokens: TokenPrompt | None = None

    def held(self, engine_id: str) -> int:
        """The prompt's leading tokens the engine holds: exact from a live stream, else
        the approximate index's blocks at ``BLOCK_TOKENS`` each."""
        if self.precise is not None and self.tokens is not None:
            stream = self.precise.live(engine_id)
            if stream is not None:
                return self.tokens.held(stream)
        return self.index.match(engine_id, self.prompt.blocks, self.now) * BLOCK_TOKENS

    def uncached(self, engine_id: str) -> int:
        """The tokens the engine would compute: exact with token ids and a live stream."""
        live = self.precise is not None and self.precise.live(engine_id) is not None
        if self.tokens is not None and live:
            return max(0, self.tokens.tokens - self.held(engine_id))
        return self.prompt.uncached(self.held(engine_id) // BLOCK_TOKENS)

    def recorded_at(self, engine_id: str) -> float:
        """When the approximate index last recorded the prompt's blocks it holds there."""
        blocks = self.index.match(engine_id, self.prompt.blocks, self.now)
        return self.index.recorded_at(engine_id, self.prompt.blocks, blocks)


def longest_match(
    pool: Sequence[EngineState],
    costs: dict[str, float],
    load_factor: float,
    holdings: Holdings,
    ring: PrefixRing | None = None,
    key: str | None = None,
) -> EngineState | None:
    """The engine under the load bound that holds the longest leading part of the prompt
    (None: no such engine holds a block of it). Equal matches go by ``ring``'s order from
    ``key`` (so a shared prefix stays on one producer while it may), then to the one that
    recorded them last (a consumer that served the last turn holds its reply's partial
    block too), then by load."""
    limit = bound(list(costs.values()), load_factor)
    found = []
    for engine in pool:
        if costs[engine.id] + 1 > limit:
            continue
        held = holdings.held(engine.id)
        if held:
            found.append((engine, held, holdings.recorded_at(engine.id)))
    if len(found) <= 1:  # none, or no tie to break: the ring's order is not worked out
        return found[0][0] if found else None
    order = ring.order(key) if ring is not None and key is not None else []
    rank = {engine_id: i for i, engine_id in enumerate(order)}

    def score(item: tuple[EngineState, int, float]) -> tuple[int, int, float, float]:
        engine, held, at = item
        return (-held, rank.get(engine.id, len(rank)), -at, costs[engine.id])

    return min(found, key=score)[0]
