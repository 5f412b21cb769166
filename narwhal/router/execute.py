"""One client request's attempt: prefill on a producer, hand off, decode on a consumer, relay.

This is the thin trio shell around the sans-IO pieces (connector, SSE parser, stream
classification, lifecycle table). Timeouts are cancel scopes owned here: the prefill
clock over the whole producer leg, and one decode clock that is the first-token budget
until the first generated token (it starts before the decode request is opened) and the
silence budget between transport chunks after it. The request deadline is the outer
scope, owned by ``Router.handle``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import trio
from opentelemetry.trace import Span, SpanKind

from narwhal import tracing
from narwhal.core import resume
from narwhal.core.classify import Flow
from narwhal.core.config import FleetConfig
from narwhal.core.connector import PrefillResult
from narwhal.core.disaggregation import Decision, decode_first, wants_prompt_side
from narwhal.core.disaggregation import decide as decide_local
from narwhal.core.faults import (
    BreakerClass,
    DeadlineExpired,
    EngineFaults,
    FirstTokenTimeout,
    HandoffExpired,
    NoCapacity,
    NotDispatched,
    Phase,
    PrefillTimeout,
    RequestFault,
    ShuttingDown,
    SilenceTimeout,
)
from narwhal.core.fleet import DecodeClaim, EngineState, Fleet, Leg
from narwhal.core.handoff import Fate, Handoff, too_old
from narwhal.core.lifecycle import Input, Lifecycle, State
from narwhal.core.placement import Holdings, choose
from narwhal.core.policies import prefix_key
from narwhal.core.precise_index import TokenPrompt
from narwhal.core.prefix_index import Prompt, prompt_of, reply_text
from narwhal.core.requests import ClientRequest
from narwhal.core.retry import RetryBudget, RetryDecision, decide
from narwhal.core.token_ids import given_ids
from narwhal.engines.client import DecodeStream, EngineClient
from narwhal.metrics import Metrics, RequestBuckets
from narwhal.router.health import Health
from narwhal.router.journal import AttemptLine, Caller, JournalLine, Outcome
from narwhal.router.reclaim import Reclaimer
from narwhal.router.stream_reactor import StreamReactor
from narwhal.router.token_path import ClientStream, DirectWrite, TokenPath
from narwhal.router.token_source import TokenSource
from narwhal.stream.assemble import Assembler, Echo, prompt_echo
from narwhal.stream.continuation import Kept, Reframer, without_ids
from narwhal.stream.rules import Reply, Rewrite, StreamRelay
from narwhal.stream.sse import frame

PHASE_OF = {
    State.ADMITTED: Phase.ADMISSION,
    State.PREFILLING: Phase.PREFILL,
    State.HANDOFF: Phase.HANDOFF,
    State.DECODING: Phase.DECODE,
    State.GENERATING: Phase.STREAM,
    State.COMMITTED: Phase.STREAM,
    State.FINISHED: Phase.STREAM,
}


class ClientSink(Protocol):
    """Where the client's bytes go (the ASGI layer implements it). It keeps no state: where
    the response stands is the request's lifecycle."""

    async def commit(self, data: bytes) -> None: ...  # 200 + SSE headers + first bytes
    async def send(self, data: bytes) -> None: ...
    async def end(self, data: bytes = b"") -> None: ...
    # the terminal event after the commit point, then the body cut, never ended (SPEC 6);
    # abandon: the deadline or the drain gave up, the client is not waited for
    async def cut(self, data: bytes, *, abandon: bool = False) -> None: ...
    async def respond_json(self, status: int, body: bytes) -> None: ...
    @property
    def direct(self) -> DirectWrite | None: ...  # a write to the connection without waiting
    def delivered(self) -> bool: ...  # False: a write broke (the client left); bytes lost


class RouterState(Protocol):
    """What an attempt needs from the router (see ``narwhal.router.service.Router``)."""

    client: EngineClient
    fleet: Fleet
    health: Health
    metrics: Metrics
    retry_budget: RetryBudget
    rng: random.Random
    reclaimer: Reclaimer
    reactor: StreamReactor
    tokens: TokenSource


class RunRecord:
    """What every run of a client request records for ``Router.handle``: its lifecycle,
    outcome and journal line, and how a fault is told to the client. ``RequestRun`` is one
    prefill/decode chain; ``narwhal.router.fanout.FanOutRun`` several."""

    # slotted: a held stream's run is one of its larger objects (bench/held_stream_objects.py)
    __slots__ = (
        "arrival",
        "arrived_at",
        "caller",
        "cancelled_in",
        "client_left",
        "config",
        "cut",
        "fault",
        "flow",
        "lifecycle",
        "outcome",
        "queued_s",
        "req",
        "rid",
        "sink",
        "span",
        "status",
        "trace",
    )

    def __init__(
        self,
        config: FleetConfig,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
        *,
        arrival: float | None = None,
        progress: Callable[[State], None] | None = None,
    ) -> None:
        self.config = config  # taken once, at admission: a reload applies to new requests
        self.req = req
        self.rid = rid
        self.sink = sink
        self.arrival = trio.current_time() if arrival is None else arrival
        self.lifecycle = Lifecycle(progress)
        self.outcome: Outcome = "cancelled"  # until something else is known
        self.status: int | None = None
        self.fault: RequestFault | None = None
        self.cancelled_in: Phase | None = None
        self.caller = Caller()  # who sent it (set by Router.handle)
        self.arrived_at = time.time()  # wall clock, for the journal
        self.span: Span | None = None  # the request's span (Router.handle), tracing on
        # tracing off: the client's traceparent/tracestate, which every leg carries unchanged
        self.trace: tracing.Headers = tracing.NO_HEADERS
        self.cut = False  # the last write (the answer's end) was cut on its way: not whole
        self.client_left = False  # its client's disconnect cancelled it (nobody to tell)
        self.flow = Flow()  # its class and fairness key in the admission queue (SPEC 4.5)
        self.queued_s = 0.0  # how long it waited there

    @property
    def phase(self) -> Phase:
        return PHASE_OF[self.lifecycle.state]

    @property
    def elapsed(self) -> float:
        return trio.current_time() - self.arrival

    @property
    def deadline(self) -> float:
        return self.arrival + self.config.serving.request_timeout_s

    def cancel(self) -> None:
        """The client went away (or could not be told of the failure): record where."""
        self.cancelled_in = self.phase
        self.lifecycle.advance(Input.CANCEL)

    @contextmanager
    def last_write(self) -> Iterator[None]:
        """Around the write of the answer's end, which comes after the request is finished
        (``Input.DONE``). The request is completed only once its last byte is written: a
        client that leaves while that write waits (the server swallows the broken write,
        and a finished request's disconnect cancels nothing) is a cancelled request. If
        the deadline or the drain cuts the write, ``fail`` records that fault instead
        (the client did not get the whole answer), though it can tell the client nothing."""
        try:
            yield
        except BaseException:
            self.cut = True
            self._left()  # until ``fail`` says which fault cut it, if one did
            raise
        if not self.sink.delivered():
            self._left()

    def _left(self) -> None:
        """The client did not get the whole answer: cancelled, with no status, as a client
        gone mid-stream is."""
        self.outcome, self.status = "cancelled", None
        self.cancelled_in = self.phase

    async def fail(self, fault: RequestFault) -> None:
        """Tell the client: JSON before the commit point, one terminal event after it, and
        then the body is cut (SPEC 6): a client that ignores error events must not count
        the stream a success."""
        if self.lifecycle.finished:
            if self.cut:  # the connection is closed: the journal says why, nobody else can
                self._record(fault)
            return
        committed = self.lifecycle.committed
        self.lifecycle.advance(Input.FAIL)
        self._record(fault)
        error = fault.error_json()
        if committed:
            given_up = isinstance(fault, DeadlineExpired | ShuttingDown)  # invariant 10
            await self._end_stream(frame(error), abandon=given_up)
        else:
            await self.sink.respond_json(fault.status, error)

    def _record(self, fault: RequestFault) -> None:
        self.fault, self.status = fault, fault.status
        if isinstance(fault, DeadlineExpired):
            self.outcome = "expired"
        else:  # a request the queue never let go to an engine was rejected, not failed
            self.outcome = "rejected" if isinstance(fault, NotDispatched) else "failed"

    async def _end_stream(self, data: bytes, *, abandon: bool) -> None:
        await self.sink.cut(data, abandon=abandon)

    def measures(self) -> tuple[list[AttemptLine], float | None, float | None, int]:
        """(attempts, ttft_s, first_byte_s, tokens) for the journal."""
        raise NotImplementedError

    def prompt_tokens(self) -> int | None:
        """The prompt tokens an engine computed for this request (None: not known)."""
        return None

    def local_possible(self) -> bool:
        """Whether its consumer may serve it alone (SPEC 4.5: a consumer's room is then
        enough to dispatch it)."""
        return False

    def journal_line(self) -> JournalLine:
        fault = self.fault
        attempts, ttft_s, first_byte_s, tokens = self.measures()
        return JournalLine(
            request_id=self.rid,
            endpoint=self.req.endpoint,
            stream=self.req.stream,
            outcome=self.outcome,
            status=self.status,
            phase=fault.phase if fault else self.cancelled_in,
            message=fault.message if fault else None,
            attempts=attempts,
            ttft_s=ttft_s,
            first_byte_s=first_byte_s,
            tokens=tokens,
            duration_s=self.elapsed,
            prompt_tokens=self.prompt_tokens(),
            at=round(self.arrived_at, 3),
            client=self.caller.client,
            key=self.caller.key,
            queued_s=round(self.queued_s, 6),
            cls=self.flow.cls.value,
            model=self.req.model,
        )


class RequestRun(RunRecord):
    """One prefill/decode chain: attempts, legs, the relay shell, measurements."""

    __slots__ = (
        "_adapter",
        "_attempt_span",
        "_claim",
        "_collector",
        "_continuation",
        "_echo",
        "_indexing",
        "_kept",
        "_last_output_at",
        "_local_prompt_tokens",
        "_path",
        "_prefix",
        "_prompt",
        "_refused",
        "_reply",
        "_resume_counted",
        "_resumes",
        "_tokens",
        "attempts",
        "choice",
        "failed_engines",
        "first_byte_s",
        "prefill_result",
        "router",
        "tokens",
        "ttft_s",
    )

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
        super().__init__(config, req, rid, sink, arrival=arrival, progress=progress)
        self.router = router
        self.choice = choice  # a fan-out's sub-request: the choice index it answers
        self.attempts: list[AttemptLine] = []
        self.failed_engines: set[str] = set()
        self.ttft_s: float | None = None
        self.first_byte_s: float | None = None
        self.tokens = 0
        self.prefill_result: PrefillResult | None = None  # the last attempt's
        self._echo: Echo | None = None  # a streamed echo (completions)
        self._attempt_span: Span | None = None  # the running attempt's, tracing on
        # the prompt prefix that keys producer affinity (None: affinity off), once per
        # request: every retry keys the same
        self._prefix: str | None = None
        self._prompt: Prompt | None = None  # its blocks, for the prefix index
        self._claim: DecodeClaim | None = None  # the current attempt's, until its decode leg
        placement = config.placement
        # the LoRA adapter it runs under (None: a base model): the prefix indexes keep
        # each adapter's blocks apart
        model = req.model
        self._adapter = model if model and router.fleet.catalog.adapter(model) else None
        # the prefix index is kept when placement reads it
        self._indexing = placement.prefix_affinity or decode_first(placement)
        # what placement keys on, read once; the body then holds only the JSON that came
        if placement.prefix_affinity:
            self._prefix = prefix_key(req.body, chat=req.chat)
        if self._indexing:  # decode first reads the blocks too, and implies indexing
            self._prompt = prompt_of(req.body, chat=req.chat, adapter=self._adapter)
        # its token ids, for engines whose KV events say what they hold: a prompt of ids
        # is its own; others are asked of the engines' tokenizer before the first placement
        self._tokens: TokenPrompt | None = None
        if self._indexing and config.kv_events.mode != "off":
            given = given_ids(req.body, chat=req.chat)
            self._tokens = None if given is None else TokenPrompt(given, self._adapter)
        req.body.forget_prompt()
        self._reply: Reply | None = None  # the generated text, for the index
        self._local_prompt_tokens: int | None = None
        # stream resume (SPEC 6.4): what the stream keeps to continue, why it may not
        self._kept: Kept | None = None
        self._refused: str | None = None
        if config.recovery.resume_streams > 0:
            self._refused = resume.refusal(req.body, chat=req.chat)
            self._kept = Kept()
        self._continuation: dict[str, Any] | None = None  # a resume's /v1/completions body
        self._resumes = 0
        self._resume_counted = False  # how the resumed stream ended is counted
        self._collector: Assembler | None = None  # a JSON answer, across a resume
        self._path: TokenPath | None = None  # the running decode leg's
        self._last_output_at: float | None = None  # the client's last token, so far

    def measures(self) -> tuple[list[AttemptLine], float | None, float | None, int]:
        return self.attempts, self.ttft_s, self.first_byte_s, self.tokens

    def prompt_tokens(self) -> int | None:
        if self.prefill_result is None:  # a local attempt: its consumer's usage counts them
            return self._local_prompt_tokens
        return self.prefill_result.prompt_tokens

    async def execute(self) -> None:
        """Run attempts until one succeeds or a fault may not be retried (then it is raised)."""
        try:
            await self._attempts()
        finally:  # a resumed stream whose client left (or the deadline) is counted too
            self._resumed_stream_ended("cancelled")

    async def _attempts(self) -> None:
        metrics = self.router.metrics
        tokens = self.router.tokens
        first = decode_first(self.config.placement)
        if self._indexing and self._tokens is None and tokens.wanted(decode_first=first):
            self._tokens = await tokens.ids_of(self.req, self.rid, self._adapter)
        while True:
            metrics.attempts.inc()
            span = self._attempt_span = self._start_attempt_span()
            with tracing.Ending(span, self._attempt_figures) as ending:
                try:
                    await (self._attempt() if self._continuation is None else self._resume())
                    self._resumed_stream_ended("completed")
                    return
                except RequestFault as fault:
                    ending.fail(fault.message)
                    if self._resumes_after(fault):
                        continue
                    self._resumed_stream_ended("failed")
                    decision = self._told(fault)
                    if not decision.retry:
                        raise
            self.lifecycle.advance(Input.RETRY)
            await trio.sleep(decision.delay_s)

    def _resumes_after(self, fault: RequestFault) -> bool:
        """Whether a stream that failed after output goes on in a continuation (SPEC 6.4);
        the attempt's record says which, or why not."""
        kept = self._kept
        if kept is None or not self.lifecycle.output_seen or self.lifecycle.finished:
            return False
        record = self.attempts[-1]
        if record.consumer is not None:  # the continuation decodes elsewhere
            self.failed_engines.add(record.consumer)
        reason = self._refused or kept.refusal() or self._resume_refusal(fault, kept)
        self.router.metrics.resumes_of("refused" if reason else "resumed").inc()
        record.resume = reason or "resumed"
        if reason is not None:
            return False
        record.error, record.phase = fault.message, fault.phase
        self._resumes += 1
        return True

    def _resume_refusal(self, fault: RequestFault, kept: Kept) -> str | None:
        allowed = self.config.recovery.resume_streams
        if self._resumes >= allowed:
            return "resumes spent"
        try:
            assert kept.prompt_ids is not None  # kept.refusal() says so
            body = resume.continuation(
                self.req.body, chat=self.req.chat, prompt_ids=kept.prompt_ids, sent_ids=kept.sent()
            )
        except ValueError as exc:  # the limit was reached, or there is none to give
            return str(exc)
        if not self._other_consumer():
            return "no other consumer"
        reason = resume.after(
            fault,
            resumes=self._resumes,
            allowed=allowed,
            remaining_s=self.deadline - trio.current_time(),
            needed_s=self.first_byte_s or 0.0,
            budget=self.router.retry_budget,
        )
        if reason is None:
            self._continuation = body
        return reason

    def _other_consumer(self) -> bool:
        fleet = self.router.fleet
        candidates, _ = fleet.placeable("decode", trio.current_time(), self.req.model)
        return any(engine.id not in self.failed_engines for engine in candidates)

    def _resumed_stream_ended(self, outcome: str) -> None:
        """How a resumed stream ended, counted once."""
        if self._resumes and not self._resume_counted:
            self._resume_counted = True
            self.router.metrics.resumes_of(outcome).inc()

    def _told(self, fault: RequestFault) -> RetryDecision:
        """A failed attempt's record and counters, and whether it is retried."""
        metrics = self.router.metrics
        decision = self._retry_decision(fault)
        if decision.retry:
            metrics.retries.inc()
        elif fault.transient:
            metrics.retries_denied.labels(decision.reason).inc()
        record = self.attempts[-1]
        record.error, record.phase, record.retry = fault.message, fault.phase, decision.reason
        return decision

    def _start_attempt_span(self) -> Span | None:
        if self.span is None:
            return None
        attrs: dict[str, int | str] = {"narwhal.attempt": len(self.attempts) + 1}
        if self.choice is not None:
            attrs["narwhal.choice"] = self.choice
        return tracing.child_span(self.span, "attempt", attrs)

    def _attempt_figures(self) -> dict[str, Any]:
        """The attempt span's attributes, known once it ended."""
        if not self.attempts:
            return {}
        record = self.attempts[-1]
        return {
            "producer": record.producer,
            "consumer": record.consumer,
            "phase": record.phase,
            "retry": record.retry,
            "handoff": record.handoff,
            "local": record.local,
            "tokens": self.tokens,
        }

    def _leg_span(self, leg: Leg, engine: EngineState, backend_id: str) -> Span | None:
        parent = self._attempt_span
        if parent is None:
            return None
        return tracing.child_span(
            parent,
            leg,
            {
                "narwhal.engine": engine.id,
                "narwhal.engine_url": engine.url,
                "narwhal.backend_request_id": backend_id,
            },
            SpanKind.CLIENT,
        )

    def _leg_trace(self, span: Span | None) -> tracing.Headers:
        """A leg's W3C trace context: its own span's with tracing on, else the client's."""
        return self.trace if span is None else tracing.headers(span)

    def _retry_decision(self, fault: RequestFault) -> RetryDecision:
        if fault.engine_id is not None and fault.breaker is not BreakerClass.NONE:
            self.failed_engines.add(fault.engine_id)
        serving = self.config.serving
        return decide(
            fault,
            attempt=len(self.attempts),
            max_attempts=serving.max_attempts,
            output_seen=self.lifecycle.output_seen,
            remaining_s=self.deadline - trio.current_time(),
            backoff_base_s=serving.retry_backoff_s,
            budget=self.router.retry_budget,
            rng=self.router.rng,
        )

    def _place(self, leg: Leg, other_leg: str | None = None) -> EngineState:
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
            avoid=self.failed_engines,
            other_leg=other_leg,
            key=self._prefix if leg == "prefill" else None,
            ring=fleet.ring,
            prompt=self._prompt_blocks() if self.config.placement.prefix_affinity else None,
            index=fleet.prefixes,
            precise=fleet.precise,
            tokens=self._tokens,
            adapter=self._adapter,
        )
        if choice is None:
            raise NoCapacity(
                f"no placeable {'producer' if leg == 'prefill' else 'consumer'} engine",
                phase=Phase.ADMISSION,
            )
        self.router.metrics.placements_of(leg, choice.reason).inc()
        return choice.engine

    def local_possible(self) -> bool:
        """Local on any consumer (the whole prompt is under ``local_prefill_tokens``), or
        wherever the producers are busy (``local_prefill_when_busy``); never a request
        whose answer needs the producer's prompt side."""
        placement = self.config.placement
        if wants_prompt_side(self.req.body):
            return False
        threshold = placement.local_prefill_tokens
        short = threshold > 0 and self._prompt_blocks().tokens < threshold
        return short or placement.local_prefill_when_busy

    def _may_go_local(self) -> bool:
        """Whether this attempt may run as one leg: not a resume, whose continuation is
        built for a producer, and not an answer that needs the producer's prompt side."""
        return self._continuation is None and not wants_prompt_side(self.req.body)

    def _only_engine(self, candidates: list[EngineState]) -> EngineState | None:
        """The one engine this request may still use among ``candidates``, if one."""
        usable = [e for e in candidates if e.id not in self.failed_engines] or candidates
        return usable[0] if len(usable) == 1 else None

    def _prompt_blocks(self) -> Prompt:
        if self._prompt is None:  # once per request: every attempt sees the same blocks
            self._prompt = prompt_of(self.req.body, chat=self.req.chat, adapter=self._adapter)
        return self._prompt

    async def _attempt(self) -> None:
        """One prefill leg, one handoff, one decode leg; each leg's result feeds its
        engine's breaker (client errors and disconnects never do). Decode first: the
        consumer is chosen before the producer, and the attempt may be local."""
        attempt = AttemptLine(number=len(self.attempts) + 1, choice=self.choice)
        self.attempts.append(attempt)
        if self._kept is not None:  # a retry: nothing of the failed attempt reached the
            self._kept = Kept()  # client, whose stream will have this attempt's id
        consumer = None
        if decode_first(self.config.placement):
            consumer = self._place("decode")
            decision = self._disaggregation(consumer)
            if decision == "disaggregated":
                producer = self._place("prefill", other_leg=consumer.id)
                if producer is consumer and self._may_go_local():
                    decision = "local_one_engine"
            self.router.metrics.disaggregation_of(decision).inc()
            if decision != "disaggregated":
                await self._local(consumer, attempt)
                return
        else:
            consumers, _ = self.router.fleet.placeable(
                "decode", trio.current_time(), self.req.model
            )
            only = self._only_engine(consumers)
            producer = self._place("prefill", other_leg=only.id if only else None)
            if not consumers:
                # no consumer to decode: refuse now rather than pin KV nobody will read
                raise NoCapacity("no placeable consumer engine", phase=Phase.ADMISSION)
            if producer is only and self._may_go_local():
                self.router.metrics.disaggregation_of("local_one_engine").inc()
                await self._local(producer, attempt)
                return
        self.router.fleet.turn += 1
        attempt.producer = producer.id
        self.lifecycle.advance(Input.PREFILL)
        # from its prefill until its decode leg is sent, it holds a consumer's room already
        with self.router.fleet.claim_decode(self.req.model) as self._claim:
            await self._legs(producer, attempt, consumer)

    async def _resume(self) -> None:
        """A continuation (SPEC 6.4): the prompt's ids and the ids already sent, prefilled
        on a producer and decoded on a consumer that has not failed this request."""
        assert self._kept is not None
        sent = len(self._kept.ids)
        attempt = AttemptLine(number=len(self.attempts) + 1, choice=self.choice)
        attempt.resumed_at_token = sent
        self.attempts.append(attempt)
        consumer = self._place("decode")
        if consumer.id in self.failed_engines:
            raise NoCapacity("no placeable consumer engine but the failed", phase=Phase.STREAM)
        producer = self._place("prefill", other_leg=consumer.id)
        self.router.fleet.turn += 1
        attempt.producer = producer.id
        assert self._continuation is not None
        context = await self._context(consumer)
        try:
            resume.within_context(self._continuation, context)
        except ValueError as exc:
            message = f"no continuation on engine {consumer.id}: {exc}"
            raise NoCapacity(message, phase=Phase.STREAM) from None
        with self.router.fleet.claim_decode(self.req.model) as self._claim:
            await self._legs(producer, attempt, consumer)

    async def _context(self, consumer: EngineState) -> int | None:
        """The consumer's context length, asked at each resume (``/v1/models``, within the
        health checks' bound): an engine restarted since may have another. None: unknown."""
        with trio.move_on_after(self.config.engine.health_timeout_s):
            with EngineFaults(consumer.id, consumer.url):
                status, models = await self.router.client.get(consumer.url, "/v1/models")
            # an adapter's card has no length of its own (vLLM lists it null): its base's
            model = self.req.model or self.config.model
            model = self.router.fleet.catalog.served.get(model) or model
            return resume.context_of(models, model) if status == 200 else None
        return None

    def _disaggregation(self, consumer: EngineState) -> Decision:
        """Whether this attempt skips the remote prefill (SPEC 4.4, conditional
        disaggregation). A request whose answer needs the prompt side the producer
        computes (an echo, prompt logprobs, the prompt's token ids) always has it."""
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
        return decide_local(
            uncached,
            placement,
            producers_saturated=busy,
            consumer_saturated=busy and consumer.room(now, *limits, "decode")[0] <= 0,
        )

    async def _local(self, consumer: EngineState, attempt: AttemptLine) -> None:
        """One leg to the consumer with no descriptor: it computes the prompt itself. Its
        first token is bounded by the prefill and first-token budgets together."""
        attempt.consumer, attempt.local = consumer.id, True
        self.ttft_s = None  # no remote prefill: the journal's ttft_s is null
        self.prefill_result = None
        self.router.fleet.turn += 1
        for step in (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH):
            self.lifecycle.advance(step)
        engine_cfg = self.config.engine
        budget = self.config.serving.prefill_timeout_s + engine_cfg.first_token_timeout_s
        try:
            await self._decode(consumer, None, attempt.number, first_token_s=budget)
        except RequestFault as fault:
            self.router.health.failure(consumer, fault, "decode", None)
            raise
        self.router.health.success(consumer)

    async def _legs(
        self, producer: EngineState, attempt: AttemptLine, consumer: EngineState | None
    ) -> None:
        health = self.router.health
        handoff_start = trio.current_time()
        try:
            result = await self._prefill(producer, attempt.number)
        except RequestFault as fault:
            health.failure(producer, fault, "prefill", None)
            raise
        health.success(producer)
        resuming = self._continuation is not None  # the client's own stream is committed
        if not resuming:
            self._remember(producer, self._prompt_blocks() if self._indexing else None)
            self.prefill_result = result  # its prompt side is served with the answer (SPEC 3)
            self.ttft_s = self.elapsed
            self.lifecycle.advance(Input.DESCRIPTOR)
        handoff = Handoff(self.rid, attempt.number, producer.id, result, handoff_start)
        try:
            consumer = consumer or self._place("decode", other_leg=producer.id)
            attempt.consumer = consumer.id
            self._check_handoff_age(handoff)
            if not resuming:
                self.lifecycle.advance(Input.DISPATCH)
            # one engine for both legs only when no other could decode (an answer that
            # needs the prompt side, a resume): it decodes without the descriptor, whose
            # blocks then go to the reclaim queue (another consumer frees them, if any)
            crossed = consumer is not producer
            try:
                await self._decode(
                    consumer,
                    result if crossed else None,
                    attempt.number,
                    handoff=handoff if crossed else None,
                )
            except RequestFault as fault:
                # its reclaim goes elsewhere: a consumer that just failed this descriptor
                # (stopped, refusing, sick) would most likely fail the reclaim too
                handoff.failed_consumer = consumer.id
                health.failure(consumer, fault, "decode", producer if crossed else None)
                raise
        finally:
            self._settle(handoff, attempt)
        health.success(consumer)
        if crossed:  # its reclaims are told at once (the NIXL handshake is done)
            self.router.fleet.paired.add((producer.id, consumer.id))

    def _settle(self, handoff: Handoff, attempt: AttemptLine) -> None:
        """Count the descriptor's fate; an orphan goes to the reclaim queue (invariant 7).
        Runs in a ``finally``, cancellation included: nothing here awaits."""
        metrics = self.router.metrics
        metrics.handoffs_of("produced").inc()
        metrics.handoffs_of(handoff.fate.value).inc()
        metrics.handoff_held.observe(handoff.age(trio.current_time()))
        attempt.handoff = handoff.fate.value
        if handoff.fate is not Fate.DECODED:  # within the lease still, a reclaim frees it
            self.router.reclaimer.submit(handoff)

    def _check_handoff_age(self, handoff: Handoff) -> None:
        engine = self.config.engine
        age = handoff.age(trio.current_time())
        reason = too_old(
            age,
            handoff_timeout_s=self.config.serving.handoff_timeout_s,
            lease_limit_s=engine.lease_limit_s,
        )
        if reason is not None:
            handoff.fate = Fate.EXPIRED
            raise HandoffExpired(
                f"KV handoff expired: descriptor is {age:.3f}s old, {reason}",
                phase=Phase.HANDOFF,
            )

    async def _prefill(self, producer: EngineState, number: int) -> PrefillResult:
        router = self.router
        budget = self.config.serving.prefill_timeout_s
        backend_id = f"{self.rid}-a{number}-prefill"
        span = self._leg_span("prefill", producer, backend_id)
        with tracing.Ending(span):
            with trio.move_on_after(budget) as prefill_clock:
                async with router.fleet.reserve(producer, "prefill"):
                    with EngineFaults(producer.id, producer.url):
                        endpoint, body = self._leg_request(decode=False)
                        return await router.client.prefill(
                            producer.url,
                            endpoint,
                            body,
                            request_id=backend_id,
                            trace=self._leg_trace(span),
                        )
            assert prefill_clock.cancelled_caught
            message = f"prefill on engine {producer.id} took longer than {budget:g}s"
            raise PrefillTimeout(message, phase=Phase.PREFILL, engine_id=producer.id)

    async def _decode(
        self,
        consumer: EngineState,
        result: PrefillResult | None,
        number: int,
        *,
        handoff: Handoff | None = None,
        first_token_s: float | None = None,
    ) -> None:
        backend_id = f"{self.rid}-a{number}-decode"
        span = self._leg_span("decode", consumer, backend_id)
        budget = (
            self.config.engine.first_token_timeout_s if first_token_s is None else first_token_s
        )

        def at_end() -> dict[str, Any]:  # the decode's figures are known once it ended
            return {"tokens": self.tokens, "kv_transfer": result is not None}

        with tracing.Ending(span, at_end):
            await self._decode_leg(consumer, result, handoff, backend_id, span, budget)
        # it holds the prompt now, and what it generated: a next turn starts with both
        self._remember(consumer, self._consumer_holds())

    def _consumer_holds(self) -> Prompt | None:
        if not self._indexing or self._reply is None:
            return None
        reply = reply_text(self._reply.text(), chat=self.req.chat)
        return self._prompt_blocks().followed_by(reply)

    def _remember(self, engine: EngineState, prompt: Prompt | None) -> None:
        if prompt is not None:
            self.router.fleet.prefixes.record(engine.id, prompt.blocks, trio.current_time())

    async def _decode_leg(
        self,
        consumer: EngineState,
        result: PrefillResult | None,
        handoff: Handoff | None,
        backend_id: str,
        span: Span | None,
        first_token_s: float,
    ) -> None:
        router = self.router
        endpoint, body = self._leg_request(decode=True)
        self._path = None
        stream = router.client.decode(
            consumer.url,
            endpoint,
            body,
            result,
            request_id=backend_id,
            trace=self._leg_trace(span),
        )
        # decode_clock: first-token budget until the first token, then silence budget.
        decode_clock = trio.CancelScope(deadline=trio.current_time() + first_token_s)
        reservation = router.fleet.reserve(consumer, "decode", self._claim)
        with decode_clock, EngineFaults(consumer.id, consumer.url):
            async with reservation, stream:
                if handoff is not None:  # the consumer took the request: reading the
                    handoff.fate = Fate.DECODED  # blocks is its job now
                await self._relay(stream, decode_clock, reservation.started)
                return
        if not self._leg_output():
            raise FirstTokenTimeout(
                f"no first token within {first_token_s:g}s from engine {consumer.id}",
                phase=Phase.STREAM if self.lifecycle.output_seen else Phase.DECODE,
                engine_id=consumer.id,
            )
        raise SilenceTimeout(
            f"engine went silent between tokens: nothing from engine {consumer.id} for "
            f"{self.config.engine.decode_read_timeout_s:g}s",
            phase=Phase.STREAM,
            engine_id=consumer.id,
        )

    def _leg_output(self) -> bool:
        """The running decode leg relayed a token (a continuation's first is its own)."""
        path = self._path
        return path is not None and path.first_token_at is not None

    def _leg_request(self, *, decode: bool) -> tuple[str, Mapping[str, Any]]:
        """A leg's endpoint and body: the client's, or a resume's continuation. With resume
        on, a decode leg reports its token ids (the client sees only what it asked for)."""
        if self._continuation is not None:
            return resume.ENDPOINT, self._continuation
        body = self.req.body
        if decode and self._kept is not None and self._refused is None:
            body = body.replace(return_token_ids=True)
        return self.req.endpoint, body

    def _answer_side(self) -> Assembler | None:
        """A non-streaming client's assembler, new for each attempt with the prompt side
        its producer computed (a streaming client's echo); a continuation goes on with the
        answer its failed stream began, whose prompt side went out already."""
        if self._continuation is not None:
            return self._collector
        prefill = self.prefill_result
        self._collector = None
        if not self.req.stream:
            model = self.req.model or self.config.model
            self._collector = Assembler(chat=self.req.chat, model=model)
            if prefill is not None:
                self._collector.prompt_side(prefill, self.req.body)
        elif prefill is not None:
            self._echo = prompt_echo(prefill, self.req.body, chat=self.req.chat)
        return self._collector

    def _continuity(self) -> tuple[Kept | None, Rewrite | None, int | None]:
        """What the relay keeps for a resume, how it writes each chunk for the client, and
        where a continuation takes over (SPEC 6.4)."""
        kept = self._kept
        if kept is None or self._refused is not None:
            return None, None, None
        asked = self.req.body.get("return_token_ids") is True
        if self._continuation is None:
            return kept, None if asked else without_ids, None
        assert kept.prompt_ids is not None
        sent = len(kept.ids)
        frames = Reframer(
            kept,
            chat=self.req.chat,
            with_ids=asked,
            prompt_tokens=self.prompt_tokens() or len(kept.prompt_ids),
            before=sent,
        )
        return kept, frames, sent

    async def _relay(
        self, stream: DecodeStream, clock: trio.CancelScope, started: Callable[[], None]
    ) -> None:
        """Move the engine's stream to the client until ``[DONE]`` (``TokenPath``), then
        write the end."""
        resuming = self._continuation is not None
        collector = self._answer_side()
        direct = self.sink.direct if collector is None else None
        client = ClientStream(self.sink, self.lifecycle, self._echo, direct)
        # parked in the reactor: a stream whose reads need no waiting between its first
        # output and its end, streamed straight to the client or assembled for JSON
        reactor = self.router.reactor if direct is not None or collector is not None else None
        silence = self.config.engine.decode_read_timeout_s
        gaps = RequestBuckets(self.router.metrics.token_gap)
        kept, rewrite, resumed_at = self._continuity()
        relay = StreamRelay(
            collector,
            strip_usage=not self.req.include_usage,
            keep_reply=self._indexing,
            kept=kept,
            rewrite=rewrite,
            resumed_at=resumed_at,
        )
        if resuming and self._reply is not None:
            relay.reply = self._reply  # the reply goes on
        self._reply = relay.reply
        path = self._path = TokenPath(client, relay, clock, silence, gaps, reactor, started)
        last_before = path.last_output_at = self._last_output_at if resuming else None
        try:
            end = await path.relay_all(stream)
        finally:
            self._relayed(path, relay, last_before)
        await self.finish(end)
        await stream.drain()

    def _relayed(self, path: TokenPath, relay: StreamRelay, last_before: float | None) -> None:
        """A decode leg's figures, once it ended (cancellation included: nothing awaits)."""
        self.tokens = path.tokens
        first = path.first_token_at
        if self._continuation is None:
            self._local_prompt_tokens = relay.prompt_tokens
        elif first is not None and last_before is not None:
            self.router.metrics.resume_gap.observe(first - last_before)
        if first is not None and self.first_byte_s is None:
            self.first_byte_s = first - self.arrival
        if path.last_output_at is not None:
            self._last_output_at = path.last_output_at

    async def finish(self, data: bytes) -> None:
        self.outcome, self.status = "completed", 200
        committed = self.lifecycle.committed
        if not committed:  # a JSON answer, or the first output and [DONE] in one read
            self.lifecycle.advance(Input.COMMIT)
        self.lifecycle.advance(Input.DONE)
        with self.last_write():
            if not self.req.stream:
                await self.sink.respond_json(200, data)
                return
            if self._echo is not None:
                data = self._echo.stream(data)
            if committed:
                await self.sink.end(data)
            else:
                await self.sink.commit(data)
                await self.sink.end()
