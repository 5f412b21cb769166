"""What every run of a client request records for ``Router.handle``: its outcome and journal
line, and how a fault is told to the client (JSON before the commit point, one terminal
event after it). A ``RunRecord`` is an object a run holds, made once:
``narwhal.router.request_run.RequestRun`` (one prefill/decode chain) and
``narwhal.router.fanout.FanOutRun`` (several) each have one, as ``run.record``."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import NamedTuple, Protocol

import trio
from opentelemetry.trace import Span

from narwhal.core.config import FleetConfig
from narwhal.core.faults import DeadlineExpired, Phase, RequestFault, ShuttingDown
from narwhal.core.fleet import Fleet
from narwhal.core.flow_class import Flow
from narwhal.core.records import AttemptLine, Caller, JournalLine, Outcome
from narwhal.core.request_events import GAVE_UP
from narwhal.core.request_owner import PHASE_OF, Owner, outcome_of
from narwhal.core.requests import ClientRequest
from narwhal.core.retry import RetryBudget
from narwhal.engines.client import EngineClient
from narwhal.observe import tracing
from narwhal.observe.metrics import Metrics
from narwhal.router.health import Health
from narwhal.router.reclaim import Reclaimer
from narwhal.router.stream_reactor import StreamReactor
from narwhal.router.token_path import DirectWrite
from narwhal.router.token_source import TokenSource
from narwhal.stream.sse import frame


class ClientSink(Protocol):
    """Where the client's bytes go (the ASGI layer implements it). It keeps no state: where
    the response stands is its machine's to say."""

    async def commit(self, data: bytes) -> None: ...  # 200 + SSE headers + first bytes
    async def send(self, data: bytes) -> None: ...
    async def end(self, data: bytes = b"") -> None: ...
    # the terminal event after the commit point, then the body cut, never ended (contract 6);
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


class Measures(NamedTuple):
    """What a run measured, for its journal line."""

    attempts: list[AttemptLine]
    prefill_s: float | None
    first_byte_s: float | None
    tokens: int
    prompt_tokens: int | None  # as the engine that computed them counted (None: not known)


class RunRecord:
    """One client request's record: who sent it and how, where it stands (read from its
    owner, the machine), how it ended, and how a fault is told to the client."""

    # slotted: a held stream's record is one of its larger objects (bench/held_stream_objects.py)
    __slots__ = (
        "_write_lock",
        "arrival",
        "arrived_at",
        "caller",
        "cancelled_in",
        "client_left",
        "config",
        "cut",
        "due",
        "fault",
        "flow",
        "outcome",
        "owner",
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
        owner: Owner,
        *,
        arrival: float | None = None,
        write_lock: trio.Lock | None = None,
    ) -> None:
        self.config = config  # taken once, at admission: a reload applies to new requests
        self.req = req
        self.rid = rid
        self.sink = sink
        self.arrival = trio.current_time() if arrival is None else arrival
        # where it stands: read here, written only by its owner, the request's machine
        self.owner = owner
        # held while the terminal event is written: a fan-out's, never between a child's frames
        self._write_lock = write_lock
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
        self.due: float | None = None  # the latest dispatch that meets its TTFT target
        self.flow = Flow()  # its class and fairness key in the admission queue (contract 4.5)
        self.queued_s = 0.0  # how long it waited there

    @property
    def phase(self) -> Phase:
        return PHASE_OF[self.owner.standing.state]

    @property
    def elapsed(self) -> float:
        return trio.current_time() - self.arrival

    @property
    def deadline(self) -> float:
        return self.arrival + self.config.serving.request_timeout_s

    def cancelled(self, phase: Phase) -> None:
        """The client went away (or could not be told of the failure) in ``phase``."""
        self.cancelled_in = phase

    def completed(self) -> None:
        """The whole answer is about to be written (``last_write`` says if it arrived)."""
        self.outcome, self.status = "completed", 200

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
        then the body is cut (contract 6): a client that ignores error events must not count
        the stream a success."""
        if self.owner.standing.finished:
            if self.cut:  # the connection is closed: the journal says why, nobody else can
                self._record(fault)
            return
        committed = self.owner.handle(GAVE_UP)
        self._record(fault)
        error = fault.error_json()
        if not committed:
            await self.sink.respond_json(fault.status, error)
            return
        given_up = isinstance(fault, DeadlineExpired | ShuttingDown)  # invariant 10
        async with self._write_lock or nullcontext():
            await self.sink.cut(frame(error), abandon=given_up)

    def _record(self, fault: RequestFault) -> None:
        self.fault, self.status, self.outcome = fault, fault.status, outcome_of(fault)

    def journal_line(self, measures: Measures) -> JournalLine:
        fault = self.fault
        return JournalLine(
            request_id=self.rid,
            endpoint=self.req.endpoint,
            stream=self.req.stream,
            outcome=self.outcome,
            status=self.status,
            phase=fault.phase if fault else self.cancelled_in,
            message=fault.message if fault else None,
            attempts=measures.attempts,
            prefill_s=measures.prefill_s,
            first_byte_s=measures.first_byte_s,
            tokens=measures.tokens,
            duration_s=self.elapsed,
            prompt_tokens=measures.prompt_tokens,
            at=round(self.arrived_at, 3),
            client=self.caller.client,
            key=self.caller.key,
            queued_s=round(self.queued_s, 6),
            cls=self.flow.cls.value,
            model=self.req.model,
        )
