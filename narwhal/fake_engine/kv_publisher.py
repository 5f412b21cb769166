"""The fake engine's KV-event sockets on trio: what ``kv_events.EventStream`` decides, sent.

The publisher is an XPUB socket, which a SUB sees exactly as vLLM's PUB (same frames, drops
at its high-water mark, never blocks); unlike a PUB it also reads its subscribers'
subscriptions, so a test can wait until a subscriber is attached (``wait_subscribed``)
instead of losing the first batches to ZMQ's slow joiner. Sends are plain non-blocking
calls from the engine's trio code, within the request whose cache change they publish;
after each one the subscriptions that arrived are read at once, since a send can consume
the edge of ``zmq.FD`` that the reading task waits for (``narwhal.lowlevel.zmq_trio``). The replay
ROUTER socket has its own task; both live in the engine's nursery and are closed with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import trio
import zmq

from narwhal.fake_engine import kv_events
from narwhal.fake_engine.cost import BLOCK_TOKENS, Inserted
from narwhal.fake_engine.kv_events import Encoding, Event, Knobs
from narwhal.lowlevel import zmq_trio

log = logging.getLogger(__name__)

HWM = 100_000  # vLLM's default for its PUB socket
FLOOD_CHECKPOINT = 256  # a flood lets the engine's other tasks run every this many batches
REBIND_TRIES, REBIND_WAIT_S = 50, 0.02  # a restart waits up to 1 s for its old addresses


class BindError(Exception):
    """A KV-event socket could not bind or connect (the address taken, or malformed)."""


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        *,
        host: str = "127.0.0.1",
        topic: str = "kv",
        encoding: Encoding = "map",
        buffer_steps: int = kv_events.DEFAULT_BUFFER_STEPS,
    ) -> None:
        self.configured = endpoint
        self.configured_replay = replay_endpoint
        self.host = host
        self.buffer_steps = buffer_steps
        self.stream = kv_events.EventStream(topic, encoding, buffer_steps)
        self.endpoint = endpoint  # as a subscriber reaches it (port 0 replaced once bound)
        self.replay_endpoint = replay_endpoint or None
        self.bound_endpoint: str | None = None  # the sockets' own last endpoints
        self.bound_replay_endpoint: str | None = None
        self.published = 0  # messages the socket took (a duplicate counts twice)
        self.dropped = 0  # messages the socket refused (zmq.Again)
        self.unsent = 0  # messages sequenced while the sockets were closed
        self.subscriptions = 0  # subscribe messages seen
        self._subscribed = trio.Event()
        self._pub: zmq.Socket[bytes] | None = None
        self._started = False

    @property
    def seq(self) -> int:
        """The next batch's sequence number."""
        return self.stream.seq

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the sockets (an engine start: seq from 0 again), serve subscriptions and
        replays until cancelled, then close them. A restart binds the same addresses."""
        restarting = self._started
        if restarting:
            self.stream.restart()
        self._started = True
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub: zmq.Socket[bytes] = ctx.socket(zmq.XPUB)
        replay: zmq.Socket[bytes] | None = None
        try:
            # a restart binds the addresses the last run closed: ZMQ's I/O thread lets
            # them go a moment after close returns, so a bind may meet them still taken
            for attempt in range(REBIND_TRIES if restarting else 1):
                try:
                    replay = self._open(ctx, pub)
                    break
                except BindError:
                    if attempt == REBIND_TRIES - 1 or not restarting:
                        raise
                    zmq_trio.close(pub)
                    pub = ctx.socket(zmq.XPUB)
                    await trio.sleep(REBIND_WAIT_S)
            self._pub = pub
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_subscriptions, pub)
                if replay is not None:
                    nursery.start_soon(self._serve_replays, replay)
                task_status.started()
        finally:
            self._pub = None
            zmq_trio.close(pub)
            if replay is not None:
                zmq_trio.close(replay)

    def _open(
        self, ctx: zmq.Context[zmq.Socket[bytes]], pub: zmq.Socket[bytes]
    ) -> zmq.Socket[bytes] | None:
        """Bind or connect the publisher, bind the replay socket (returned, None without one)."""
        replay: zmq.Socket[bytes] | None = None
        where = self.configured
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, HWM)
            pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            if kv_events.binds(self.configured):
                where = self.bound_endpoint or kv_events.bind_address(self.configured, self.host)
                pub.bind(where)
                self.bound_endpoint = _last_endpoint(pub)
                self.endpoint = kv_events.usable(self.configured, self.bound_endpoint)
            else:
                pub.connect(self.configured)
            if self.configured_replay:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # one whole replay fits under the high-water mark; past it (a requester
                # that reads nothing) or to a requester gone, a send raises, not drops
                replay.setsockopt(zmq.SNDHWM, self.buffer_steps + 2)
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                where = self.bound_replay_endpoint or kv_events.bind_address(
                    self.configured_replay, self.host
                )
                replay.bind(where)
                self.bound_replay_endpoint = _last_endpoint(replay)
                self.replay_endpoint = kv_events.usable(
                    self.configured_replay, self.bound_replay_endpoint
                )
        except zmq.ZMQError as exc:
            if replay is not None:
                zmq_trio.close(replay)
            raise BindError(f"narwhal: KV events cannot use {where}: {exc}") from None
        return replay

    # ---- publishing ------------------------------------------------------------------

    def inserted(
        self, tokens: Sequence[int], change: Inserted, lora: tuple[int, str] | None = None
    ) -> None:
        """Publish one prefix-cache insertion (nothing when it changed nothing); ``lora``:
        the adapter's id and name when the blocks were computed under one."""
        self.publish(self.stream.inserted(tokens, change, lora))

    def cleared(self) -> None:
        self.publish(self.stream.cleared())

    def publish(self, events: list[Event]) -> None:
        """One batch of ``events``, sequenced and sent now (none: no batch)."""
        if not events:
            return
        for frames in self.stream.emit(events):
            self._send(frames)

    def _send(self, frames: kv_events.Frames) -> None:
        if self._pub is None:
            self.unsent += 1
            return
        try:
            self._pub.send_multipart(frames, zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1
        self._note_subscriptions(zmq_trio.recv_ready(self._pub, 64))

    async def apply(self, knobs: Knobs) -> None:
        """``POST /fake/kv_events``: set the knobs, then flood if asked."""
        self.stream.set_knobs(knobs)
        for n in range(knobs.flood):
            self.publish(self.stream.synthetic())
            if n % FLOOD_CHECKPOINT == FLOOD_CHECKPOINT - 1:
                await trio.lowlevel.checkpoint()

    # ---- subscriptions and replays ---------------------------------------------------

    async def wait_subscribed(self, n: int = 1) -> None:
        """Return once ``n`` subscriptions have reached the publisher (tests)."""
        while self.subscriptions < n:
            await self._subscribed.wait()

    async def _read_subscriptions(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            first = await zmq_trio.recv_multipart(sock)
            self._note_subscriptions([first, *zmq_trio.recv_ready(sock, 64)])

    def _note_subscriptions(self, messages: list[kv_events.Frames]) -> None:
        seen = sum(1 for m in messages if m and m[0][:1] == b"\x01")
        if seen:
            self.subscriptions += seen
            self._subscribed.set()  # wake wait_subscribed, then arm for the next one
            self._subscribed = trio.Event()

    async def _serve_replays(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            request = await zmq_trio.recv_multipart(sock)
            answer = self.stream.replay(request)
            for frames in answer or []:
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the requester left, or reads nothing
                    self.stream.counters["replay_cut"] += 1
                    log.debug("kv events: a replay was cut short: %s", exc)
                    break
            await trio.lowlevel.checkpoint()  # a burst of requests lets the engine run

    # ---- what the engine shows -------------------------------------------------------

    def sources(self) -> dict[str, Any]:
        """``GET /kv_event_sources``: vLLM's ``KVEventsConfig`` fields, as a subscriber
        reaches them, and what this engine adds."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": HWM,
            "topic": self.stream.topic.decode(),
            "encoding": self.stream.encoding,
            "block_size": BLOCK_TOKENS,
            "mode": "bind" if kv_events.binds(self.configured) else "connect",
            "bound_endpoint": self.bound_endpoint,
            "bound_replay_endpoint": self.bound_replay_endpoint,
        }

    def stats(self) -> dict[str, Any]:
        """For ``GET /fake/stats``."""
        return {
            "seq": self.seq,
            "published": self.published,
            "dropped": self.dropped,
            "unsent": self.unsent,
            "subscriptions": self.subscriptions,
            "buffered": len(self.stream.buffer),
            "counters": dict(self.stream.counters),
        }


def _last_endpoint(sock: zmq.Socket[bytes]) -> str:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
