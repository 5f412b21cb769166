"""KV events from a fake engine on real loopback sockets: a ZMQ SUB socket and a replay
client as a router would hold them, and an engine with events on (real clock: zmq)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpcore
import msgspec
import trio
import zmq

from narwhal.fake_engine import kv_events
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.lowlevel import zmq_trio

MODEL = "tiny"
WAIT_S = 10.0  # every wait on a socket is bounded by this


class Message(msgspec.Struct, frozen=True):
    """One message as a subscriber reads it."""

    topic: bytes
    seq: int
    payload: bytes

    def batch(self, encoding: kv_events.Encoding = "map") -> list[kv_events.Event]:
        return kv_events.decode_batch(self.payload, encoding)[1]


class Subscriber:
    """A SUB socket of the test's own, read all along by a task of its own as a router's
    subscriber is (a bound SUB that nobody reads never sends its subscription on: ZMQ
    runs a socket's commands when it is used), closed on leaving ``subscriber()``."""

    def __init__(self, topic: bytes) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._send, self._received = trio.open_memory_channel[list[bytes]](100_000)

    def bind(self) -> str:
        """Bind an ephemeral loopback port (the engine's PUB connects); its address."""
        self.sock.bind("tcp://127.0.0.1:0")
        value = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(value, bytes)
        return value.decode()

    async def read(self, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            try:
                while True:
                    self._send.send_nowait(await zmq_trio.recv_multipart(self.sock))
            except trio.ClosedResourceError:
                return  # the socket was closed under the wait

    async def next(self) -> Message:
        with trio.fail_after(WAIT_S):
            frames = await self._received.receive()
        assert len(frames) == 3, frames
        topic, seq, payload = frames
        assert len(seq) == 8
        return Message(topic, int.from_bytes(seq, "big"), payload)

    async def take(self, n: int) -> list[Message]:
        return [await self.next() for _ in range(n)]

    def pending(self) -> int:
        """Messages that arrived and were not taken."""
        return self._received.statistics().current_buffer_used


@asynccontextmanager
async def subscriber(
    nursery: trio.Nursery, engine: FakeEngine | None = None, topic: bytes = b"kv"
) -> AsyncIterator[Subscriber]:
    """A SUB socket; given ``engine`` (whose PUB binds), connected to it and attached: the
    engine has seen its subscription, so no batch published from now on is lost."""
    sub = Subscriber(topic)
    reader: trio.CancelScope = await nursery.start(sub.read)
    try:
        if engine is not None:
            assert engine.kv_events is not None
            seen = engine.kv_events.subscriptions
            sub.sock.connect(engine.kv_events.endpoint.replace("*", "127.0.0.1"))
            with trio.fail_after(WAIT_S):
                await engine.kv_events.wait_subscribed(seen + 1)
        yield sub
    finally:
        reader.cancel()
        zmq_trio.close(sub.sock)


async def replay(endpoint: str, start: int, frames: list[bytes] | None = None) -> list[Message]:
    """Ask the replay socket from ``start`` as a DEALER does (the empty delimiter frame
    first); the batches it answers, up to its end marker (not included)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint.replace("*", "127.0.0.1"))
        await zmq_trio.send_multipart(sock, frames or [b"", start.to_bytes(8, "big")])
        out = []
        with trio.fail_after(WAIT_S):
            while True:
                empty, topic, seq, payload = await zmq_trio.recv_multipart(sock)
                assert empty == b""
                if seq == kv_events.END_SEQ:
                    assert (topic, payload) == (b"", b"")
                    return out
                out.append(Message(topic, int.from_bytes(seq, "big"), payload))
    finally:
        zmq_trio.close(sock)


class Engine:
    """A fake engine with KV events, served on loopback, and an HTTP client to it."""

    def __init__(self, engine: FakeEngine, http: httpcore.AsyncConnectionPool) -> None:
        self.engine = engine
        self.http = http

    @property
    def publisher(self) -> Any:
        assert self.engine.kv_events is not None
        return self.engine.kv_events

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        content = None if body is None else msgspec.json.encode(body)
        headers = [("content-type", "application/json")]
        with trio.fail_after(WAIT_S):
            resp = await self.http.request(
                method, self.engine.url + path, headers=headers, content=content
            )
        return resp.status, msgspec.json.decode(resp.content) if resp.content else None

    async def complete(self, prompt: str, max_tokens: int = 4) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        status, _ = await self.call("POST", "/v1/completions", body)
        assert status == 200

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        status, reply = await self.call("POST", "/tokenize", {"model": MODEL, **body})
        assert status == 200
        tokens: list[int] = reply["tokens"]
        return tokens


@asynccontextmanager
async def kv_engine(nursery: trio.Nursery, **fields: Any) -> AsyncIterator[Engine]:
    """An engine of model ``MODEL`` with ``fields``; its PUB binds an ephemeral port and its
    replay socket another unless ``fields`` say otherwise."""
    fields.setdefault("kv_events_endpoint", "tcp://127.0.0.1:0")
    fields.setdefault("kv_events_replay_endpoint", "tcp://127.0.0.1:0")
    engine = FakeEngine(FakeEngineConfig(model=MODEL, **fields))
    await nursery.start(engine.serve)
    http = httpcore.AsyncConnectionPool()
    try:
        yield Engine(engine, http)
    finally:
        await http.aclose()
        engine.stop()


def words(n: int, tag: str) -> str:
    """A prompt of ``n`` distinct words (``n`` tokens), told apart by ``tag``."""
    return " ".join(f"{tag}{i}" for i in range(n))
