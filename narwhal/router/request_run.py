"""One client request's prefill/decode chain: the trio shell around its machine
(``narwhal.core.request``). The run holds four objects, each made once here: the machine,
the request's record (``narwhal.router.run_record``: its outcome and journal line), its
placement (``narwhal.router.placer``) and its legs' I/O (``narwhal.router.legs``). It runs
the attempt loop: places an attempt's legs, runs them, tells the machine what they did, and
does what the machine says: another leg, a reclaim, a retry after its delay, a resume, the
end. Each engine's breaker hears each leg's result (client errors and disconnects never
count).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from narwhal.core.config import FleetConfig
from narwhal.core.faults import RequestFault
from narwhal.core.handoff import Handoff
from narwhal.core.lifecycle import Lifecycle, State
from narwhal.core.records import JournalLine
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import (
    AfterFault,
    Continue,
    Decode,
    End,
    GoLocal,
    Prefill,
    Resume,
    Retry,
)
from narwhal.core.request_events import (
    CLIENT_LEFT,
    DISPATCHED,
    LEGS_DONE,
    NEXT_ATTEMPT,
    STREAM_ENDED,
    ContinuationPlaced,
    DecodeDue,
    DecodeFailed,
    LegFailed,
    PrefillAnswered,
)
from narwhal.core.requests import ClientRequest
from narwhal.observe import tracing
from narwhal.router import predicted
from narwhal.router.legs import RequestLegs
from narwhal.router.placer import Placer, Route
from narwhal.router.run_record import ClientSink, Measures, RouterState, RunRecord
from narwhal.stream.continuation import Kept


class RequestRun:
    """One prefill/decode chain: its machine, record, placement and legs, and the loop
    of its attempts."""

    __slots__ = ("legs", "machine", "placer", "prefill_s", "record", "router")

    def __init__(
        self,
        router: RouterState,
        config: FleetConfig,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
        *,
        arrival: float | None = None,
        fanout_index: int | None = None,
        progress: Callable[[State], None] | None = None,
    ) -> None:
        # backend ids are <rid>-a<attempt>-prefill|decode
        self.router = router
        arrival = trio.current_time() if arrival is None else arrival
        # the machine owns where the request stands; the record reads it there
        machine = self.machine = RequestMachine(
            config,
            deadline=arrival + config.serving.request_timeout_s,
            budget=router.retry_budget,
            rng=router.rng,
            body=req.body,
            chat=req.chat,
            new_kept=Kept if config.recovery.resume_streams > 0 else None,
            fanout_index=fanout_index,
            lifecycle=Lifecycle(progress),
        )
        record = self.record = RunRecord(config, req, rid, sink, machine, arrival=arrival)
        self.placer = Placer(router, config, req, machine)
        self.legs = RequestLegs(router, record, machine, keep_reply=self.placer.indexing)
        self.prefill_s: float | None = None  # the prefill's answer, from the arrival

    def cancel(self) -> None:
        """The client went away, or could not be told of the failure."""
        self.record.cancelled(self.machine.handle(CLIENT_LEFT))

    # what the machine asks, to answer a fault with a resume (``RunView``, told with events)
    def consumers(self) -> list[str]:
        return self.placer.consumers()

    @property
    def needed_s(self) -> float:
        return self.legs.first_byte_s or 0.0

    def measures(self) -> Measures:
        legs = self.legs
        attempts, tokens, prompt_tokens = self.machine.attempts, legs.tokens, legs.prompt_tokens()
        return Measures(attempts, self.prefill_s, legs.first_byte_s, tokens, prompt_tokens)

    def journal_line(self) -> JournalLine:
        return self.record.journal_line(self.measures())

    def local_possible(self) -> bool:
        """Whether its consumer may serve it alone (contract 4.5: a consumer's room is then
        enough to dispatch it)."""
        return self.placer.local_possible()

    def beyond_target(self) -> RequestFault | None:
        """A 429 for a request that cannot meet its class's TTFT target even with nothing
        queued ahead (contract 4.8), answered at once rather than after waiting; None: it
        may queue."""
        record, config = self.record, self.record.config
        if config.placement.policy != "predicted":
            return None
        target = config.admission.targets(record.flow.cls.value).ttft_slo_s
        if target is None:
            return None
        least = self.placer.unqueued_ttft()
        if least is not None:  # its place in the queue: the latest start that meets it
            record.due = record.arrival + target - least
        return predicted.beyond(target, least)

    # ---- the attempts ----------------------------------------------------------------------

    async def execute(self) -> None:
        """Run attempts until one succeeds or a fault may not be retried (then it is
        raised). The legs are awaited from here, not through a chain of attempt calls: a
        held stream's task keeps as few frames as it can (bench/results/request-machine)."""
        metrics, machine, legs = self.router.metrics, self.machine, self.legs
        machine.handle(DISPATCHED)
        try:
            await self.placer.token_ids(self.record.rid)
            while True:
                step = machine.handle(NEXT_ATTEMPT)
                metrics.attempts.inc()
                with tracing.Ending(legs.attempt_began(), legs.attempt_figures) as ending:
                    try:
                        route: Route | AfterFault
                        if type(step) is Continue:
                            route = await self._continue()
                        else:
                            route = self.placer.route(self.record.flow.cls.value)
                        after: AfterFault | None
                        if isinstance(route, GoLocal):
                            await self._local(route)
                            after = None
                        elif isinstance(route, Prefill):
                            after = await self._legs(route)
                        else:
                            after = route
                    except RequestFault as fault:  # a leg's, or placement's
                        after = machine.handle(LegFailed(fault, trio.current_time(), self))
                    if after is None:
                        self._stream_ended("completed")
                        return
                    ending.fail(after.fault.message)
                    self._count(after)
                if type(after) is End:
                    raise after.fault
                if type(after) is Retry:
                    await trio.sleep(after.delay_s)
        finally:  # a resumed stream whose client left (or the deadline) is counted too
            self._stream_ended("cancelled")

    def _count(self, after: AfterFault) -> None:
        """What follows a fault, counted."""
        metrics = self.router.metrics
        if type(after) is Resume:
            metrics.resumes_of("resumed").inc()
        elif type(after) is Retry:
            metrics.retries.inc()
        else:
            assert type(after) is End
            if after.resume is not None:
                metrics.resumes_of("refused").inc()
            self._stream_ended("failed")
            if after.retry_denied is not None:
                metrics.retries_denied.labels(after.retry_denied).inc()

    def _stream_ended(self, outcome: str) -> None:
        """How a resumed stream ended, counted once."""
        if self.machine.handle(STREAM_ENDED):
            self.router.metrics.resumes_of(outcome).inc()

    # ---- an attempt ------------------------------------------------------------------------

    async def _continue(self) -> Prefill | AfterFault:
        """A continuation's route (docs/contract.md section 6.4): the prompt's ids and the
        ids already sent are prefilled on a producer and decoded on a consumer that has not
        failed this request, within its context (not asked of one that has)."""
        producer, consumer = self.placer.continuation()
        context = None
        if consumer.id not in self.machine.failed_engines:
            context = await self.legs.context_of(consumer)
        now = trio.current_time()
        placed = ContinuationPlaced(producer.id, consumer.id, context, now, self)
        return self.machine.handle(placed)

    async def _local(self, route: GoLocal) -> None:
        """One leg to the consumer with no descriptor: it computes the prompt itself. Its
        first token is bounded by the prefill and first-token budgets together."""
        router, config, legs = self.router, self.record.config, self.legs
        consumer = router.fleet.by_id[route.consumer]
        self.prefill_s = None  # no remote prefill: the journal's prefill_s is null
        legs.local_attempt()
        router.fleet.turn += 1
        budget = config.serving.prefill_timeout_s + config.engine.first_token_timeout_s
        number = self.machine.attempt_line.number
        sent = trio.current_time()
        try:
            await legs.decode(consumer, None, number, first_token_s=budget)
        except RequestFault as fault:
            router.health.failure(consumer, fault, "decode", None)
            raise
        router.health.success(consumer)
        self.placer.decoded(consumer, legs.path, legs.reply, sent, self.record.flow.cls.value)

    async def _legs(self, route: Prefill) -> AfterFault | None:
        """The prefill leg, its handoff, and the decode leg: on the route's consumer, or
        where placement puts it once the descriptor is in hand. From its prefill until its
        decode leg is sent, the request holds a consumer's room already (its claim). None:
        the answer is whole; else what follows the fault the machine found."""
        health, machine, fleet = self.router.health, self.machine, self.router.fleet
        legs, placer, record = self.legs, self.placer, self.record
        producer = fleet.by_id[route.producer]
        number = machine.attempt_line.number
        fleet.turn += 1
        with fleet.claim_decode(record.req.model) as claim:
            started = trio.current_time()
            try:
                result = await legs.prefill(producer, number, asks_descriptor=route.asks_descriptor)
            except RequestFault as fault:
                health.failure(producer, fault, "prefill", None)
                raise
            health.success(producer)
            placer.prefilled(producer, started)
            handoff = machine.handle(PrefillAnswered(record.rid, producer.id, result, started))
            if machine.continuation is None:
                self.prefill_s = record.elapsed
            try:
                if route.consumer is None:
                    consumer = placer.place("decode", other_leg=producer.id)
                else:
                    consumer = fleet.by_id[route.consumer]
                sent = trio.current_time()
                decode = machine.handle(DecodeDue(consumer.id, sent, self))
                if not isinstance(decode, Decode):
                    return decode  # too old to hand off
                try:
                    await legs.decode(consumer, decode, number, claim=claim)
                except RequestFault as fault:
                    machine.handle(DecodeFailed(consumer.id, fault))
                    crossed_from = producer if decode.crossed else None
                    health.failure(consumer, fault, "decode", crossed_from)
                    raise
            finally:
                if handoff is not None:  # a prefill that asked for no descriptor left none
                    self._settle(handoff, machine.handle(LEGS_DONE))
            health.success(consumer)
            placer.decoded(consumer, legs.path, legs.reply, sent, record.flow.cls.value)
            if decode.crossed:  # its reclaims are told at once (the NIXL handshake is done)
                fleet.paired.add((producer.id, consumer.id))
        return None

    def _settle(self, handoff: Handoff, orphan: Handoff | None) -> None:
        """Count the descriptor's fate; an orphan goes to the reclaim queue (invariant 7).
        Runs in a ``finally``, cancellation included: nothing here awaits."""
        metrics = self.router.metrics
        metrics.handoffs_of("produced").inc()
        metrics.handoffs_of(handoff.fate.value).inc()
        metrics.handoff_held.observe(handoff.age(trio.current_time()))
        if orphan is not None:  # within the lease still, a reclaim frees it
            self.router.reclaimer.submit(orphan)
