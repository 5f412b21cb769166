"""One client request's prefill/decode chain: the trio shell around its machine
(``narwhal.core.request``). It places the legs (``narwhal.core.placement``), runs them
(``narwhal.router.legs``), tells the machine what they did, and does what the machine says:
another leg, a reclaim, a retry after its delay, a resume, the end. Each engine's breaker
hears each leg's result (client errors and disconnects never count).

Decode first (``local_prefill_tokens`` or ``local_prefill_when_busy``) places the consumer
before the producer, and an attempt may then run on its consumer alone.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from narwhal.core import resume
from narwhal.core.config import FleetConfig
from narwhal.core.disaggregation import Decision, decode_first, local_or_remote, wants_prompt_side
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import NoCapacity, Phase, RequestFault
from narwhal.core.handoff import Handoff
from narwhal.core.lifecycle import State
from narwhal.core.placement import Choice, Holdings, choose
from narwhal.core.policies import prefix_key
from narwhal.core.precise_index import TokenPrompt
from narwhal.core.prefix_index import Prompt, prompt_of, reply_text
from narwhal.core.records import AttemptLine
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import Continue, End, GoLocal, Prefill, Resume, Retry
from narwhal.core.requests import ClientRequest
from narwhal.core.token_ids import given_ids
from narwhal.observe import tracing
from narwhal.router import predicted
from narwhal.router.legs import RequestLegs
from narwhal.router.predicted import Forecast
from narwhal.router.run_record import ClientSink, RouterState
from narwhal.stream.continuation import Kept


class RequestRun(RequestLegs):
    """One prefill/decode chain: its machine, its placement keys, the legs it runs."""

    __slots__ = ("_adapter", "_forecast", "_prefix", "_prompt", "_tokens", "prefill_s")

    def __init__(
        self,
        router: RouterState,
        config: FleetConfig,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
        *,
        arrival: float | None = None,
        choice: int | None = None,
        progress: Callable[[State], None] | None = None,
    ) -> None:
        # backend ids are <rid>-a<attempt>-prefill|decode
        super().__init__(router, config, req, rid, sink, arrival=arrival, progress=progress)
        refused, new_kept = None, None
        if config.recovery.resume_streams > 0:  # what the stream keeps to continue
            refused, new_kept = resume.refusal(req.body, chat=req.chat), Kept
        self.machine = RequestMachine(
            config,
            deadline=self.deadline,
            budget=router.retry_budget,
            rng=router.rng,
            new_kept=new_kept,
            refused=refused,
            choice=choice,
            lifecycle=self.lifecycle,
        )
        self.prefill_s: float | None = None  # the prefill's answer, from the arrival
        self._forecast: Forecast | None = None  # policy "predicted": the attempt's plan
        placement = config.placement
        # the LoRA adapter it runs under (None: a base model): the prefix indexes keep
        # each adapter's blocks apart
        model = req.model
        self._adapter = model if model and router.fleet.catalog.adapter(model) else None
        # the prefix index is kept when placement reads it
        self._indexing = placement.prefix_affinity or decode_first(placement)
        # what placement keys on, read once, for every attempt; the body then holds only
        # the JSON that came. The prefix keys producer affinity (None: affinity off)
        self._prefix: str | None = None
        if placement.prefix_affinity:
            self._prefix = prefix_key(req.body, chat=req.chat)
        self._prompt: Prompt | None = None  # its blocks, for the prefix index
        if self._indexing:  # decode first reads the blocks too, and implies indexing
            self._prompt = prompt_of(req.body, chat=req.chat, adapter=self._adapter)
        # its token ids, for engines whose KV events say what they hold: a prompt of ids
        # is its own; others are asked of the engines' tokenizer before the first placement
        self._tokens: TokenPrompt | None = None
        if self._indexing and config.kv_events.mode != "off":
            given = given_ids(req.body, chat=req.chat)
            self._tokens = None if given is None else TokenPrompt(given, self._adapter)
        req.body.forget_prompt()

    def cancel(self) -> None:
        self.cancelled_in = self.machine.cancelled()

    @property
    def attempts(self) -> list[AttemptLine]:
        return self.machine.attempts

    def measures(self) -> tuple[list[AttemptLine], float | None, float | None, int]:
        return self.machine.attempts, self.prefill_s, self.first_byte_s, self.tokens

    def prompt_tokens(self) -> int | None:
        if self.prefill_result is None:  # a local attempt: its consumer's usage counts them
            return self._local_prompt_tokens
        return self.prefill_result.prompt_tokens

    def local_possible(self) -> bool:
        """Local on any consumer (the whole prompt is under ``local_prefill_tokens``), or
        wherever the producers are busy (``local_prefill_when_busy``); never a request
        whose answer needs the producer's prompt side."""
        placement = self.config.placement
        if wants_prompt_side(self.req.body):
            return False
        threshold = placement.local_prefill_tokens
        short = threshold > 0 and self._prompt_blocks().tokens < threshold
        return short or placement.local_prefill_when_busy or placement.policy == "predicted"

    def beyond_target(self) -> RequestFault | None:
        if self.config.placement.policy != "predicted":
            return None
        fleet, now, req = self.router.fleet, trio.current_time(), self.req
        holdings = Holdings(self._prompt_blocks(), fleet.prefixes, now, fleet.precise, self._tokens)
        target = self.config.admission.targets(self.flow.cls.value).ttft_slo_s
        if target is None:
            return None
        least = predicted.unqueued_ttft(fleet, self.config, holdings, now, req.model, req.body)
        if least is not None:  # its place in the queue: the latest start that meets it
            self.due = self.arrival + target - least
        return predicted.beyond(target, least)

    def _prompt_blocks(self) -> Prompt:
        if self._prompt is None:  # once per request: every attempt sees the same blocks
            self._prompt = prompt_of(self.req.body, chat=self.req.chat, adapter=self._adapter)
        return self._prompt

    # ---- the attempts ----------------------------------------------------------------------

    async def execute(self) -> None:
        """Run attempts until one succeeds or a fault may not be retried (then it is
        raised). The legs are awaited from here, not through a chain of attempt calls: a
        held stream's task keeps as few frames as it can (bench/results/request-machine)."""
        metrics, machine = self.router.metrics, self.machine
        machine.dispatched()
        try:
            await self._token_ids()
            while True:
                step = machine.attempt()
                metrics.attempts.inc()
                span = self._attempt_span = self._start_attempt_span()
                with tracing.Ending(span, self._attempt_figures) as ending:
                    try:
                        producer: EngineState | None
                        consumer: EngineState | None
                        if type(step) is Continue:
                            producer, consumer = await self._continue()
                        else:
                            producer, consumer = self._route()
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

    async def _token_ids(self) -> None:
        """The prompt's token ids, asked of an engine's tokenizer where they can change
        placement (engines whose KV events say what they hold)."""
        tokens = self.router.tokens
        first = decode_first(self.config.placement)
        if self._indexing and self._tokens is None and tokens.wanted(decode_first=first):
            self._tokens = await tokens.ids_of(self.req, self.rid, self._adapter)

    def _after(self, fault: RequestFault) -> Resume | Retry | End:
        """What the machine says follows ``fault``, counted."""
        metrics = self.router.metrics
        after = self.machine.failed(
            fault,
            now=trio.current_time(),
            body=self.req.body,
            chat=self.req.chat,
            consumers=self._consumers,
            needed_s=self.first_byte_s or 0.0,
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

    def _producers(self) -> list[str]:
        fleet = self.router.fleet
        candidates, _ = fleet.placeable("prefill", trio.current_time(), self.req.model)
        return [engine.id for engine in candidates]

    def _consumers(self) -> list[str]:
        fleet = self.router.fleet
        candidates, _ = fleet.placeable("decode", trio.current_time(), self.req.model)
        return [engine.id for engine in candidates]

    def _stream_ended(self, outcome: str) -> None:
        """How a resumed stream ended, counted once."""
        if self.machine.stream_ended():
            self.router.metrics.resumes_of(outcome).inc()

    # ---- placement -------------------------------------------------------------------------

    def _place(self, leg: Leg, other_leg: str | None = None) -> EngineState:
        return self._placed(leg, self._choice(leg, other_leg))

    def _choice(self, leg: Leg, other_leg: str | None = None) -> Choice:
        """Where placement puts ``leg`` now, and why (nothing counted yet)."""
        fleet, health = self.router.fleet, self.router.health
        model = self.req.model
        candidates, held_in = fleet.placeable(leg, trio.current_time(), model)
        health.note_placement(leg, held_in, model)
        choice = choose(
            candidates,
            leg,
            self.config.placement,
            rng=self.router.rng,
            now=trio.current_time(),
            turn=fleet.turn,
            avoid=self.machine.failed_engines,
            other_leg=other_leg,
            key=self._prefix if leg == "prefill" else None,
            ring=fleet.ring,
            prompt=self._prompt_blocks() if self.config.placement.prefix_affinity else None,
            index=fleet.prefixes,
            precise=fleet.precise,
            tokens=self._tokens,
            adapter=self._adapter,
            limits=self.config.admission,
        )
        if choice is None:
            raise NoCapacity(
                f"no placeable {'producer' if leg == 'prefill' else 'consumer'} engine",
                phase=Phase.ADMISSION,
            )
        return choice

    def _placed(self, leg: Leg, choice: Choice) -> EngineState:
        """The leg goes where ``choice`` says: counted, and an adapter noted there."""
        self.router.metrics.placements_of(leg, choice.reason).inc()
        if self._adapter is not None:  # on its way there: the engine's series may not say
            choice.engine.adapters.placed(self._adapter)
        return choice.engine

    def _disaggregation(self, consumer: EngineState) -> Decision:
        """Whether this attempt skips the remote prefill (conditional disaggregation,
        decode first). A request whose answer needs the prompt side the producer computes
        (an echo, prompt logprobs, the prompt's token ids) always has it."""
        if wants_prompt_side(self.req.body):
            return "disaggregated"
        placement, flow = self.config.placement, self.config.admission
        now = trio.current_time()
        fleet = self.router.fleet
        holdings = Holdings(self._prompt_blocks(), fleet.prefixes, now, fleet.precise, self._tokens)
        uncached = holdings.uncached(consumer.id)
        limits = (placement.metrics_interval_s, flow.engine_waiting_limit, flow.kv_usage_limit)
        busy = placement.local_prefill_when_busy and self.router.fleet.saturated(
            "prefill", now, *limits, model=self.req.model
        )
        return local_or_remote(
            uncached,
            placement,
            producers_saturated=busy,
            consumer_saturated=busy and consumer.room(now, *limits, "decode")[0] <= 0,
        )

    def _route(self) -> tuple[EngineState | None, EngineState | None]:
        """A fresh attempt's engines: (None, its consumer) for one local leg; (its
        producer, its consumer or None to place once the descriptor is in hand)."""
        route: GoLocal | Prefill
        consumer: EngineState | None
        self._forecast = None
        planned = self._predicted() if self.config.placement.policy == "predicted" else None
        if planned is not None:
            route, producer, consumer = planned
        elif decode_first(self.config.placement):
            route, producer, consumer = self._decode_first()
        else:
            route, producer, consumer = self._producer_first()
        if isinstance(route, GoLocal):
            return None, producer if consumer is None else consumer
        self._prefilling(producer, route.handoff)
        return producer, consumer

    def _decode_first(self) -> tuple[GoLocal | Prefill, EngineState, EngineState]:
        choice = self._choice("decode")
        decision = self._disaggregation(choice.engine)
        if self.machine.wants_other_consumer(choice.engine.id, decision, self._producers):
            other = self._choice("decode", other_leg=choice.engine.id)
            if other.engine is not choice.engine:
                choice, decision = other, self._disaggregation(other.engine)
        consumer = self._placed("decode", choice)
        local = self.machine.decode_first(consumer.id, decision)
        if local is not None:
            self.router.metrics.disaggregation_of(decision).inc()
            return local, consumer, consumer
        producer = self._place("prefill", other_leg=consumer.id)
        route = self.machine.producer_placed(
            producer.id,
            consumer=consumer.id,
            only_consumer=None,
            consumers=1,
            body=self.req.body,
        )
        counted = route.decision if type(route) is GoLocal else decision
        self.router.metrics.disaggregation_of(counted).inc()
        return route, producer, consumer

    def _predicted(self) -> tuple[GoLocal | Prefill, EngineState, EngineState] | None:
        """Policy "predicted": the plan of least predicted TTFT (None: no plan, such as a
        request that needs its prefill leg on a fleet of one engine; placed as before)."""
        fleet, now, req = self.router.fleet, trio.current_time(), self.req
        holdings = Holdings(self._prompt_blocks(), fleet.prefixes, now, fleet.precise, self._tokens)
        avoid, cls = self.machine.failed_engines, self.flow.cls.value
        seen = self._forecast = predicted.plan_attempt(
            fleet, self.config, holdings, now, model=req.model, avoid=avoid, cls=cls, body=req.body
        )
        if seen is None:
            return None
        self.machine.attempt_line.predicted_ttft_s = round(seen.plan.ttft_s, 4)
        consumer = self._placed("decode", Choice(fleet.by_id[seen.plan.consumer], "predicted"))
        if seen.plan.producer is None:
            self.router.metrics.disaggregation_of("local_predicted").inc()
            return GoLocal(consumer.id, "local_predicted"), consumer, consumer
        producer = self._placed("prefill", Choice(fleet.by_id[seen.plan.producer], "predicted"))
        route = self.machine.producer_placed(
            producer.id, consumer=consumer.id, only_consumer=None, consumers=1, body=req.body
        )
        decision = route.decision if type(route) is GoLocal else "disaggregated"
        self.router.metrics.disaggregation_of(decision).inc()
        return route, producer, consumer

    def _producer_first(self) -> tuple[GoLocal | Prefill, EngineState, None]:
        consumers, _ = self.router.fleet.placeable("decode", trio.current_time(), self.req.model)
        only = self.machine.only_engine([c.id for c in consumers])
        producer = self._place("prefill", other_leg=only)
        route = self.machine.producer_placed(
            producer.id,
            consumer=None,
            only_consumer=only,
            consumers=len(consumers),
            body=self.req.body,
        )
        if type(route) is GoLocal:
            self.router.metrics.disaggregation_of(route.decision).inc()
        return route, producer, None

    # ---- an attempt ------------------------------------------------------------------------

    async def _continue(self) -> tuple[EngineState, EngineState]:
        """A continuation's engines (docs/contract.md section 6.4): the prompt's ids and the
        ids already sent are prefilled on a producer and decoded on a consumer that has not
        failed this request, within its context."""
        machine = self.machine
        self._forecast = None  # placed by the rules: a continuation's prompt is its own
        consumer = self._place("decode")
        machine.resume_consumer(consumer.id)
        producer = self._place("prefill", other_leg=consumer.id)
        route = machine.continuation_prefill(producer.id, consumer.id)
        self._prefilling(producer, route.handoff)
        machine.within_context(consumer.id, await self._context(consumer))
        return producer, consumer

    def _prefilling(self, producer: EngineState, handoff: bool) -> None:
        self.router.fleet.turn += 1
        self.machine.prefill_sent(producer.id, handoff=handoff)

    async def _local(self, consumer: EngineState) -> None:
        """One leg to the consumer with no descriptor: it computes the prompt itself. Its
        first token is bounded by the prefill and first-token budgets together."""
        self.machine.going_local(consumer.id)
        self.prefill_s = None  # no remote prefill: the journal's prefill_s is null
        self.prefill_result = None
        self.router.fleet.turn += 1
        engine_cfg = self.config.engine
        budget = self.config.serving.prefill_timeout_s + engine_cfg.first_token_timeout_s
        number = self.machine.attempt_line.number
        sent = trio.current_time()
        try:
            await self._decode(consumer, None, number, first_token_s=budget)
        except RequestFault as fault:
            self.router.health.failure(consumer, fault, "decode", None)
            raise
        self.router.health.success(consumer)
        self._learn_decode(sent)
        self._remember(consumer, self._consumer_holds())

    async def _legs(self, producer: EngineState, consumer: EngineState | None) -> None:
        """The prefill leg, its handoff, and the decode leg: on ``consumer``, or where
        placement puts it once the descriptor is in hand. From its prefill until its decode
        leg is sent, the request holds a consumer's room already (its claim)."""
        health, machine, fleet = self.router.health, self.machine, self.router.fleet
        number = machine.attempt_line.number
        with fleet.claim_decode(self.req.model) as self._claim:
            started = trio.current_time()
            try:
                result = await self._prefill(producer, number)
            except RequestFault as fault:
                health.failure(producer, fault, "prefill", None)
                raise
            health.success(producer)
            if self._forecast is not None:
                now = trio.current_time()
                predicted.learn_prefill(fleet.costs, self._forecast, now - started, now)
            handoff = machine.prefill_answered(self.rid, producer.id, result, started)
            if machine.continuation is None:
                self._remember(producer, self._prompt_blocks() if self._indexing else None)
                self.prefill_result = result  # its prompt side is served with the answer
                self.prefill_s = self.elapsed
            try:
                consumer = consumer or self._place("decode", other_leg=producer.id)
                sent = trio.current_time()
                decode = machine.handing_off(consumer.id, sent)
                try:
                    await self._decode(consumer, decode, number)
                except RequestFault as fault:
                    machine.decode_failed(consumer.id, fault)
                    crossed_from = producer if decode.crossed else None
                    health.failure(consumer, fault, "decode", crossed_from)
                    raise
            finally:
                if handoff is not None:  # a prefill that asked for no descriptor left none
                    self._settle(handoff, machine.leg_done())
            health.success(consumer)
            self._learn_decode(sent)
            self._remember(consumer, self._consumer_holds())
            if decode.crossed:  # its reclaims are told at once (the NIXL handshake is done)
                self.router.fleet.paired.add((producer.id, consumer.id))

    def _learn_decode(self, sent: float) -> None:
        """A decode leg sent at ``sent`` ended well: what it teaches the cost model."""
        path, seen = self._path, self._forecast
        if seen is not None and path is not None:
            first, last = path.first_token_at, path.last_output_at
            costs, cls = self.router.fleet.costs, self.flow.cls.value
            predicted.learn_decode(costs, seen, sent, first, last, path.tokens)
            target = self.config.admission.targets(cls).tpot_slo_s
            metrics = self.router.metrics
            predicted.account(metrics, seen, first, last, path.tokens, cls=cls, tpot_slo_s=target)

    def _settle(self, handoff: Handoff, orphan: Handoff | None) -> None:
        """Count the descriptor's fate; an orphan goes to the reclaim queue (invariant 7).
        Runs in a ``finally``, cancellation included: nothing here awaits."""
        metrics = self.router.metrics
        metrics.handoffs_of("produced").inc()
        metrics.handoffs_of(handoff.fate.value).inc()
        metrics.handoff_held.observe(handoff.age(trio.current_time()))
        if orphan is not None:  # within the lease still, a reclaim frees it
            self.router.reclaimer.submit(orphan)

    # ---- what a consumer holds, for the prefix index -----------------------------------------

    def _consumer_holds(self) -> Prompt | None:
        """The prompt and what it generated: a next turn starts with both."""
        if not self._indexing or self._reply is None:
            return None
        reply = reply_text(self._reply.text(), chat=self.req.chat)
        return self._prompt_blocks().followed_by(reply)

    def _remember(self, engine: EngineState, prompt: Prompt | None) -> None:
        if prompt is not None:
            self.router.fleet.prefixes.record(engine.id, prompt.blocks, trio.current_time())
