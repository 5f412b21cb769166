"""The relay's shell: one decode stream to the client, the hot path.

The rules are ``StreamRelay``'s (sans-IO); this moves bytes and owns the silence clock.
One read is ``take``: the rules, the first-token mark, the inter-token gaps and, once the
response is streaming, one direct write to the client (``DirectSink.send_nowait``); none
of it waits. What must wait (the first output, a slow client's rest, the end, a fault) is
``settle``d in the request's task. Between, the request parks in the ``StreamReactor``,
whose task runs ``take`` on each readiness of the engine's socket: a token costs no task
switch. Without a reactor (tests of the core, in-memory streams) the request's task reads.

The silence clock is set once per read, after the write; it is lifted (a slow client is
not a silent engine) only while a write waits. Gaps are counted per request and flushed
to the histogram at the end.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import trio

from narwhal.core.lifecycle import Lifecycle
from narwhal.engines.client import DecodeStream
from narwhal.engines.transport import TransportError
from narwhal.metrics import RequestBuckets
from narwhal.router.stream_reactor import RESUME, StreamReactor
from narwhal.stream.rules import Commit, Fault, Finish, Hold, Send, StreamRelay

HELD = object()  # metadata before the first token: held, and the first-token clock runs
FLUSH = object()  # a direct write left a rest: the request's task writes it


@runtime_checkable
class DirectSink(Protocol):
    """A sink that can write a chunk without waiting (the ASGI layer under hypercorn)."""

    def send_nowait(self, data: bytes) -> bool: ...  # True: all of it went out
    async def flush(self) -> None: ...  # after False, at once: the rest


class RelayRun(Protocol):
    """What the relay needs of its request (``narwhal.router.execute.RequestRun``)."""

    tokens: int  # generated tokens: the engine's usage when it came, else output chunks
    lifecycle: Lifecycle

    def first_token(self) -> None: ...
    def echoed(self, data: bytes) -> bytes: ...  # a chunk as the client sees it
    async def output(self, action: Commit | Send) -> None: ...
    async def finish(self, data: bytes) -> None: ...


class RelayLoop:
    """One decode stream's relay for ``run``, under ``clock``."""

    def __init__(
        self,
        run: RelayRun,
        relay: StreamRelay,
        clock: trio.CancelScope,
        silence: float,
        gaps: RequestBuckets,
        direct: DirectSink | None,
        reactor: StreamReactor | None,
    ) -> None:
        self.run = run
        self.relay = relay
        self.clock = clock
        self.direct = direct
        self.reactor = reactor
        self.silence = silence  # decode_read_timeout_s; 0: none
        self.gaps = gaps
        self.last_output_at: float | None = None
        self.stream: DecodeStream | None = None
        # the silence clock while parked (``_restart_clock``): the deadline moves only when
        # a read comes in the second half of the silence, or at ``due`` (``on_due``)
        self.parked_fd = -1
        self.restarted_at = -math.inf  # the last read that restarted the silence clock
        self.due = -math.inf  # -inf: the next read sets the deadline (none set yet)

    async def relay_all(self, stream: DecodeStream) -> None:
        """Until ``[DONE]`` is relayed (return) or the stream faults (raise)."""
        self.stream = stream
        reactor = self.reactor
        try:
            while True:
                fd = -1 if reactor is None or not reactor.running else stream.park_fd()
                if fd >= 0:
                    assert reactor is not None
                    self.parked_fd = fd
                    try:
                        due = self.due if self.due > -math.inf else math.inf
                        pending = await reactor.park(fd, self.on_ready, due, self.on_due)
                    except TransportError as exc:
                        await stream.fail(exc)
                        raise
                    finally:
                        self.parked_fd = -1
                    if pending is not RESUME:
                        if await self.settle(pending):
                            return
                        continue
                data = await stream.read()
                if data is None:
                    raise self.relay.end_of_stream().fault
                pending = self.take(data)
                if pending is not None and await self.settle(pending):
                    return
        finally:
            self.gaps.flush()  # nothing here awaits: cancellation included

    def on_ready(self) -> object:
        """The reactor's call on the engine socket's readiness: None, stay parked."""
        assert self.stream is not None
        data = self.stream.read_nowait()
        if data is None:
            return RESUME
        if not data:
            return None
        pending = self.take(data)
        return None if pending is HELD else pending

    def take(self, data: bytes) -> object:
        """One read, without waiting: None when it is all done, else what to settle."""
        relay, run = self.relay, self.run
        tokens_before = relay.tokens
        action = relay.feed(data)
        tokens = relay.tokens
        # the engine's count once its usage came (at the end), chunks with output until then
        generated = relay.generated
        run.tokens = tokens if generated is None else generated
        if tokens and not tokens_before:
            run.first_token()
        kind = type(action)
        if kind is Fault or kind is Finish:
            return action
        if not tokens and not run.lifecycle.output_seen:
            return HELD
        if tokens != tokens_before:
            now = trio.current_time()
            if self.last_output_at is not None:
                # per token, as vLLM's inter-token latency: a read that brought k tokens
                # after a gap g is k tokens g/k apart
                self.gaps.add(now - self.last_output_at, tokens - tokens_before)
            self.last_output_at = now
        direct = self.direct
        if kind is Send and direct is not None:
            assert isinstance(action, Send)
            if not direct.send_nowait(run.echoed(action.data)):
                self.clock.deadline = math.inf  # a slow client is not a silent engine
                return FLUSH
        elif kind is not Hold:
            self.clock.deadline = math.inf  # nor is a write that waits
            return action
        self._restart_clock()
        return None

    async def settle(self, pending: object) -> bool:
        """What ``take`` left that waits; True: the stream is done (``[DONE]`` relayed)."""
        if pending is HELD:
            return False
        run = self.run
        if type(pending) is Fault:
            assert isinstance(pending, Fault)
            if pending.flush is not None:
                self.clock.deadline = math.inf  # the engine has spoken: the client's turn
                await run.output(pending.flush)
            raise pending.fault
        if type(pending) is Finish:
            assert isinstance(pending, Finish)
            assert self.stream is not None
            self.clock.deadline = math.inf  # a slow client taking the end is not silence
            await run.finish(pending.data)
            await self.stream.drain()
            return True
        if pending is FLUSH:
            assert self.direct is not None
            await self.direct.flush()
        else:
            assert isinstance(pending, Commit | Send)
            await run.output(pending)
        self._restart_clock()
        return False

    def _restart_clock(self) -> None:
        """The silence clock starts again now (a read, or a write that waited). The
        deadline is exact: parked, it is ``restarted_at`` + silence once ``on_due`` or a
        read in the second half has moved it; in the request's task it moves at once."""
        now = self.restarted_at = trio.current_time()
        if self.parked_fd < 0 or now >= self.due:
            silence = self.silence
            deadline = self.clock.deadline = now + silence if silence > 0 else math.inf
            self.due = deadline - silence / 2
            if self.parked_fd >= 0:
                assert self.reactor is not None
                self.reactor.set_due(self.parked_fd, self.due)

    def on_due(self) -> float:
        """The reactor's call at ``due``, half the silence before the deadline: move the
        deadline to the last read's, and say when to look again (never: no read since the
        deadline was set; the next read moves it, as it comes after ``due``)."""
        deadline = self.restarted_at + self.silence
        if deadline <= self.clock.deadline:
            return math.inf
        self.clock.deadline = deadline
        self.due = deadline - self.silence / 2
        return self.due
