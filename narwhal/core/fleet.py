"""Fleet state: engines, their in-flight legs, and reservations.

Placement is a pure function of this state (``narwhal.core.placement``); reservations are
async context managers, so a leg's count is released on every exit path, cancellation
included.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

from narwhal.core.breaker import Breaker
from narwhal.core.config import EngineSpec, RecoveryConfig
from narwhal.core.engine_report import EngineReport
from narwhal.core.flow import Saturation, room_left
from narwhal.core.lora_slots import RecentAdapters
from narwhal.core.policies import PrefixRing
from narwhal.core.precise_index import PreciseIndex
from narwhal.core.prefix_index import PrefixIndex
from narwhal.core.served_models import Catalog, Served, default_served

# the two legs of an attempt; an engine serves either, as its role allows
Leg = Literal["prefill", "decode"]
LEGS: tuple[Leg, ...] = ("prefill", "decode")
HEALTH_FAILS_TO_LEAVE = 2  # one lost check is a hiccup; two in a row, the engine is gone


class EngineState:
    __slots__ = (
        "adapters",
        "breaker",
        "checked_at",
        "decoding",
        "decoding_at_mark",
        "failed_as",
        "failed_with",
        "health_failures",
        "inflight",
        "inflight_gauges",
        "mark",
        "models_refused",
        "prefilling",
        "report",
        "scrape_failures",
        "sent",
        "served",
        "spec",
        "up",
    )

    def __init__(self, spec: EngineSpec, recovery: RecoveryConfig) -> None:
        self.spec = spec
        self.inflight: dict[Leg, int] = {"prefill": 0, "decode": 0}
        self.inflight_gauges: dict[Leg, Any] = {}  # Prometheus children, when exported
        self.breaker = Breaker(recovery.eject_after, recovery.failure_quarantine_s)
        # the leg of its last counted failure, and the peer of that attempt: a consumer
        # that failed a crossed decode is probed with a handoff from that same producer
        self.failed_as: Leg | None = None
        self.failed_with: str | None = None
        # active health (SPEC 3, /ready): placeable only once it answered /health, and no
        # longer after HEALTH_FAILS_TO_LEAVE checks in a row went unanswered
        self.up = False
        self.health_failures = 0
        self.checked_at: float | None = None
        # its own account of its load, from its /metrics (placement.metrics_interval_s)
        self.report: EngineReport | None = None
        self.scrape_failures = 0  # in a row; a scrape never moves the breaker
        # the LoRA adapters placed on it or seen running there: what its idle adapter slots
        # hold, which its report does not list (placement's adapter affinity)
        self.adapters = RecentAdapters()
        # the names it serves, from its last good /v1/models (None: it never gave one, and
        # serves the fleet's model); lists refused since it was added
        self.served: Served | None = None
        self.models_refused = 0
        # This router's legs to it that it has not started (SPEC 4.5), the queue a report
        # cannot show yet or shows late (vLLM's gauges trail its requests by an engine
        # step or more). A decode has started at its first token: every decode before it
        # counts (``decoding``), and the report's waiting queue counts only beyond the ones
        # it may hold already (``decoding_at_mark``, when its scrape went out). A prefill
        # shows no start, only its end: those sent since the scrape went out count
        # (numbered as sent; ``prefilling`` holds the numbers of those not ended, ``mark``
        # how many had been sent when the scrape went out).
        self.decoding = 0
        self.decoding_at_mark = 0
        self.sent = 0
        self.prefilling: set[int] = set()
        self.mark = 0

    def scrape_mark(self) -> tuple[int, int, int]:
        """What the scrape going out now may count of ours, and the adapters placed before
        it (for ``note_report``)."""
        return self.sent, self.decoding, self.adapters.clock

    def note_report(
        self, report: EngineReport | None, mark: tuple[int, int, int] = (0, 0, 0)
    ) -> None:
        """A new account of its load, from a scrape sent at ``mark`` (``scrape_mark``);
        None: scraping stopped, and every leg not started counts again."""
        self.report = report
        sent, decoding, placed = mark
        self.mark, self.decoding_at_mark = (sent, decoding) if report is not None else (0, 0)
        if report is not None and report.lora is not None:
            self.adapters.seen_running(report.lora.running, placed)

    @property
    def pending(self) -> int:
        """This router's legs it has not started and its last report may not show: every
        decode before its first token, the prefills sent since the scrape went out."""
        mark = self.mark
        return self.decoding + sum(1 for number in self.prefilling if number > mark)

    def _ours(self, fresh: bool) -> int:
        """Our legs not started that count: without a fresh report, every one."""
        return self.pending if fresh else self.decoding + len(self.prefilling)

    def _others_waiting(self, report: EngineReport) -> float:
        """The report's waiting queue less what of it may be our own decodes."""
        return max(0.0, report.waiting - self.decoding_at_mark)

    def room(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float, leg: Leg
    ) -> tuple[int, Saturation | None]:
        """How many more legs it takes before it is saturated, and why it is, for ``leg``."""
        report = self.report
        fresh = report is not None and report.fresh(now, interval_s)
        return room_left(
            self._others_waiting(report) if fresh and report is not None else None,
            self._ours(fresh),
            report.kv_usage if fresh and report is not None else None,
            waiting_limit=waiting_limit,
            kv_limit=kv_limit,
            consumer=leg == "decode",
        )

    def note_health(self, ok: bool, now: float) -> str | None:
        """Record one active health check; the transition it caused ("joined", "left")."""
        self.checked_at = now
        if ok:
            self.health_failures = 0
            if not self.up:
                self.up = True
                return "joined"
            return None
        self.health_failures += 1
        if self.up and self.health_failures >= HEALTH_FAILS_TO_LEAVE:
            self.up = False
            return "left"
        return None

    def saturation(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float
    ) -> Saturation | None:
        """Why it takes no more legs of any role it serves now, or None."""
        legs = [leg for leg, able in zip(LEGS, self._serves(), strict=True) if able]
        for leg in legs:
            _, why = self.room(now, interval_s, waiting_limit, kv_limit, leg)
            if why is not None:
                return why
        return None

    def saturation_view(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float
    ) -> dict[str, object]:
        """The operator's view of its saturation (``/narwhal/engines``)."""
        report = self.report
        fresh = report is not None and report.fresh(now, interval_s)
        return {
            "saturated": self.saturation(now, interval_s, waiting_limit, kv_limit),
            "waiting_scraped": report.waiting if fresh and report is not None else None,
            "ours_not_started": self._ours(fresh),
            "waiting_limit": waiting_limit,
        }

    def _serves(self) -> tuple[bool, bool]:
        return self.spec.can_prefill, self.spec.can_decode

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        return self.inflight["prefill"] + self.inflight["decode"]

    def snapshot(self, now: float, held_in: bool, interval_s: float = 0.0) -> dict[str, object]:
        """The operator's view (``/narwhal/engines``); times are seconds from ``now``."""
        b = self.breaker
        return {
            "id": self.id,
            "url": self.url,
            "role": self.spec.role,
            "inflight": dict(self.inflight),
            "breaker": {
                "state": b.state.value,
                "streak": b.streak,
                "last_cause": b.last_cause,
                "ejection_cause": b.ejection_cause.value if b.ejection_cause else None,
                "ejections": b.ejections,
            },
            # an ejected engine stays out until a probe passes: no fixed end time
            "ejected_until": "probe" if b.state.value != "closed" else None,
            "ejected_for_s": None if b.ejected_at is None else round(now - b.ejected_at, 3),
            "quarantined_for_s": round(max(0.0, b.quarantined_until - now), 3) or None,
            "held_in": held_in,
            "up": self.up,
            "health_failures": self.health_failures,
            "last_health_ago_s": None
            if self.checked_at is None
            else round(now - self.checked_at, 3),
            "report": None if self.report is None else self.report.view(now, interval_s),
            "scrape_failures": self.scrape_failures,
            "models": None if self.served is None else self.served.view(),
            "models_refused": self.models_refused,
            "last_probe": b.last_probe,
            "last_probe_ago_s": None
            if b.last_probe_at is None
            else round(now - b.last_probe_at, 3),
        }


class Reservation:
    """One in-flight leg on one engine, held for the leg's whole life."""

    __slots__ = ("claim", "engine", "leg", "number", "on_change", "waiting")
    # number: a prefill's, as sent (``EngineState.prefilling``)

    def __init__(
        self,
        engine: EngineState,
        leg: Leg,
        on_change: Callable[[], None],
        claim: DecodeClaim | None = None,
    ) -> None:
        self.engine = engine
        self.leg = leg
        self.on_change = on_change  # room may have freed: the admission queue looks
        self.claim = claim
        self.number = 0
        self.waiting = False

    async def __aenter__(self) -> EngineState:
        engine = self.engine
        engine.inflight[self.leg] += 1
        self.waiting = True
        if self.leg == "decode":
            engine.decoding += 1
            if self.claim is not None:  # the same step: the room is never counted free
                self.claim.handed()
        else:
            engine.sent += 1
            self.number = engine.sent
            engine.prefilling.add(self.number)
        gauge = engine.inflight_gauges.get(self.leg)
        if gauge is not None:
            gauge.inc()
        return engine

    def started(self) -> None:
        """The engine runs it (a decode's first token): it no longer waits there."""
        if self.waiting:
            self.waiting = False
            if self.leg == "decode":
                self.engine.decoding -= 1
            else:
                self.engine.prefilling.discard(self.number)
            self.on_change()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.engine.inflight[self.leg] -= 1
        gauge = self.engine.inflight_gauges.get(self.leg)
        if gauge is not None:
            gauge.dec()
        if self.waiting:
            self.started()
        else:
            self.on_change()


class DecodeClaim:
    """A request between its prefill and its decode leg: its decode will take a consumer's
    room, so the admission queue counts it before the leg is sent (a prefill's end must not
    look like room for another request). Held by ``with``; handed over by the decode leg's
    reservation, or given back when the attempt ends without one."""

    __slots__ = ("fleet", "held", "model")

    def __init__(self, fleet: Fleet, model: str | None = None) -> None:
        self.fleet = fleet
        self.model = model
        self.held = False

    def __enter__(self) -> DecodeClaim:
        self.fleet.decodes_coming += 1
        self.fleet.claims[self.model] = self.fleet.claims.get(self.model, 0) + 1
        self.held = True
        return self

    def handed(self) -> None:
        if self.held:
            self.held = False
            self.fleet.decodes_coming -= 1
            self.fleet.claims[self.model] -= 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.held:  # no decode leg was sent: the room it held is free
            self.handed()
            self.fleet.on_change()


class Fleet:
    def __init__(self, specs: tuple[EngineSpec, ...], recovery: RecoveryConfig) -> None:
        self.engines: list[EngineState] = []
        self.by_id: dict[str, EngineState] = {}
        self.producers: list[EngineState] = []
        self.consumers: list[EngineState] = []
        self.turn = 0  # rotates ties so equal engines share load
        # active health checks run (the server's background nursery): placement then takes
        # only engines that answered; without them (a bare Router) every engine is taken
        self.health_checked = False
        # (producer id, consumer id) pairs that moved KV: the consumer knows the producer
        self.paired: set[tuple[str, str]] = set()
        self.on_change: Callable[[], None] = _nothing  # a leg started or ended
        self.decodes_coming = 0  # requests holding a DecodeClaim
        self.claims: dict[str | None, int] = {}  # ... by the served name they asked for
        # what each engine is believed to cache (SPEC 4.4); its TTL is the router's to set
        self.prefixes = PrefixIndex(ttl_s=120.0)
        # what engines with a live KV-event stream say they cache (the precise index)
        self.precise = PreciseIndex()
        self.model = ""  # the fleet file's: what an engine serves before it says
        self.aliases: dict[str, str] = {}
        self.catalog = Catalog({}, {})
        # per served name, its producers and consumers (rebuilt when a list changes)
        self._pools: dict[str, tuple[list[EngineState], list[EngineState]]] = {}
        self.reload(specs, recovery)

    def reload(self, specs: tuple[EngineSpec, ...], recovery: RecoveryConfig) -> None:
        """Engines keep their state (breaker, in-flight counts) when id and URL stay; a
        removed engine leaves the lists, and its in-flight legs release on the old object."""
        engines = []
        previous = set(map(id, self.engines))
        for spec in specs:
            state = self.by_id.get(spec.id)
            if state is None or state.spec.url != spec.url:
                state = EngineState(spec, recovery)
            else:
                state.spec = spec
                state.breaker.eject_after = recovery.eject_after
                state.breaker.quarantine_s = recovery.failure_quarantine_s
            engines.append(state)
        self.engines = engines
        self.by_id = {e.id: e for e in engines}
        self.producers = [e for e in engines if e.spec.can_prefill]
        self.consumers = [e for e in engines if e.spec.can_decode]
        # prefix affinity's ring: a producer added or removed moves only its own keys
        self.ring = PrefixRing([e.id for e in self.producers])
        # an engine replaced (a new URL) or removed starts from nothing cached
        self.prefixes.keep_only(e.id for e in engines if id(e) in previous)
        self.precise.keep_only(e.id for e in engines if id(e) in previous)
        self.models_changed()

    def configure_models(self, model: str, aliases: dict[str, str]) -> None:
        """The fleet file's model (what an engine serves until it says) and aliases."""
        self.model, self.aliases = model, aliases
        self.models_changed()

    def served_by(self, engine: EngineState) -> Served:
        return engine.served if engine.served is not None else default_served(self.model)

    def note_models(self, engine: EngineState, served: Served | str) -> bool:
        """An engine's model list, or why it was refused (its last good one stays); whether
        what it serves changed."""
        if isinstance(served, str):
            engine.models_refused += 1
            return False
        before = self.served_by(engine)
        engine.served = served
        if before == served:  # its first list may say what it was believed to serve
            return False
        self.models_changed()
        return True

    def models_changed(self) -> None:
        self._pools.clear()
        lists = (self.served_by(e) for e in self.engines)
        self.catalog = Catalog.of(lists, self.aliases, self.model)

    def _pool(self, leg: Leg, model: str | None) -> list[EngineState]:
        if model is None:
            return self.producers if leg == "prefill" else self.consumers
        pools = self._pools.get(model)
        if pools is None:
            means = self.catalog.means  # the name as the fleet means it: one parent
            pools = self._pools[model] = (
                [e for e in self.producers if means(self.served_by(e), model)],
                [e for e in self.consumers if means(self.served_by(e), model)],
            )
        return pools[0] if leg == "prefill" else pools[1]

    def forget_cached(self, engine_id: str) -> None:
        """The engine left placement (ejected, or its health checks failed): it may come
        back restarted, so nothing it was believed or said to cache counts; its event
        stream is unknown until it is live again."""
        self.prefixes.forget(engine_id)
        self.precise.drop(engine_id)
        engine = self.by_id.get(engine_id)
        if engine is not None:  # nor what its adapter slots were believed to hold
            engine.adapters.forget()

    def reserve(
        self, engine: EngineState, leg: Leg, claim: DecodeClaim | None = None
    ) -> Reservation:
        """A leg on ``engine``; a decode leg takes over its request's ``claim``."""
        return Reservation(engine, leg, self.on_change, claim)

    def claim_decode(self, model: str | None = None) -> DecodeClaim:
        return DecodeClaim(self, model)

    def _claims_on(self, model: str | None) -> int:
        """Requests between prefill and decode whose consumers may be ``model``'s: those of
        any model that shares a consumer with it (every one, for no model)."""
        if not self.decodes_coming:
            return 0
        if model is None or (len(self.claims) <= 1 and model in self.claims):
            return self.decodes_coming
        mine = {id(e) for e in self._pool("decode", model)}
        return sum(
            count
            for other, count in self.claims.items()
            if count and (other is None or any(id(e) in mine for e in self._pool("decode", other)))
        )

    def headroom(
        self,
        now: float,
        interval_s: float,
        waiting_limit: int,
        kv_limit: float,
        *,
        consumers_only: bool = False,
        model: str | None = None,
    ) -> int | None:
        """How many more requests the fleet takes before its placeable producers or its
        placeable consumers are saturated (SPEC 4.5): the lesser of the producers' summed
        room and the consumers', where every request between its prefill and its decode
        leg takes a consumer's room already (``DecodeClaim``: its decode follows within
        moments, and a decode sent to a full consumer waits in its queue). None: a role
        has no placeable engine at all, which is not saturation: the request goes on and
        is answered 503 at once. ``consumers_only``: for a request its consumer may serve
        alone (conditional disaggregation), whose dispatch needs no producer's room.
        ``model``: the room of the engines that serve it only."""
        rooms = []
        for leg in ("decode",) if consumers_only else LEGS:
            engines, _ = self.placeable(leg, now, model)
            if not engines:
                return None
            rooms.append(
                sum(e.room(now, interval_s, waiting_limit, kv_limit, leg)[0] for e in engines)
            )
        return max(0, min([*rooms[:-1], rooms[-1] - self._claims_on(model)]))

    def saturated(
        self,
        leg: Leg,
        now: float,
        interval_s: float,
        waiting_limit: int,
        kv_limit: float,
        model: str | None = None,
    ) -> bool:
        """Every placeable engine of ``leg``'s role (serving ``model``) is saturated (False
        when there is none: that is no capacity, not saturation)."""
        engines, _ = self.placeable(leg, now, model)
        return bool(engines) and all(
            e.room(now, interval_s, waiting_limit, kv_limit, leg)[0] <= 0 for e in engines
        )

    def reserved(self) -> int:
        """Legs in flight across the fleet (0 after a drain)."""
        return sum(e.load for e in self.engines)

    def placeable(
        self, leg: Leg, now: float, model: str | None = None
    ) -> tuple[list[EngineState], bool]:
        """The engines placement may use for ``leg`` (of those serving ``model``: None,
        any), and whether they are held in.

        Healthy engines (closed breaker, not quarantined) when there are any; otherwise
        every engine of the role is held in: the last engine able to serve a role is never
        quarantined or probe-held out, since refusing all traffic helps nobody.
        """
        engines = self._pool(leg, model)
        if self.health_checked:  # an engine that never answered, or stopped, is not taken
            engines = [e for e in engines if e.up]
        healthy = [e for e in engines if e.breaker.healthy(now)]
        return (healthy, False) if healthy else (engines, bool(engines))

    def held_in(self, now: float) -> set[str]:
        """Ids of unhealthy engines that stay placeable as the last of a role."""
        held: set[str] = set()
        for leg in LEGS:
            engines, is_held = self.placeable(leg, now)
            if is_held:
                held.update(e.id for e in engines)
        return held

    def ready(self, now: float) -> bool:
        """At least one healthy producer and one healthy consumer that answer."""
        for leg in LEGS:
            engines, held_in = self.placeable(leg, now)
            if held_in or not engines:
                return False
        return True


def _nothing() -> None:
    return None
