"""Engine health, the trio shell around the breakers: evidence in, probes out (contract 6.2).

Request legs report here (success, or a fault with its breaker class). An ejection starts
one readmission loop for that engine in the server's background nursery (never a
request's): every ``recovery.readmit_interval_s`` it claims the breaker's single probe
slot and runs what lifts that ejection:

* ejected because it could not be reached, in a fleet without ``[engine_contract]``: a
  successful ``/health``;
* otherwise an inference probe: a one-token prefill and a decode with a fresh prompt,
  crossed with a live peer (after a crossed-decode failure, the original producer makes a
  new handoff); the engine's leg failing fails the probe, the peer's or a missing peer
  makes it inconclusive;
* with ``[engine_contract]``, lifecycle validation: identity and version, the model
  listed, and a crossed handoff in every role the engine may serve.

Under ``restart_policy = "whole_wave"`` an ejection puts the router in maintenance
instead, until every engine passes lifecycle validation together. Which probe, which peer
and what the results say are ``narwhal.core.readmission``'s; what a model list changes is
``narwhal.core.served_models``'.
"""

from __future__ import annotations

import logging
import random
from typing import Any, Protocol

import trio

from narwhal.core.breaker import BreakerState, ProbeOutcome
from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import BreakerClass, RequestFault
from narwhal.core.fleet import Fleet
from narwhal.core.flow import SATURATIONS
from narwhal.core.handoff import Fate, Handoff
from narwhal.core.readmission import (
    Probe,
    combined,
    crossed_verdict,
    probe_for,
    probe_leg,
    probe_peer,
)
from narwhal.core.served_models import (
    MAX_LIST_BYTES,
    conflicts,
    hidden_names,
    probe_model,
    read_model_list,
)
from narwhal.engines.client import EngineClient
from narwhal.engines.probe import HandoffResult, crossed_handoff, identity_problem, probe_prompt
from narwhal.observe.metrics import Metrics
from narwhal.router.background import Background
from narwhal.router.engine_events import EngineEvents
from narwhal.router.journal import Journal
from narwhal.router.reclaim import Reclaimer

log = logging.getLogger("narwhal.health")


class HealthHost(Protocol):
    """What engine health needs from the router (``narwhal.router.service.Router``)."""

    config: FleetConfig
    client: EngineClient
    fleet: Fleet
    metrics: Metrics
    journal: Journal
    reclaimer: Reclaimer
    background: Background
    events: EngineEvents


class Health:
    def __init__(self, router: HealthHost) -> None:
        self.router = router
        self.maintenance = False
        self.wave_lock = trio.Lock()
        # per role and served name (None: the fleet's model, or no name)
        self.held_in: dict[tuple[Leg, str | None], bool] = {}
        # crossed handoffs of probes in flight: each holds a producer and a consumer leg, so
        # an audit of reservations after a drain can tell them from a client's
        self.probe_handoffs = 0
        self._jitter = random.Random()

    # ---- evidence from the data path -----------------------------------------------------

    def success(self, engine: EngineState) -> None:
        streak = engine.breaker.streak
        engine.breaker.record_success()
        if streak != engine.breaker.streak:
            self.router.metrics.streak.labels(engine.id).set(engine.breaker.streak)

    def failure(
        self, engine: EngineState, fault: RequestFault, leg: Leg, peer: EngineState | None
    ) -> None:
        if fault.breaker is BreakerClass.NONE:
            return
        engine.failed_as, engine.failed_with = leg, peer.id if peer else None
        ejected = engine.breaker.record_failure(fault.breaker, fault.message, trio.current_time())
        metrics = self.router.metrics
        metrics.leg_failures.labels(engine.id, fault.breaker.value).inc()
        metrics.streak.labels(engine.id).set(engine.breaker.streak)
        if engine.breaker.quarantine_s > 0:
            metrics.quarantined.labels(engine.id).set(1)
        if ejected:
            metrics.ejections.labels(engine.id).inc()
            metrics.ejected.labels(engine.id).set(1)
            self._ejected(engine, fault)
            self.router.fleet.on_change()  # the queue's view of the fleet changed

    def _ejected(self, engine: EngineState, fault: RequestFault) -> None:
        # it comes back, if it does, restarted or not: nothing it cached is counted on
        self.router.fleet.forget_cached(engine.id)
        self.router.events.record(
            "ejected",
            engine.id,
            cause=fault.breaker.value,
            message=fault.message,
            streak=engine.breaker.streak,
        )
        if self.router.config.recovery.restart_policy == "whole_wave":
            if not self.maintenance:
                self.router.events.record("maintenance", None, state="entered")
            self.maintenance = True
            self.router.background.start(self._wave_loop)
        else:
            self.router.background.start(self._readmission_loop, engine)

    def refresh_gauges(self) -> None:
        """Time-driven gauges (quarantine ends by the clock), brought up to date at scrape."""
        now = trio.current_time()
        metrics, fleet = self.router.metrics, self.router.fleet
        metrics.tasks.set(live_tasks())
        held = fleet.held_in(now)
        flow, interval = self.router.config.admission, self.router.config.placement
        for engine in fleet.engines:
            why = engine.saturation(
                now, interval.metrics_interval_s, flow.engine_waiting_limit, flow.kv_usage_limit
            )
            for reason in SATURATIONS:
                metrics.engine_saturated.labels(engine.id, reason).set(int(why == reason))
            b = engine.breaker
            metrics.quarantined.labels(engine.id).set(int(now < b.quarantined_until))
            metrics.ejected.labels(engine.id).set(int(b.state is not BreakerState.CLOSED))
            metrics.held_in.labels(engine.id).set(int(engine.id in held))

    def note_placement(self, leg: Leg, held_in: bool, model: str | None = None) -> None:
        """Log once when a role starts or stops running on held-in (unhealthy) engines, for
        the engines serving ``model`` (an adapter's may be held in while the base model's
        are not: each its own once)."""
        if model == self.router.config.model:
            model = None
        if held_in != self.held_in.get((leg, model), False):
            self.held_in[(leg, model)] = held_in
            # held in: no healthy engine of the role is left; the last ones stay placeable
            kind = "held_in" if held_in else "held_in_ended"
            fields = {} if model is None else {"model": model}
            self.router.events.record(kind, None, role=leg, **fields)

    # ---- background ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Active health, in the server's background: one round of checks before the server
        reports itself started (an engine joins placement only after it answered), then a
        round every ``engine.health_interval_s``, jittered so that routers do not beat in
        step. Probes run beside it, started by ``failure``."""
        self.router.fleet.health_checked = True
        await self.check_all()
        task_status.started()
        await self._checks_forever()

    async def _checks_forever(self) -> None:
        while True:
            interval = self.router.config.engine.health_interval_s
            await trio.sleep(interval * self._jitter.uniform(0.8, 1.2))
            await self.check_all()

    async def check_all(self) -> None:
        """Every engine of the fleet, at once: each check bounded by health_timeout_s."""
        async with trio.open_nursery() as nursery:
            for engine in self.router.fleet.engines:
                nursery.start_soon(self.check, engine)

    async def check(self, engine: EngineState) -> None:
        client = self.router.background.checks_client()
        ok = await self._health_check(engine, client) == "pass"
        if ok:  # before it joins: placement knows what it serves from its first request
            await self.ask_models(engine, client)
        self._noted(engine, engine.note_health(ok, trio.current_time()))

    async def ask_models(self, engine: EngineState, client: EngineClient | None = None) -> None:
        """Its ``GET /v1/models`` (contract 4.7), bounded like a health check. No answer keeps
        what it served; a list that does not parse is refused and counted, and the last
        good one stays."""
        with trio.move_on_after(self.router.config.engine.health_timeout_s):
            try:
                client = client or self.router.background.checks_client()  # off the data path
                status, body = await client.get_within(engine.url, "/v1/models", MAX_LIST_BYTES)
            except RequestFault:
                return
            served = read_model_list(status, body)
            if served is None:
                return
            fleet = self.router.fleet
            if isinstance(served, str):
                self.router.metrics.model_lists_refused.labels(engine.id).inc()
                log.warning("engine %s: its model list is refused: %s", engine.id, served)
            if fleet.note_models(engine, served):
                names = sorted(fleet.served_by(engine).parents)
                self.router.events.record("models", engine.id, served=names[:64])
                self._warn_conflicts()
                fleet.on_change()  # a name it serves now may have requests waiting

    def _warn_conflicts(self) -> None:
        """Names some engine means otherwise than the fleet does (another parent), and
        aliases that hide a served name: said once per change of the lists."""
        fleet = self.router.fleet
        lists = [(e.id, fleet.served_by(e)) for e in fleet.engines]
        for conflict in conflicts(fleet.catalog, lists):
            log.warning(
                "model %r means %s here; engines %s list it otherwise and do not take it",
                conflict.name,
                conflict.meaning(),
                conflict.engines,
            )
        for alias, target in hidden_names(fleet.catalog):
            log.warning(
                "alias %r hides the served name %r: requests for it go to %r", alias, alias, target
            )

    def _noted(self, engine: EngineState, change: str | None) -> None:
        self.router.metrics.up.labels(engine.id).set(int(engine.up))
        if change is not None:
            self.router.events.record(change, engine.id, failures=engine.health_failures)
            if change == "left":  # it may come back restarted: nothing it cached counts
                self.router.fleet.forget_cached(engine.id)
            self.router.fleet.on_change()  # joined: room for the queue; left: maybe none

    async def _readmission_loop(self, engine: EngineState) -> None:
        interval = self.router.config.recovery.readmit_interval_s
        while engine.breaker.state is not BreakerState.CLOSED:
            await trio.sleep(interval)
            if self.router.fleet.by_id.get(engine.id) is not engine:
                return  # removed from the fleet by a reload
            if not engine.breaker.start_probe(trio.current_time()):
                continue
            outcome = await self.probe(engine)
            engine.breaker.finish_probe(outcome)
            self._probed(engine, outcome)

    def _probed(self, engine: EngineState, outcome: ProbeOutcome, **fields: Any) -> None:
        metrics = self.router.metrics
        metrics.probes.labels(engine.id, outcome).inc()
        self.router.events.record("probe", engine.id, outcome=outcome, **fields)
        if outcome == "pass":  # it answered: evidence for active health too
            self._noted(engine, engine.note_health(True, trio.current_time()))
        if engine.breaker.state is BreakerState.CLOSED:
            metrics.readmissions.labels(engine.id).inc()
            metrics.ejected.labels(engine.id).set(0)
            metrics.streak.labels(engine.id).set(0)
            self.router.events.record("readmitted", engine.id)
            self.router.fleet.on_change()
            self.router.background.start(self.ask_models, engine)  # it may serve others now

    async def probe(self, engine: EngineState) -> ProbeOutcome:
        """Decide, with real evidence, whether an ejected engine may take traffic again."""
        match probe_for(engine, contract=self.router.config.engine_contract is not None):
            case Probe.VALIDATE:
                return await self.validate(engine)
            case Probe.HEALTH:
                return await self._health_check(engine)
        return await self._inference_probe(engine, probe_leg(engine))

    async def _health_check(
        self, engine: EngineState, client: EngineClient | None = None
    ) -> ProbeOutcome:
        with trio.move_on_after(self.router.config.engine.health_timeout_s):
            try:
                status, _ = await (client or self.router.client).get(engine.url, "/health")
            except RequestFault:
                return "fail"
            return "pass" if status == 200 else "fail"
        return "fail"

    async def _inference_probe(
        self, engine: EngineState, leg: Leg, *, wave: bool = False
    ) -> ProbeOutcome:
        model = self._probe_model(engine)
        peer = probe_peer(self.router.fleet, engine, leg, model, trio.current_time(), wave=wave)
        if peer is None:
            return "inconclusive"  # no peer to cross with
        if self.router.client.limiter(peer.url).available_tokens == 0:
            return "inconclusive"  # the peer's pool is exhausted: no room to decide
        producer, consumer = (peer, engine) if leg == "decode" else (engine, peer)
        result = await self._handoff(producer, consumer, engine)
        return crossed_verdict(engine, producer, consumer, result.ok, result.failed_side)

    async def _handoff(
        self, producer: EngineState, consumer: EngineState, target: EngineState
    ) -> HandoffResult:
        config = self.router.config
        fleet = self.router.fleet
        self.probe_handoffs += 1
        try:
            async with fleet.reserve(producer, "prefill"), fleet.reserve(consumer, "decode"):
                result = await crossed_handoff(
                    self.router.client,
                    self._probe_model(target),
                    producer.url,
                    consumer.url,
                    leg_timeout_s=config.engine.first_token_timeout_s,
                    prompt=probe_prompt(target.id),
                    max_tokens=2,
                )
        finally:
            self.probe_handoffs -= 1
        self._settle_probe_handoff(result, producer, consumer)
        return result

    def _probe_model(self, engine: EngineState) -> str:
        """The name a probe of ``engine`` asks for (``served_models.probe_model``)."""
        return probe_model(self.router.fleet.served_by(engine), self.router.config.model)

    def _settle_probe_handoff(
        self, result: HandoffResult, producer: EngineState, consumer: EngineState
    ) -> None:
        """A probe's descriptor is counted like a client's; one its consumer failed before
        accepting pins KV as any orphan does (a failing engine is probed every
        ``readmit_interval_s``), so it is reclaimed on another consumer the same way."""
        if result.failed_side == "producer":
            return  # no descriptor
        metrics = self.router.metrics
        metrics.handoffs_of("produced").inc()
        if result.orphan is None:
            metrics.handoffs_of(Fate.DECODED.value).inc()
            return
        metrics.handoffs_of(Fate.ORPHANED.value).inc()
        handoff = Handoff(result.request_id, 1, producer.id, result.orphan, result.started)
        handoff.failed_consumer = consumer.id
        self.router.reclaimer.submit(handoff)

    # ---- lifecycle validation (engine contract) ------------------------------------------

    async def validate(self, engine: EngineState, *, wave: bool = False) -> ProbeOutcome:
        """Identity and version, model listed, a crossed handoff in every role it may serve."""
        problem = await self.check_identity(engine)
        if problem is not None:
            log.warning("engine %s fails lifecycle validation: %s", engine.id, problem)
            return "fail"
        outcomes: list[ProbeOutcome] = []
        if engine.spec.can_prefill:
            outcomes.append(await self._inference_probe(engine, "prefill", wave=wave))
        if engine.spec.can_decode:
            outcomes.append(await self._inference_probe(engine, "decode", wave=wave))
        return combined(outcomes)

    async def check_identity(self, engine: EngineState) -> str | None:
        """None when the engine is the one the contract names, else what is wrong."""
        config = self.router.config
        contract = config.engine_contract
        return await identity_problem(
            self.router.client,
            engine.url,
            model=self._probe_model(engine),
            pinned_version=contract.engine_version if contract else None,
            timeout_s=config.engine.health_timeout_s,
        )

    # ---- whole wave ----------------------------------------------------------------------

    async def _wave_loop(self) -> None:
        interval = self.router.config.recovery.readmit_interval_s
        while self.maintenance:
            await trio.sleep(interval)
            await self.readmit_wave()

    async def readmit_wave(self) -> dict[str, ProbeOutcome]:
        """Validate every engine together; leave maintenance only if all of them pass."""
        async with self.wave_lock:
            engines = self.router.fleet.engines
            claimed = [e for e in engines if e.breaker.start_probe(trio.current_time())]
            outcomes = {e.id: await self.validate(e, wave=True) for e in engines}
            passed = combined(outcomes.values()) == "pass"
            for engine in claimed:
                engine.breaker.finish_probe("pass" if passed else "fail")
                self._probed(engine, outcomes[engine.id], wave=True)
            if passed and self.maintenance:
                self.maintenance = False
                self.router.events.record("maintenance", None, state="ended")
            return outcomes


def live_tasks(prefixes: tuple[str, ...] = ("",)) -> int:
    """Tasks of this trio run whose name starts with one of ``prefixes`` (all by default);
    a leak shows as a count that never comes back down."""
    root = trio.lowlevel.current_root_task()
    stack, count = [root] if root is not None else [], 0
    while stack:
        task = stack.pop()
        count += task.name.startswith(prefixes)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count
