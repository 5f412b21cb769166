"""The router's shared state, and ``Router.handle``, which serves one client request.

``handle`` runs each request in a nursery of its own, which holds what the request runs
beside its main line (the disconnect watch where the server offers no callback) and is
cancelled when it ends, so nothing the request started outlives it. The nursery's cancel
scope is the request's limit: its deadline, or the drain's if a graceful shutdown ends
first (``begin_drain`` brings the deadline forward: ``running``), or its client's
disconnect. Cleanup (reservations, engine connections) runs in the ``finally`` and
``async with`` blocks below it on every exit path.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import msgspec
import trio

from narwhal.core.clocks import Clock, ran_out
from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.engine_state import LEGS
from narwhal.core.faults import InternalError, Phase, RequestFault
from narwhal.core.fleet import Fleet
from narwhal.core.fleet_view import fleet_view
from narwhal.core.flow_class import Flow
from narwhal.core.limits import check_workers, dispatch_by
from narwhal.core.prediction import CostModel
from narwhal.core.requests import ClientRequest
from narwhal.core.retry import RetryBudget
from narwhal.core.served_models import model_cards
from narwhal.engines.client import EngineClient
from narwhal.engines.transport import Connect
from narwhal.observe import tracing
from narwhal.observe.logs import count_drops as count_log_drops
from narwhal.observe.logs import log_context, log_event, log_request
from narwhal.observe.metrics import Metrics
from narwhal.process.config_files import load_config
from narwhal.router.admission import Admission
from narwhal.router.auth import ApiKeys, warn_plain_http_keys
from narwhal.router.background import Background
from narwhal.router.discovery import Discovery
from narwhal.router.drain_bound import DrainBound
from narwhal.router.engine_events import EngineEvents
from narwhal.router.fanout import FanOutRun
from narwhal.router.health import Health
from narwhal.router.journal import Caller, Journal, JournalLine, Outcome
from narwhal.router.kv_subscriber import KvSubscriber
from narwhal.router.pass_through import PassThrough
from narwhal.router.reclaim import Reclaimer
from narwhal.router.request_run import RequestRun
from narwhal.router.run_record import ClientSink, RunRecord
from narwhal.router.scraper import Scraper
from narwhal.router.stream_reactor import StreamReactor
from narwhal.router.token_source import TokenSource

log = logging.getLogger("narwhal.router")
Run = RequestRun | FanOutRun  # one client request: one prefill/decode chain, or a fan-out
FAIL_SEND_BOUND_S = 2.0  # telling a client it failed must not hang on a stalled reader


class Router:
    def __init__(
        self,
        config: FleetConfig,
        *,
        connect: Connect | None = None,
        journal: Journal | None = None,
        rng: random.Random | None = None,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.api_keys = ApiKeys(
            config.serving.api_keys_env, classes=config.admission.priority_from == "key"
        )
        self.admin_keys = ApiKeys(config.serving.admin_keys_env, "serving.admin_keys_env")
        self.fleet = Fleet(config.engines, config.recovery)
        self.fleet.configure_models(config.model, dict(config.aliases))
        self.fleet.prefixes.ttl_s = config.placement.prefix_index_ttl_s
        self.fleet.precise.replay = config.kv_events.replay
        self.fleet.costs = CostModel(config.prediction)
        self.metrics = Metrics((e.id for e in self.fleet.engines), model=config.model)
        self._bind_gauges()
        self.journal = journal or Journal()
        self.journal.count_drops(self.metrics.journal_dropped.inc)
        self.events = EngineEvents(self.journal)
        count_log_drops(self.metrics.log_dropped.inc)
        self.retry_budget = RetryBudget(config.serving.retry_budget, config.serving.retry_replenish)
        self.rng = rng or random.Random()
        api_key = os.environ.get(config.engine.api_key_env) if config.engine.api_key_env else None
        self.client = EngineClient(
            max_connections=config.engine.max_connections,
            connect_timeout_s=config.engine.connect_timeout_s,
            api_key=api_key,
            ca_file=config.engine.ca_file,  # https:// engines verified against it (contract 2)
            connect=connect,  # None: real sockets; tests pass an in-memory network
        )
        if api_key:
            warn_plain_http_keys(config)
        # the server's background nursery and the checks' client: what no request owns
        self.background = Background(self.client)
        self.health = Health(self)
        # [[discover]]: its loop runs in the server's background nursery, next to health
        self.discovery = Discovery(self, config.discover)
        self.reclaimer = Reclaimer(self)  # its workers run in the server's background nursery
        self.scraper = Scraper(self)  # engines' /metrics for placement, same nursery
        self.kv_subscriber = KvSubscriber(self)  # engines' KV events, same nursery
        self.pass_through = PassThrough(self)  # POST /tokenize and /detokenize
        self.tokens = TokenSource(self, self.pass_through.engine)  # request ids for those events
        self.reactor = StreamReactor()  # parked streams' reads, same nursery
        self.config_path = config_path
        self.draining = False
        self.drain_deadline = math.inf
        self.running: set[trio.CancelScope] = set()
        self.admission = Admission(self.metrics)
        self.admission.configure(config)
        self.admission.headroom = self._headroom
        self.fleet.on_change = self.admission.pump  # a leg started or ended: room may free
        self.disconnects = 0

    def _headroom(self, local: bool = False, model: str | None = None) -> int | None:
        """How many more requests the fleet takes before it is saturated (contract 4.5);
        ``local``: requests their consumers serve alone; ``model``: the room of the engines
        serving it."""
        flow = self.config.admission
        return self.fleet.headroom(
            trio.current_time(),
            self.config.placement.metrics_interval_s,
            flow.engine_waiting_limit,
            flow.kv_usage_limit,
            consumers_only=local,
            model=model,
        )

    def models_view(self, created: int) -> dict[str, object]:
        """``GET /v1/models`` (contract 4.7): every name a placeable engine serves, adapters
        with their ``parent``, then each alias of one of them as its own entry (``root``:
        the name it stands for). No engine placeable: the fleet's model, as before any
        engine answered."""
        fleet, now = self.fleet, trio.current_time()
        placeable = (fleet.served_by(e) for leg in LEGS for e in fleet.placeable(leg, now)[0])
        config = self.config
        return model_cards(fleet.catalog, config.aliases, placeable, config.model, created)

    def engines_view(self) -> bytes:
        """``GET /narwhal/engines``: this process's view of the fleet."""
        view = fleet_view(
            self.config,
            self.fleet,
            trio.current_time(),
            admission=self.admission.view(self.config.serving),
            maintenance=self.health.maintenance,
            discovery=self.discovery.view() if self.config.discover else None,
        )
        return msgspec.json.encode(view)

    async def handle(
        self,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
        wait_disconnect: Callable[[], Awaitable[None]],
        caller: Caller | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        on_disconnect: Callable[[Callable[[], None]], None] | None = None,
        flow: Flow | None = None,
    ) -> Run:
        """Serve one admitted request to its single terminal outcome, in a nursery of its
        own (the module's doc). ``headers``: the client's, where an incoming W3C
        ``traceparent`` is read: continued by the request's span with tracing on, passed
        to the engine legs unchanged with it off. ``on_disconnect``: the server's way to
        call back when the client goes (at once if it has gone already), which costs the
        request no task; without it a task in the nursery awaits ``wait_disconnect``.
        The run is awaited from here, with no call of its own between: a held stream's
        task keeps one frame fewer."""
        run, traced = self._begin(req, rid, sink, caller, headers, flow)
        record = run.record
        deadline, timeout = record.deadline, record.config.serving.request_timeout_s
        async with trio.open_nursery() as nursery:
            limit = nursery.cancel_scope
            limit.deadline = min(deadline, self.drain_deadline)
            watch = on_disconnect or _watcher(nursery, wait_disconnect)
            watch(partial(self._disconnected, limit, record))
            self.running.add(limit)
            dispatched = ended = False
            try:
                refused = run.beyond_target()
                if refused is not None:
                    raise refused
                record.queued_s = await self.admission.dispatch(
                    record.flow.cls,
                    record.flow.tenant,
                    record.arrival,
                    self._dispatch_by(record),
                    local=run.local_possible(),
                    pool=record.req.model,
                    due=record.due,
                )
                dispatched = True
                await run.execute()
            except RequestFault as fault:
                await record.fail(fault)
            except Exception as exc:
                # a bug of ours must still end the request honestly, never hang it
                log.exception("request %s failed inside the router", record.rid)
                await record.fail(
                    InternalError(f"router error: {type(exc).__name__}", phase=record.phase)
                )
            except trio.Cancelled:
                # its deadline (or the drain's) passed: not a scope around it, nor the
                # nursery cancelling itself for a child's end (``cancel_called`` says both)
                ended = trio.current_time() >= limit.deadline
                raise  # on, for the scope that was cancelled to catch
            finally:
                self.running.discard(limit)
                if dispatched:
                    self.admission.done()
                else:  # it left the queue another way: its wait is all it did
                    record.queued_s = trio.current_time() - record.arrival
                try:
                    if ended and not record.client_left:  # else nobody is left to tell
                        await self._tell_limit(record, limit, deadline, timeout)
                finally:
                    self._end(run, traced)  # before a checkpoint: the line is out with the answer
                    if nursery.child_tasks:  # what it started beside its main line
                        limit.cancel()
        return run

    def _begin(
        self,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
        caller: Caller | None,
        headers: Sequence[tuple[bytes, bytes]],
        flow: Flow | None,
    ) -> tuple[Run, contextvars.Token[dict[str, str] | None] | None]:
        """The request's run, its span (tracing on) and its admission."""
        run: Run = (
            FanOutRun(self, self.config, req, rid, sink)
            if req.fanout > 1
            else RequestRun(self, self.config, req, rid, sink)
        )
        record = run.record
        record.caller = caller or record.caller
        record.flow = flow or record.flow
        traced = None
        if tracing.ENABLED:  # off: nothing is made, this is the only cost
            record.span = tracing.server_span(
                f"POST {req.endpoint}",
                headers,
                {
                    "http.request.method": "POST",
                    "url.path": req.endpoint,
                    "narwhal.request_id": rid,
                    "narwhal.endpoint": req.endpoint,
                    "narwhal.stream": req.stream,
                    "narwhal.fanout": req.fanout,
                },
            )
            traced = log_context.set({"request_id": rid, "trace_id": tracing.trace_id(record.span)})
        else:  # not a participant: the client's trace context goes to the legs as it came
            record.trace = tracing.incoming(headers)
        self.admission.admit()
        return run, traced

    def _end(self, run: Run, traced: contextvars.Token[dict[str, str] | None] | None) -> None:
        """Its one journal line, its metrics and log line, its span: on every exit path."""
        record = run.record
        if not record.owner.standing.finished:
            run.cancel()  # the client is gone (or so is the notice of its failure)
        if record.outcome == "completed":
            self.retry_budget.earn()
        line = run.journal_line()
        self.journal.write(line)
        self.export(line)
        log_request(line)
        self.admission.release()
        if record.span is not None:
            if line.status is not None:
                record.span.set_attribute("http.response.status_code", line.status)
            tracing.end(
                record.span,
                line.outcome,
                line.message,
                status=line.status,
                phase=line.phase,
                attempts=len(line.attempts),
                tokens=line.tokens,
            )
        if traced is not None:
            log_context.reset(traced)

    async def _tell_limit(
        self, record: RunRecord, limit: trio.CancelScope, deadline: float, budget_s: float
    ) -> None:
        """The answer to a request its limit ended, sent past the limit (shielded), for
        ``FAIL_SEND_BOUND_S`` at most."""
        expired = self.limit_fault(limit, deadline, budget_s, record.phase, caught=False)
        with trio.CancelScope(shield=True), trio.move_on_after(FAIL_SEND_BOUND_S):
            await record.fail(expired)

    def limit_fault(
        self,
        limit: trio.CancelScope,
        deadline: float,
        timeout: float,
        phase: Phase,
        *,
        caught: bool = True,
    ) -> RequestFault:
        """The fault of a request's ``limit`` that ran out: the drain's, when its deadline
        came before the request's own (``deadline``, ``timeout`` after its arrival)."""
        scope = limit if caught else None  # not caught yet: the caller is inside it
        if self.drain_deadline < deadline:
            grace = self.config.serving.graceful_timeout_s
            return ran_out(Clock.DRAIN, grace, phase=phase, scope=scope)
        return ran_out(Clock.DEADLINE, timeout, phase=phase, scope=scope)

    def _dispatch_by(self, record: RunRecord) -> float:
        """The latest a queued request is worth sending on (``limits.dispatch_by``)."""
        config = record.config
        timeout, first_token = config.serving.request_timeout_s, config.engine.first_token_timeout_s
        return dispatch_by(record.deadline, timeout, first_token)

    def drain_bound(self, deadline: float = math.inf) -> DrainBound:
        """A scope that ends at ``deadline``, or at a graceful shutdown's deadline like an
        admitted request's (for work before admission: a body still arriving when the
        drain ends); ``DrainBound.drained`` says which."""
        return DrainBound(self.running, deadline, self.drain_deadline)

    def begin_drain(self) -> None:
        """Graceful shutdown: refuse new requests (``/ready`` 503) and give the running ones
        ``serving.graceful_timeout_s`` before their streams end with a terminal event."""
        if self.draining:
            return
        self.draining = True
        grace = self.config.serving.graceful_timeout_s
        log_event(
            log,
            logging.WARNING,
            "draining",
            {"in_flight": self.admission.admitted, "grace_s": grace},
        )
        # no timer task: every running request's scope gets the deadline (and so does
        # one admitted a moment later), so the drain is bounded whatever else is shutting down
        self.drain_deadline = trio.current_time() + grace
        self.admission.drain_queue()  # never started: 503 now, a load balancer may retry
        for scope in self.running:
            scope.deadline = min(scope.deadline, self.drain_deadline)

    def reload(self, new: FleetConfig) -> dict[str, list[str]]:
        """Apply a new fleet file: added engines take traffic at once, removed ones get no
        new legs while their in-flight legs finish; timeouts and limits apply to new
        requests. Discovered engines stay while their ``[[discover]]`` block does."""
        check_workers(new, self.admission.worker_count, self.config_path or "<reload>")
        # an unset variable refuses the file
        api_keys = ApiKeys(new.serving.api_keys_env, classes=new.admission.priority_from == "key")
        admin_keys = ApiKeys(new.serving.admin_keys_env, "serving.admin_keys_env")
        self.tokens.configure(new)  # a tokenizer.json that cannot be read refuses the file
        self.api_keys, self.admin_keys = api_keys, admin_keys
        self.config = new
        self.fleet.configure_models(new.model, dict(new.aliases))
        self.fleet.prefixes.ttl_s = new.placement.prefix_index_ttl_s
        self.fleet.precise.replay = new.kv_events.replay
        if new.prediction != self.fleet.costs.config:  # new priors: learned from the start
            self.fleet.costs = CostModel(new.prediction)
        self.discovery.state.configure(new.discover)
        change = self._set_engines()
        self.admission.configure(new)
        self.retry_budget.cap = new.serving.retry_budget
        self.retry_budget.replenish = new.serving.retry_replenish
        log_event(log, logging.WARNING, "fleet reloaded", dict(change))
        return change

    def apply_discovered(self) -> dict[str, list[str]]:
        """The discovered engines changed: the fleet becomes ``[[engines]]`` plus them, by
        the path of a reload (an added engine joins once it answers ``/health``, a removed
        one drains)."""
        return self._set_engines()

    def _set_engines(self) -> dict[str, list[str]]:
        before = {e.id for e in self.fleet.engines}
        specs = (*self.config.engines, *self.discovery.state.specs())
        self.fleet.reload(specs, self.config.recovery)
        for engine in self.fleet.engines:
            if engine.id not in before:
                self.metrics.add_engine(engine.id)
                if self.background.running:  # it joins placement once it answers
                    self.background.start(self.health.check, engine)
        self._bind_gauges()
        after = {e.id for e in self.fleet.engines}
        for gone in before - after:
            self.metrics.remove_engine(gone)
        return {
            "engines": [e.id for e in self.fleet.engines],
            "added": sorted(after - before),
            "removed": sorted(before - after),
        }

    def _bind_gauges(self) -> None:
        """Reservations move their engine's in-flight gauge (resolved once, not per leg)."""
        for engine in self.fleet.engines:
            engine.inflight_gauges = {
                leg: self.metrics.legs_inflight.labels(engine.id, leg) for leg in LEGS
            }

    def reload_file(self) -> dict[str, list[str]]:
        """Re-read the fleet file; a ConfigError leaves the running fleet untouched."""
        try:
            if self.config_path is None:
                raise ConfigError("<none>", ["the router was not started from a fleet file"])
            change = self.reload(load_config(self.config_path))
        except ConfigError:
            self.metrics.reloads.labels("failure").inc()
            raise
        self.metrics.reloads.labels("success").inc()
        self.metrics.reloaded_at.set_to_current_time()
        return change

    def journal_unadmitted(
        self,
        rid: str,
        endpoint: str,
        outcome: Outcome,
        status: int | None,
        message: str,
        caller: Caller | None = None,
    ) -> None:
        """Journal a request that ended before admission (refused, or its client left)."""
        line = JournalLine(
            request_id=rid,
            endpoint=endpoint,
            stream=False,
            outcome=outcome,
            status=status,
            phase="admission",
            message=message,
            attempts=[],
            prefill_s=None,
            first_byte_s=None,
            tokens=0,
            duration_s=0.0,
            at=round(time.time(), 3),
            client=caller.client if caller else None,
            key=caller.key if caller else None,
        )
        self.journal.write(line)
        self.export(line)
        log_request(line)

    def export(self, line: JournalLine) -> None:
        targets = self.config.admission.targets(line.cls or "")
        self.metrics.record(line, targets.ttft_slo_s)
        self.metrics.retry_credits.set(self.retry_budget.credits)

    async def wait_drained(self) -> None:
        """Return once no admitted request is left (reservations are released by then)."""
        await self.admission.wait_drained()

    def _disconnected(self, scope: trio.CancelScope, record: RunRecord) -> None:
        if record.owner.standing.finished:
            # hypercorn reports the end of a completed response as a disconnect too; what
            # is left (reading the engine's end of body) must not be cancelled for it
            return
        self.disconnects += 1
        record.client_left = True
        scope.cancel()

    async def aclose(self) -> None:
        await self.client.aclose()
        self.journal.close()


def _watcher(
    nursery: trio.Nursery, wait_disconnect: Callable[[], Awaitable[None]]
) -> Callable[[Callable[[], None]], None]:
    """``on_disconnect`` for a server that offers no callback: a task in the request's
    nursery that calls it once ``wait_disconnect`` returns."""

    def on_disconnect(callback: Callable[[], None]) -> None:
        nursery.start_soon(_call_after, wait_disconnect, callback)

    return on_disconnect


async def _call_after(event: Callable[[], Awaitable[None]], callback: Callable[[], None]) -> None:
    await event()
    callback()
