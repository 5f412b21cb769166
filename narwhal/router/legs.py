"""A request's legs on the wire: the prefill leg to a producer, the decode leg to a consumer
and the relay of its stream to the client, each under its own clock. What a leg is for, and
what follows it, is the request's machine's (``narwhal.core.request``, its actions in
``narwhal.core.request_actions``); the request's run (``narwhal.router.request_run``)
makes one ``RequestLegs`` with the request's record and machine, places the legs
(``narwhal.router.placer``) and feeds the machine.

Timeouts are cancel scopes owned here: the prefill clock over the whole producer leg, and
one decode clock that is the first-token budget until the first generated token (it starts
before the decode request is opened) and the silence budget between transport chunks after
it, moved only by this task (``TokenPath``, its stream parked in the reactor or not). The
request deadline is the outer scope, owned by ``Router.handle``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import trio
from opentelemetry.trace import Span, SpanKind

from narwhal.core import resume
from narwhal.core.clocks import Clock, ran_out
from narwhal.core.connector import PrefillResult
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import AtEngine, Phase
from narwhal.core.fleet import DecodeClaim
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import Decode
from narwhal.core.request_events import DECODE_TAKEN, FINISHED
from narwhal.observe import tracing
from narwhal.observe.batched_histogram import RequestBuckets
from narwhal.router.run_record import RouterState, RunRecord
from narwhal.router.token_path import ClientStream, TokenPath
from narwhal.stream.assemble import Assembler, Echo, prompt_echo
from narwhal.stream.continuation import Kept, Reframer, without_ids
from narwhal.stream.rules import Reply, Rewrite, StreamRelay


class RequestLegs:
    """The legs of one prefill/decode chain, and what its decode leg leaves behind: the
    answer's figures, the reply (for the prefix index), where a resume would go on. Its
    run makes it once, with the request's record and machine, which it tells what the
    legs did."""

    __slots__ = (
        "_collector",
        "_echo",
        "_keep_reply",
        "_last_output_at",
        "_local_prompt_tokens",
        "attempt_span",
        "config",
        "first_byte_s",
        "machine",
        "path",
        "prefill_result",
        "record",
        "reply",
        "req",
        "rid",
        "router",
        "tokens",
    )

    def __init__(
        self,
        router: RouterState,
        record: RunRecord,
        machine: RequestMachine,
        *,
        keep_reply: bool,
    ) -> None:
        self.router = router
        self.record = record
        self.machine = machine
        self.config, self.req, self.rid = record.config, record.req, record.rid
        self._keep_reply = keep_reply  # the reply is kept for the prefix index
        self.first_byte_s: float | None = None
        self.tokens = 0
        self.prefill_result: PrefillResult | None = None  # the last fresh prefill's answer
        self.attempt_span: Span | None = None  # the running attempt's, tracing on
        self._echo: Echo | None = None  # a streamed echo (completions)
        self._collector: Assembler | None = None  # a JSON answer, across a resume
        self.reply: Reply | None = None  # the generated text, for the index
        self._local_prompt_tokens: int | None = None
        self.path: TokenPath | None = None  # the running decode leg's
        self._last_output_at: float | None = None  # the client's last token, so far

    def prompt_tokens(self) -> int | None:
        """The prompt tokens an engine computed for this request (None: not known)."""
        if self.prefill_result is None:  # a local attempt: its consumer's usage counts them
            return self._local_prompt_tokens
        return self.prefill_result.prompt_tokens

    # ---- spans -----------------------------------------------------------------------------

    def _leg_span(self, leg: Leg, engine: EngineState, backend_id: str) -> Span | None:
        parent = self.attempt_span
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
        return self.record.trace if span is None else tracing.headers(span)

    def attempt_began(self) -> Span | None:
        """The attempt the machine just began: its span (tracing on), its legs' parent."""
        span, parent = None, self.record.span
        if parent is not None:
            attrs: dict[str, int | str] = {"narwhal.attempt": len(self.machine.attempts)}
            if self.machine.fanout_index is not None:
                attrs["narwhal.choice"] = self.machine.fanout_index
            span = tracing.child_span(parent, "attempt", attrs)
        self.attempt_span = span
        return span

    def attempt_figures(self) -> dict[str, Any]:
        """The attempt span's attributes, known once it ended."""
        if not self.machine.attempts:
            return {}
        record = self.machine.attempt_line
        return {
            "producer": record.producer,
            "consumer": record.consumer,
            "phase": record.phase,
            "retry": record.retry,
            "handoff": record.handoff_fate,
            "local": record.local,
            "tokens": self.tokens,
        }

    async def context_of(self, consumer: EngineState) -> int | None:
        """The consumer's context length, asked at each resume (``/v1/models``, within the
        health checks' bound): an engine restarted since may have another. None: unknown."""
        with trio.move_on_after(self.config.engine.health_timeout_s):
            with AtEngine(consumer.id, consumer.url):
                status, models = await self.router.client.get(consumer.url, "/v1/models")
            # an adapter's card has no length of its own (vLLM lists it null): its base's
            model = self.req.model or self.config.model
            model = self.router.fleet.catalog.served.get(model) or model
            return resume.context_of(models, model) if status == 200 else None
        return None

    # ---- the prefill leg -------------------------------------------------------------------

    async def prefill(
        self, producer: EngineState, number: int, *, asks_descriptor: bool
    ) -> PrefillResult:
        """The prefill leg on ``producer`` (``asks_descriptor``: the route's, False when the
        producer decodes too); a fresh attempt's answer is kept (its prompt side is served
        with the answer)."""
        router = self.router
        budget = self.config.serving.prefill_timeout_s
        backend_id = f"{self.rid}-a{number}-prefill"
        span = self._leg_span("prefill", producer, backend_id)
        with tracing.Ending(span):
            with trio.move_on_after(budget) as prefill_clock:
                async with router.fleet.reserve(producer, "prefill"):
                    with AtEngine(producer.id, producer.url):
                        endpoint, body = self._leg_request(decode=False)
                        result = await router.client.prefill(
                            producer.url,
                            endpoint,
                            body,
                            request_id=backend_id,
                            trace=self._leg_trace(span),
                            asks_descriptor=asks_descriptor,
                        )
                        if self.machine.continuation is None:
                            self.prefill_result = result
                        return result
            clock, phase = Clock.PREFILL, Phase.PREFILL
            raise ran_out(clock, budget, phase=phase, engine_id=producer.id, scope=prefill_clock)

    # ---- the decode leg --------------------------------------------------------------------

    def local_attempt(self) -> None:
        """An attempt with no remote prefill: no producer's prompt side to serve."""
        self.prefill_result = None

    async def decode(
        self,
        consumer: EngineState,
        decode: Decode | None,
        number: int,
        first_token_s: float | None = None,
        claim: DecodeClaim | None = None,
    ) -> None:
        """The decode leg on ``consumer``, with the handoff ``decode`` (None: a local leg,
        which computes the prompt itself), relayed to the client until its end. ``claim``:
        the consumer room held since the prefill, handed to the leg's reservation."""
        router = self.router
        backend_id = f"{self.rid}-a{number}-decode"
        span = self._leg_span("decode", consumer, backend_id)
        engine = self.config.engine
        budget = engine.first_token_timeout_s if first_token_s is None else first_token_s
        result = None if decode is None else decode.descriptor

        def at_end() -> dict[str, Any]:  # the decode's figures are known once it ended
            return {"tokens": self.tokens, "kv_transfer": result is not None}

        endpoint, body = self._leg_request(decode=True)
        self.path = None
        with tracing.Ending(span, at_end):
            stream = router.client.decode(
                consumer.url,
                endpoint,
                body,
                result,
                request_id=backend_id,
                trace=self._leg_trace(span),
                send_by=math.inf if decode is None else decode.send_by,  # the handoff clock
            )
            # decode_clock: first-token budget until the first token, then silence budget
            decode_clock = trio.CancelScope(deadline=trio.current_time() + budget)
            reservation = router.fleet.reserve(consumer, "decode", claim)
            with decode_clock, AtEngine(consumer.id, consumer.url):
                async with reservation, stream:
                    if decode is not None:  # the consumer took the request
                        self.machine.handle(DECODE_TAKEN)
                    # relayed here, not in a call of its own: a held stream's task keeps
                    # one frame fewer (bench/results/request-machine)
                    path = self._token_path(decode_clock, reservation.started)
                    last_before = path.last_output_at
                    try:
                        end = await path.relay_all(stream)
                    finally:
                        self._relayed(path, last_before)
                    await self._write_answer(end)
                    await stream.drain()
                    return
            if not self._leg_output():
                phase = Phase.STREAM if self.machine.standing.output_seen else Phase.DECODE
                clock, budget_s = Clock.FIRST_TOKEN, budget
            else:
                phase, clock, budget_s = Phase.STREAM, Clock.SILENCE, engine.decode_read_timeout_s
            raise ran_out(clock, budget_s, phase=phase, engine_id=consumer.id, scope=decode_clock)

    def _leg_output(self) -> bool:
        """The running decode leg relayed a token (a continuation's first is its own)."""
        path = self.path
        return path is not None and path.first_token_at is not None

    def _leg_request(self, *, decode: bool) -> tuple[str, Mapping[str, Any]]:
        """A leg's endpoint and body: the client's, or a resume's continuation. With resume
        on, a decode leg reports its token ids (the client sees only what it asked for)."""
        machine = self.machine
        if machine.continuation is not None:
            return resume.ENDPOINT, machine.continuation
        body = self.req.body
        if decode and machine.kept is not None and machine.refused is None:
            body = body.replace(return_token_ids=True)
        return self.req.endpoint, body

    # ---- the relay -------------------------------------------------------------------------

    def _answer_side(self) -> Assembler | None:
        """A non-streaming client's assembler, new for each attempt with the prompt side
        its producer computed (a streaming client's echo); a continuation goes on with the
        answer its failed stream began, whose prompt side went out already."""
        if self.machine.continuation is not None:
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
        where a continuation takes over (docs/contract.md section 6.4)."""
        machine = self.machine
        kept = machine.kept
        if kept is None or machine.refused is not None:
            return None, None, None
        assert isinstance(kept, Kept)
        asked = self.req.body.get("return_token_ids") is True
        if machine.continuation is None:
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

    def _token_path(self, clock: trio.CancelScope, started: Callable[[], None]) -> TokenPath:
        """The engine's stream's way to the client until ``[DONE]``: the relay's rules, the
        client's side, the reactor where the reads need no waiting."""
        resuming = self.machine.continuation is not None
        collector = self._answer_side()
        sink = self.record.sink
        direct = sink.direct if collector is None else None
        client = ClientStream(sink, self.machine, self._echo, direct)
        # parked in the reactor: a stream whose reads need no waiting between its first
        # output and its end, streamed straight to the client or assembled for JSON
        reactor = self.router.reactor if direct is not None or collector is not None else None
        silence = self.config.engine.decode_read_timeout_s
        gaps = RequestBuckets(self.router.metrics.token_gap)
        kept, rewrite, resumed_at = self._continuity()
        relay = StreamRelay(
            collector,
            strip_usage=not self.req.include_usage,
            keep_reply=self._keep_reply,
            kept=kept,
            rewrite=rewrite,
            resumed_at=resumed_at,
        )
        if resuming and self.reply is not None:
            relay.reply = self.reply  # the reply goes on
        self.reply = relay.reply
        path = self.path = TokenPath(client, relay, clock, silence, gaps, reactor, started)
        path.last_output_at = self._last_output_at if resuming else None
        return path

    def _relayed(self, path: TokenPath, last_before: float | None) -> None:
        """A decode leg's figures, once it ended (cancellation included: nothing awaits)."""
        self.tokens = path.tokens
        first = path.first_token_at
        if self.machine.continuation is None:
            self._local_prompt_tokens = path.relay.prompt_tokens
        elif first is not None and last_before is not None:
            self.router.metrics.resume_gap.observe(first - last_before)
        if first is not None and self.first_byte_s is None:
            self.first_byte_s = first - self.record.arrival
        if path.last_output_at is not None:
            self._last_output_at = path.last_output_at

    async def _write_answer(self, data: bytes) -> None:
        """The end of the answer: the JSON, or the stream's last bytes (its commit too,
        when its first output and its end came in one read)."""
        record, sink = self.record, self.record.sink
        record.completed()
        committed = self.machine.handle(FINISHED)
        with record.last_write():
            if not self.req.stream:
                await sink.respond_json(200, data)
                return
            if self._echo is not None:
                data = self._echo.stream(data)
            if committed:
                await sink.end(data)
            else:
                await sink.commit(data)
                await sink.end()
