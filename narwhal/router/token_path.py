"""One token's path from the engine socket to the client socket: the hot path, in five
steps, each named once.

1. **The reactor** (``StreamReactor``, ``router/stream_reactor.py``) sees the parked
   stream's engine socket readable and calls
2. ``TokenPath.on_ready`` (here), which reads what came without waiting
   (``Response.read_nowait``, ``engines/transport.py``: one ``os.read``, the chunked
   framing taken off),
3. applies **the relay rules** (``StreamRelay.feed``, ``stream/rules.py``: one action per
   read),
4. and hands a ``Send`` to ``ClientStream.write_nowait`` (here: the echo, if asked), which
5. writes it framed, with one non-blocking ``send``, to the client socket
   (``DirectBody.write_nowait``, ``frontdoor/direct.py``, then
   ``ClientConnection.write_nowait``).

None of it waits, and a token costs no task switch. Whatever must wait (the first output,
which commits the response; a client slow to take a write; the end; a fault) is handed back
to **the request's task**, parked in ``relay_all``, which ``settle``s it in the request's own
nursery and parks again. Without a reactor (tests of the core, in-memory streams) the
request's task reads too.

The decode clock (``TokenPath.clock``: the first-token budget, then the silence between
reads, ``decode_read_timeout_s``) is a cancel scope of the request's task, and only that task
moves it. Reading itself, it restarts the silence after each read; it lifts the clock (a
slow client is not a silent engine) only while a write waits. Parking, it notes the clock's
expiry in ``due``, lifts it, and parks with that due: the reactor's task then keeps plain
floats (``restarted_at``, the last read that restarted the silence) and, at the due
(``on_due``), either names the expiry that reads have moved it to or hands the request back
``TIME_UP``. Unparked, the task puts the clock's deadline back to the expiry those floats
give; handed back ``TIME_UP``, that deadline has passed and its next checkpoint is
cancelled by its own clock, as if it had never parked. So a read while parked pushes
nothing on a heap: the due moves only when it comes, to the last read's expiry (for tokens
closer than the silence, about once a silence). Gaps between tokens are counted per request
and flushed to the histogram at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from narwhal.core.faults import StreamBroken
from narwhal.core.request_events import COMMITTED, FIRST_TOKEN, Committed, FirstToken
from narwhal.engines.client import DecodeStream
from narwhal.lowlevel.fast_io import Parkable
from narwhal.observe.batched_histogram import RequestBuckets
from narwhal.router.stream_reactor import HAND_BACK, TIME_UP, HandBack, StreamReactor
from narwhal.stream.assemble import Echo
from narwhal.stream.rules import Fault, Finish, FirstOutput, Send, StreamRelay


@dataclass(slots=True)
class Held:
    """Metadata before the first token: held back; the first-token clock runs on."""


@dataclass(slots=True)
class WriteRest:
    """A write without waiting left a rest: the request's task writes it."""


HELD, WRITE_REST = Held(), WriteRest()
# what a read leaves for the request's task: the rules' actions that wait, and these
Pending = Held | WriteRest | FirstOutput | Send | Finish | Fault


class Sink(Protocol):
    """The client's side of the ASGI app (``narwhal.frontdoor.answers.AsgiSink``)."""

    async def commit(self, data: bytes) -> None: ...
    async def send(self, data: bytes) -> None: ...


class Milestones(Protocol):
    """What the stream tells the request's machine (``narwhal.core.request``), which alone
    moves the request's lifecycle: its first token, and the commit point."""

    def handle(self, event: FirstToken | Committed, /) -> None: ...


class DirectWrite(Protocol):
    """A framed write to the client connection (``narwhal.frontdoor.direct.DirectBody``)."""

    def write_nowait(self, body: bytes) -> bool | None: ...
    async def write_rest(self) -> None: ...


class ClientStream:
    """The client's side of one decode stream: the echo of the prompt (when asked), the
    commit point (the 200 headers with the first output), and writes, with or without
    waiting. ``direct`` None: every write waits (a server without the direct write)."""

    __slots__ = ("_echo", "_sink", "_unframed", "direct", "machine")

    def __init__(
        self, sink: Sink, machine: Milestones, echo: Echo | None, direct: DirectWrite | None
    ) -> None:
        self._sink = sink
        self.machine = machine
        self._echo = echo
        self.direct = direct
        self._unframed: bytes | None = None  # what the direct write could not frame

    def echoed(self, data: bytes) -> bytes:
        """A streamed chunk as the client sees it: the prompt echoed in, when asked."""
        return data if self._echo is None else self._echo.stream(data)

    def write_nowait(self, data: bytes) -> bool:
        """Write without waiting: True when all of it went out; False: ``write_rest``
        must be awaited at once."""
        assert self.direct is not None
        data = self.echoed(data)
        done = self.direct.write_nowait(data)
        if done is None:  # not a chunked body under way: the ASGI send frames it
            self._unframed = data
            return False
        return done

    async def write_rest(self) -> None:
        unframed, self._unframed = self._unframed, None
        if unframed is not None:
            await self._sink.send(unframed)
        else:
            assert self.direct is not None
            await self.direct.write_rest()

    async def output(self, action: FirstOutput | Send) -> None:
        """Bytes to a streaming client; the first output is the commit point (the 200
        headers go out before it)."""
        data = self.echoed(action.data)
        if type(action) is FirstOutput:
            self.machine.handle(COMMITTED)
            await self._sink.commit(data)
        else:
            await self._sink.send(data)


class TokenPath:
    """One decode stream, from its engine socket to ``client``, under ``clock`` (the
    first-token budget, then the silence between reads)."""

    def __init__(
        self,
        client: ClientStream,
        relay: StreamRelay,
        clock: trio.CancelScope,
        silence: float,
        gaps: RequestBuckets,
        reactor: StreamReactor | None,
        on_first_token: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        # the engine runs it now: its leg no longer counts as waiting there (contract 4.5)
        self.on_first_token = on_first_token
        self.relay = relay
        self.base = relay.tokens  # a continuation's relay counts the output sent before it
        self.clock = clock
        self.reactor = reactor
        self.silence = silence  # decode_read_timeout_s; 0: none
        self.gaps = gaps
        self.first_token_at: float | None = None
        self.last_output_at: float | None = None
        self.stream: DecodeStream | None = None
        # the decode clock while parked, lifted (``park``): plain floats, which the reactor's
        # task may write, and from which the request's task puts the clock back (``expiry``)
        self.parked: Parkable | None = None  # the engine connection, while parked
        self.due = math.inf  # the clock's expiry at the park, or as ``on_due`` last found it
        self.restarted_at = -math.inf  # the last read that restarted the silence since; -inf: none

    @property
    def tokens(self) -> int:
        """Generated tokens: the engine's usage once it came, output chunks until then."""
        generated = self.relay.generated
        return self.relay.tokens if generated is None else generated

    async def relay_all(self, stream: DecodeStream) -> bytes:
        """The request's task: until the end (return its last bytes, for the request to
        write) or a fault (raise it)."""
        self.stream = stream
        reactor = self.reactor
        try:
            while True:
                sock = None if reactor is None or not reactor.running else stream.park_socket()
                if sock is not None:
                    assert reactor is not None
                    # parked here, not in a call of its own: a held stream's task keeps one
                    # frame fewer (bench/results/request-machine). The clock is lifted while
                    # parked: the reactor's task keeps its expiry in floats (module docstring)
                    due = self.due = self.clock.deadline
                    self.restarted_at = -math.inf
                    self.clock.deadline = math.inf
                    self.parked = sock
                    try:
                        try:
                            pending = await reactor.park(sock, self.on_ready, due, self.on_due)
                        finally:  # before anything awaits under the clock again
                            self.parked = None
                            self.clock.deadline = self.expiry()
                    except StreamBroken:  # the engine's read broke (``read_nowait``), or
                        await stream.aclose()  # another task closed its connection
                        raise
                    if type(pending) is not HandBack:
                        end = await self.settle(pending)  # type: ignore[arg-type]
                        if end is not None:
                            return end
                        continue
                    if pending is TIME_UP:  # the clock's deadline has passed: it cancels us
                        await trio.lowlevel.checkpoint()
                data = await stream.read()
                if data is None:
                    raise self.relay.end_of_stream().fault
                end = await self.settle(self.take(data))
                if end is not None:
                    return end
        finally:
            self.gaps.flush()  # nothing here awaits: cancellation included

    def on_ready(self) -> Pending | HandBack | None:
        """The reactor's call on the engine socket's readiness: None, stay parked."""
        assert self.stream is not None
        data = self.stream.read_nowait()
        if data is None:
            return HAND_BACK
        if not data:
            return None
        pending = self.take(data)
        return None if pending is HELD else pending

    def take(self, data: bytes) -> Pending | None:
        """One read, without waiting: None when it is all done, else what to settle."""
        relay = self.relay
        tokens_before = relay.tokens
        action = relay.feed(data)
        tokens = relay.tokens
        if tokens_before == self.base and tokens != tokens_before:
            self.first_token_at = trio.current_time()
            if not self.base:  # a continuation's request has had its first token
                self.client.machine.handle(FIRST_TOKEN)
            if self.on_first_token is not None:
                self.on_first_token()
        match action:
            case Fault() | Finish():
                return action
        if not tokens:
            return HELD
        if tokens != tokens_before:
            now = trio.current_time()
            if self.last_output_at is not None:
                # per token, as vLLM's inter-token latency: a read that brought k tokens
                # after a gap g is k tokens g/k apart
                self.gaps.add(now - self.last_output_at, tokens - tokens_before)
            self.last_output_at = now
        match action:
            case Send(data=out) if self.client.direct is not None:
                if not self.client.write_nowait(out):
                    return WRITE_REST
            case FirstOutput() | Send():
                return action
        self._restart_clock()
        return None

    async def settle(self, pending: Pending | None) -> bytes | None:
        """The request's task: what ``take`` left that waits. The last bytes once the
        stream is done (``[DONE]`` relayed to the request, which writes them), else None."""
        match pending:
            case None | Held():
                return None
            case Fault(fault=fault, flush=flush):
                if flush is not None:
                    self.clock.deadline = math.inf  # the engine has spoken: the client's turn
                    await self.client.output(flush)
                raise fault
            case Finish(data=data):
                self.clock.deadline = math.inf  # a slow client taking the end is not silence
                return data
            case WriteRest():
                self.clock.deadline = math.inf  # a slow client is not a silent engine
                await self.client.write_rest()
            case FirstOutput() | Send():
                self.clock.deadline = math.inf  # nor is a write that waits
                await self.client.output(pending)
        self._restart_clock()
        return None

    def _restart_clock(self) -> None:
        """The silence clock starts again now (a read, or a write that waited). In the
        request's task the clock moves at once; parked, in the reactor's task, only
        ``restarted_at`` does, and the due only when it must come sooner (the first token
        of a stream that parked under the first-token budget)."""
        now = self.restarted_at = trio.current_time()
        silence = self.silence
        expiry = now + silence if silence > 0 else math.inf
        parked = self.parked
        if parked is None:
            self.clock.deadline = expiry
        elif expiry < self.due:
            assert self.reactor is not None
            self.due = expiry
            self.reactor.set_due(parked, expiry)

    def expiry(self) -> float:
        """When the decode clock runs out, as the floats kept while parked say: the expiry it
        had at the park, unless a read restarted the silence since."""
        restarted = self.restarted_at
        if restarted == -math.inf:
            return self.due
        silence = self.silence
        return restarted + silence if silence > 0 else math.inf

    def on_due(self) -> float | None:
        """The reactor's call at ``due``: the next due, the expiry that reads since have
        moved the clock to; None when it has come (the reactor hands the request back
        ``TIME_UP``, and its task's own clock cancels it)."""
        expiry = self.expiry()
        if expiry <= trio.current_time():
            return None
        self.due = expiry
        return expiry
