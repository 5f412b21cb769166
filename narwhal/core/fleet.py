"""Fleet state: the engines (each an ``EngineState``, ``narwhal.core.engine_state``), the
pools placement picks from, and the reservations of their in-flight legs.

Placement is a pure function of this state (``narwhal.core.placement``); reservations are
async context managers, so a leg's count is released on every exit path, cancellation
included.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from narwhal.core.config import EngineSpec, PredictionConfig, RecoveryConfig
from narwhal.core.engine_state import LEGS, EngineState, Leg
from narwhal.core.policies import PrefixRing
from narwhal.core.precise_index import PreciseIndex
from narwhal.core.prediction import CostModel
from narwhal.core.prefix_index import PrefixIndex
from narwhal.core.served_models import Catalog, Served, default_served


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
                self.engine.decode_started()
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
        if self.leg == "prefill":
            if self.waiting:
                self.started()  # its end is all a prefill shows; it tells the queue
                return
        elif self.waiting:  # a decode that never ran there: no start to count
            self.waiting = False
            self.engine.decoding -= 1
        else:
            self.engine.decode_ended()
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
        # what each engine is believed to cache (contract 4.4); its TTL is the router's to set
        self.prefixes = PrefixIndex(ttl_s=120.0)
        # what engines with a live KV-event stream say they cache (the precise index)
        self.precise = PreciseIndex()
        # what each engine and pair costs (policy "predicted"); its priors are the router's
        self.costs = CostModel(PredictionConfig())
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
        self.costs.retain(e.id for e in engines if id(e) in previous)
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
        placeable consumers are saturated (contract 4.5): the lesser of the producers' summed
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
