"""The engines' KV events, read into the precise prefix index (docs/operator-guide.md,
"KV events"), in the server's background nursery.

``subscribe``: one SUB socket per engine, connected to the publisher its
``GET /kv_event_sources`` names (``*`` read as the engine's host), else its ``kv_events``
key, else its URL's host and ``[kv_events] port``; the engine's replay socket, when it
names one, repairs gaps. ``listen``: one SUB socket bound at ``[kv_events] listen``, which
the engines' publishers connect to, each batch told apart by its topic (an engine's topic
from its ``/kv_event_sources``, else its id).

Each engine's stream runs in a cancel scope of its own, ended when the engine leaves the
fleet. Messages are read in helpings of at most ``HELPING`` with a checkpoint between, so
a publisher that floods takes its turn like any task; what it sends beyond what is read,
ZMQ drops at the socket's high-water mark, and the gap that leaves is handled as any gap.
Nothing an engine sends ends a loop: a malformed message is counted and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import trio
import zmq
from prometheus_client import Counter

from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import RequestFault
from narwhal.core.fleet import Fleet
from narwhal.core.kv_events import (
    Rejected,
    Source,
    event_sources,
    parse_message,
    parse_replayed,
    replay_request,
)
from narwhal.core.precise_index import EventStream, StreamState
from narwhal.lowlevel import zmq_trio
from narwhal.observe.metrics import Metrics
from narwhal.router.background import Background

log = logging.getLogger("narwhal.kv_events")
HELPING = 256  # messages read between checkpoints
RCVHWM = 10_000  # messages ZMQ keeps for a slow reader before it drops (then: a gap)
REPLAY_TIMEOUT_S = 2.0  # a replay that has not ended by then: what it brought is kept
MAX_REPLAYED = 20_000  # batches one replay may bring
# the most batches read from one engine a second: a vLLM engine publishes one a scheduler
# step (hundreds a second); past this a publisher floods, and what it sends beyond is
# left to ZMQ's high-water mark (a gap) rather than to the router's event loop
BATCHES_PER_S = 5_000
EXPORT_S = 0.25  # a stream's metrics are brought up to date at most this often while it reads
RESYNC_S = 1.0  # how often the engine set is compared with the streams followed
MAX_STRAY_TOPICS = 16  # topics no engine publishes, named in the log once each


class KvHost(Protocol):
    config: FleetConfig
    fleet: Fleet
    background: Background
    metrics: Metrics


@dataclass
class _Followed:
    """One engine followed: its scope, its source, and what its metrics were last told."""

    engine: EngineState
    scope: trio.CancelScope
    source: Source | None = None
    exported: dict[str, int] = field(default_factory=dict)
    exported_at: float = -1.0
    window: float = -1.0  # the second its reads are counted in, and how many so far
    read: int = 0

    async def pace(self, count: int) -> None:
        """Count ``count`` batches read; past ``BATCHES_PER_S`` in this second, wait for
        the next (a checkpoint either way: a flood takes its turn like any task)."""
        now = trio.current_time()
        if now - self.window >= 1.0:
            self.window, self.read = now, 0
        self.read += count
        if self.read >= BATCHES_PER_S:
            await trio.sleep_until(self.window + 1.0)
        else:
            await trio.lowlevel.checkpoint()


class KvSubscriber:
    def __init__(self, router: KvHost) -> None:
        self.router = router
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None  # while a mode is on
        self._followed: dict[str, _Followed] = {}
        self._topics: dict[bytes, str] = {}  # listen: a topic -> the engine publishing it
        self._strays: set[bytes] = set()  # listen: topics no engine publishes, logged once
        # listen, under --workers N: the parent's relay of what it receives
        # (narwhal.process.kv_relay)
        self.relay = ""
        self._applied = trio.lowlevel.ParkingLot()  # woken after each helping is applied

    async def wait_until(self, check: Callable[[], bool]) -> None:
        """Return once ``check()`` holds, looking again after every helping applied (for
        operators' tools and tests: the view is then as the events left it)."""
        while not check():
            await self._applied.park()

    @property
    def mode(self) -> str:
        return self.router.config.kv_events.mode

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow every engine of the fleet while ``[kv_events]`` is on, and each one added
        later; a reload that changes the mode starts over."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                mode = self.mode
                if mode == "off":
                    await trio.sleep(RESYNC_S)
                    continue
                with trio.CancelScope() as scope:
                    nursery.start_soon(self._watch_mode, mode, scope)
                    await self._follow_all(mode)

    async def _watch_mode(self, mode: str, scope: trio.CancelScope) -> None:
        """A reload that changes the mode ends the streams of the old one."""
        while True:
            await trio.sleep(RESYNC_S)
            if self.mode != mode:
                scope.cancel()
                return

    async def _follow_all(self, mode: str) -> None:
        self._context = zmq.Context()
        try:
            async with trio.open_nursery() as nursery:
                if mode == "listen":
                    await nursery.start(self._listen)
                while True:
                    self._sync(nursery, mode)
                    for followed in self._followed.values():  # what a lazy export left
                        self._export(followed)
                    await trio.sleep(RESYNC_S)
        finally:
            for followed in self._followed.values():
                self.router.fleet.precise.drop(followed.engine.id)
            self._followed.clear()
            self._topics.clear()
            self._context.destroy(linger=0)
            self._context = None

    def _sync(self, nursery: trio.Nursery, mode: str) -> None:
        """Start following engines new to the fleet; stop those that left it."""
        fleet = self.router.fleet
        for engine_id, followed in list(self._followed.items()):
            if fleet.by_id.get(engine_id) is not followed.engine:
                followed.scope.cancel()
                del self._followed[engine_id]
        for engine in fleet.engines:
            if engine.id not in self._followed:
                followed = _Followed(engine, trio.CancelScope())
                self._followed[engine.id] = followed
                nursery.start_soon(self._follow, followed, mode)

    async def _follow(self, followed: _Followed, mode: str) -> None:
        engine = followed.engine
        with followed.scope:
            try:
                source = followed.source = await self._source(engine)
                if mode == "listen":
                    topic = (source.topic or engine.id).encode()
                    taken = self._topics.setdefault(topic, engine.id)
                    if taken != engine.id:  # two engines under one topic: neither is told
                        log.error(
                            "engines %s and %s publish under one topic %r: give each "
                            "its own (listen mode)",
                            taken,
                            engine.id,
                            topic.decode(),
                        )
                        self.router.fleet.precise.stream(engine.id).reject("topic")
                    await trio.sleep_forever()
                await self._subscribe(followed, source)
            finally:
                self._topics = {t: e for t, e in self._topics.items() if e != engine.id}
                self.router.fleet.precise.drop(engine.id)
                self._export(followed)

    async def _source(self, engine: EngineState) -> Source:
        """Where the engine's events come from: its own word, else the fleet file's."""
        host = urlsplit(engine.url).hostname or "127.0.0.1"
        client = self.router.background.checks_client()
        with trio.move_on_after(self.router.config.engine.health_timeout_s):
            try:
                status, body = await client.get(engine.url, "/kv_event_sources")
            except RequestFault:
                pass
            else:
                found = event_sources(body, host) if status == 200 else None
                if found is not None:
                    return found
        if engine.spec.kv_events:
            return Source(engine.spec.kv_events)
        name = f"[{host}]" if ":" in host else host
        return Source(f"tcp://{name}:{self.router.config.kv_events.port}")

    async def _subscribe(self, followed: _Followed, source: Source) -> None:
        sock = self._socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            sock.connect(source.endpoint)
            stream = self.router.fleet.precise.stream(followed.engine.id)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_connection, followed, sock)
                while True:
                    frames = await zmq_trio.recv_multipart(sock)
                    helping = [frames, *zmq_trio.recv_ready(sock, HELPING - 1)]
                    for message in helping:
                        self._deliver(followed, stream, message, nursery)
                    self._export(followed, lazily=True)
                    await followed.pace(len(helping))
        finally:
            zmq_trio.close(sock)

    async def _watch_connection(self, followed: _Followed, sock: zmq.Socket[bytes]) -> None:
        """The publisher's connection dropped: the engine may have restarted, and what it
        published before the SUB connected again is lost, its sequence perhaps caught up
        past ours. Its entries go; the next batch read makes its stream live again."""
        monitor: zmq.Socket[bytes] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            while True:
                frames = await zmq_trio.recv_multipart(monitor)
                event = int.from_bytes(frames[0][:2], "little") if frames else 0
                if event == zmq.EVENT_DISCONNECTED:
                    self.router.fleet.precise.drop(followed.engine.id)
                    self._export(followed)
        finally:
            sock.disable_monitor()
            zmq_trio.close(monitor)

    async def _listen(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        sock = self._socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                if self.relay:
                    sock.connect(self.relay)
                else:
                    sock.bind(self.router.config.kv_events.listen)
            except zmq.ZMQError as exc:  # taken, or not ours to bind: the estimate serves
                log.error("kv_events.listen %s: %s", self.router.config.kv_events.listen, exc)
                task_status.started()
                await trio.sleep_forever()
            task_status.started()
            async with trio.open_nursery() as nursery:
                while True:
                    frames = await zmq_trio.recv_multipart(sock)
                    touched: dict[str, int] = {}  # messages read per engine
                    for message in [frames, *zmq_trio.recv_ready(sock, HELPING - 1)]:
                        engine_id = self._topics.get(message[0]) if message else None
                        followed = self._followed.get(engine_id or "")
                        if followed is None:
                            self._stray(message[0] if message else b"")
                            continue
                        stream = self.router.fleet.precise.stream(followed.engine.id)
                        self._deliver(followed, stream, message, nursery)
                        touched[followed.engine.id] = touched.get(followed.engine.id, 0) + 1
                    for engine_id, count in touched.items():
                        self._export(self._followed[engine_id], lazily=True)
                        await self._followed[engine_id].pace(count)
                    await trio.lowlevel.checkpoint()
        finally:
            zmq_trio.close(sock)

    def _stray(self, topic: bytes) -> None:
        """A message under a topic no engine of the fleet publishes is dropped; the log says
        so once per topic (a publisher's topic that differs from what its engine's
        ``/kv_event_sources`` or the fleet file says would otherwise go unseen)."""
        if topic in self._strays or len(self._strays) >= MAX_STRAY_TOPICS:
            return
        self._strays.add(topic)
        known = sorted(t.decode(errors="replace") for t in self._topics)
        log.warning(
            "KV events under topic %r, which no engine of the fleet publishes (known: %s): dropped",
            topic.decode(errors="replace"),
            ", ".join(known) or "none",
        )

    def _deliver(
        self, followed: _Followed, stream: EventStream, frames: list[bytes], nursery: trio.Nursery
    ) -> None:
        message = parse_message(frames)
        if isinstance(message, Rejected):
            stream.reject(message.why)
            return
        replay = stream.receive(message, trio.current_time())
        if replay is not None:
            nursery.start_soon(self._replay, followed, stream, replay.start)

    async def _replay(self, followed: _Followed, stream: EventStream, start: int) -> None:
        """Ask the engine's replay socket for every batch from ``start``; the gap is closed
        or given up when it ends, is refused, or takes longer than ``REPLAY_TIMEOUT_S``."""
        source = followed.source
        try:
            if source is None or source.replay is None or not self.router.config.kv_events.replay:
                return
            sock = self._socket(zmq.DEALER)
            try:
                sock.connect(source.replay)
                with trio.move_on_after(REPLAY_TIMEOUT_S):
                    await zmq_trio.send_multipart(sock, replay_request(start))
                    for n in range(MAX_REPLAYED):
                        if n % HELPING == HELPING - 1:
                            await followed.pace(HELPING)
                        answer = parse_replayed(await zmq_trio.recv_multipart(sock))
                        if answer is None:
                            break
                        if isinstance(answer, Rejected):
                            stream.reject(answer.why)
                        else:
                            stream.replayed(answer, trio.current_time())
            finally:
                zmq_trio.close(sock)
        finally:
            stream.replay_ended(trio.current_time())
            self._export(followed)

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        assert self._context is not None  # sockets are made while a mode is on
        sock: zmq.Socket[bytes] = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
        return sock

    def _export(self, followed: _Followed, *, lazily: bool = False) -> None:
        """The stream's counters into the metrics, as the increments since last time;
        ``lazily`` (after a helping): at most every ``EXPORT_S``, the metrics' label
        look-ups being most of what a small batch costs."""
        now = trio.current_time()
        if lazily and now - followed.exported_at < EXPORT_S:
            self._applied.unpark_all()
            return
        followed.exported_at = now
        engine_id = followed.engine.id
        metrics = self.router.metrics
        stream = self.router.fleet.precise.streams.get(engine_id)
        if stream is None or engine_id not in metrics.engines:
            self._applied.unpark_all()
            return
        counts = {
            "batches": stream.batches,
            "events": stream.events,
            "skipped": stream.skipped,
            "replays": stream.replays,
            "restarts": stream.restarts,
            "repaired": stream.repaired,
            "unrepaired": stream.unrepaired,
            **{f"rejected:{why}": n for why, n in stream.rejects.items()},
        }
        last = followed.exported
        for name, value in counts.items():
            delta = value - last.get(name, 0)
            if delta > 0:
                _counter(metrics, engine_id, name).inc(delta)
        followed.exported = counts
        metrics.kv_blocks.labels(engine_id).set(len(stream.blocks))
        metrics.kv_stream_live.labels(engine_id).set(int(stream.state is StreamState.LIVE))
        self._applied.unpark_all()


def _counter(metrics: Metrics, engine_id: str, name: str) -> Counter:
    if name.startswith("rejected:"):
        return metrics.kv_events_rejected.labels(engine_id, name.removeprefix("rejected:"))
    if name in ("repaired", "unrepaired"):
        return metrics.kv_event_gaps.labels(engine_id, name)
    family = {
        "batches": metrics.kv_event_batches,
        "events": metrics.kv_events,
        "skipped": metrics.kv_events_skipped,
        "replays": metrics.kv_event_replays,
        "restarts": metrics.kv_event_restarts,
    }[name]
    return family.labels(engine_id)
