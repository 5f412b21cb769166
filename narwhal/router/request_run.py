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

from narwhal.core import resume
from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import RequestFault
from narwhal.core.handoff import Handoff
from narwhal.core.lifecycle import Lifecycle, State
from narwhal.core.records import JournalLine
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import Continue, End, Resume, Retry
from narwhal.core.requests import ClientRequest
from narwhal.observe import tracing
from narwhal.router import predicted
from narwhal.router.legs import RequestLegs
from narwhal.router.placer import Placer
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
        refused, new_kept = None, None
        if config.recovery.resume_streams > 0:  # what the stream keeps to continue
            refused, new_kept = resume.refusal(req.body, chat=req.chat), Kept
        # the machine owns the lifecycle; the record reads it and ends it through the machine
        machine = self.machine = RequestMachine(
            config,
            deadline=arrival + config.serving.request_timeout_s,
            budget=router.retry_budget,
            rng=router.rng,
            new_kept=new_kept,
            refused=refused,
            fanout_index=fanout_index,
            lifecycle=Lifecycle(progress),
        )
        record = self.record = RunRecord(
            config, req, rid, sink, machine.lifecycle, machine.give_up, arrival=arrival
        )
        self.placer = Placer(router, config, req, self.machine)
        self.legs = RequestLegs(router, record, self.machine, keep_reply=self.placer.indexing)
        self.prefill_s: float | None = None  # the prefill's answer, from the arrival

    def cancel(self) -> None:
        """The client went away, or could not be told of the failure."""
        self.record.cancelled(self.machine.cancelled())

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
        machine.dispatched()
        try:
            await self.placer.token_ids(self.record.rid)
            while True:
                step = machine.attempt()
                metrics.attempts.inc()
                with tracing.Ending(legs.attempt_began(), legs.attempt_figures) as ending:
                    try:
                        producer: EngineState | None
                        consumer: EngineState | None
                        if type(step) is Continue:
                            producer, consumer = await self._continue()
                        else:
                            producer, consumer = self.placer.route(self.record.flow.cls.value)
                        if producer is None:
                            assert consumer is not None
                            await self._local(consumer)
                        else:
                            await self._legs(producer, consumer)
                        self._stream_ended("completed")
                        return
                    except RequestFault as fault:
                        ending.fail(fault.message)
                        after = self._after(fault)
                        if type(after) is Resume:
                            continue
                        if type(after) is End:
                            raise
                assert type(after) is Retry
                await trio.sleep(after.delay_s)
        finally:  # a resumed stream whose client left (or the deadline) is counted too
            self._stream_ended("cancelled")

    def _after(self, fault: RequestFault) -> Resume | Retry | End:
        """What the machine says follows ``fault``, counted."""
        metrics, req = self.router.metrics, self.record.req
        after = self.machine.failed(
            fault,
            now=trio.current_time(),
            body=req.body,
            chat=req.chat,
            consumers=self.placer.consumers,
            needed_s=self.legs.first_byte_s or 0.0,
        )
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
        return after

    def _stream_ended(self, outcome: str) -> None:
        """How a resumed stream ended, counted once."""
        if self.machine.stream_ended():
            self.router.metrics.resumes_of(outcome).inc()

    # ---- an attempt ------------------------------------------------------------------------

    async def _continue(self) -> tuple[EngineState, EngineState]:
        """A continuation's engines (docs/contract.md section 6.4): the prompt's ids and the
        ids already sent are prefilled on a producer and decoded on a consumer that has not
        failed this request, within its context."""
        producer, consumer = self.placer.continuation()
        self.machine.within_context(consumer.id, await self.legs.context_of(consumer))
        return producer, consumer

    async def _local(self, consumer: EngineState) -> None:
        """One leg to the consumer with no descriptor: it computes the prompt itself. Its
        first token is bounded by the prefill and first-token budgets together."""
        router, config, legs = self.router, self.record.config, self.legs
        self.machine.going_local(consumer.id)
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

    async def _legs(self, producer: EngineState, consumer: EngineState | None) -> None:
        """The prefill leg, its handoff, and the decode leg: on ``consumer``, or where
        placement puts it once the descriptor is in hand. From its prefill until its decode
        leg is sent, the request holds a consumer's room already (its claim)."""
        health, machine, fleet = self.router.health, self.machine, self.router.fleet
        legs, placer, record = self.legs, self.placer, self.record
        number = machine.attempt_line.number
        with fleet.claim_decode(record.req.model) as claim:
            started = trio.current_time()
            try:
                result = await legs.prefill(producer, number)
            except RequestFault as fault:
                health.failure(producer, fault, "prefill", None)
                raise
            health.success(producer)
            placer.prefilled(producer, started)
            handoff = machine.prefill_answered(record.rid, producer.id, result, started)
            if machine.continuation is None:
                self.prefill_s = record.elapsed
            try:
                consumer = consumer or placer.place("decode", other_leg=producer.id)
                sent = trio.current_time()
                decode = machine.handing_off(consumer.id, sent)
                try:
                    await legs.decode(consumer, decode, number, claim=claim)
                except RequestFault as fault:
                    machine.decode_failed(consumer.id, fault)
                    crossed_from = producer if decode.crossed else None
                    health.failure(consumer, fault, "decode", crossed_from)
                    raise
            finally:
                if handoff is not None:  # a prefill that asked for no descriptor left none
                    self._settle(handoff, machine.leg_done())
            health.success(consumer)
            placer.decoded(consumer, legs.path, legs.reply, sent, record.flow.cls.value)
            if decode.crossed:  # its reclaims are told at once (the NIXL handshake is done)
                fleet.paired.add((producer.id, consumer.id))

    def _settle(self, handoff: Handoff, orphan: Handoff | None) -> None:
        """Count the descriptor's fate; an orphan goes to the reclaim queue (invariant 7).
        Runs in a ``finally``, cancellation included: nothing here awaits."""
        metrics = self.router.metrics
        metrics.handoffs_of("produced").inc()
        metrics.handoffs_of(handoff.fate.value).inc()
        metrics.handoff_held.observe(handoff.age(trio.current_time()))
        if orphan is not None:  # within the lease still, a reclaim frees it
            self.router.reclaimer.submit(orphan)
