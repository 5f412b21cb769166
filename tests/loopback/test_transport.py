"""The data-leg transport under stress: cancellation while the pool is saturated, and
keep-alive connections the engine closed while they sat idle."""

from __future__ import annotations

import random
import socket

import pytest
import trio

from narwhal.core.faults import RequestFault
from narwhal.engines.client import EngineClient
from narwhal.engines.engine_connection import EngineConnection
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from tests.support.wire import CHUNK, HEAD, serve_once

MODEL = "fake-model"
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 20}


async def _decode_all(client: EngineClient, url: str) -> int:
    async with client.decode(url, "/v1/completions", BODY, None) as stream:
        return sum([len(chunk) async for chunk in stream])


async def test_cancellation_under_contention_leaks_no_pool_slot(nursery: trio.Nursery) -> None:
    """encode/httpcore#1093: requests cancelled while the pool is contended leaked slots
    until every request failed. Here: 4 slots, 64 requests cancelled at random points."""
    engine = FakeEngine(FakeEngineConfig(model=MODEL, itl_s=0.005))
    url = await nursery.start(engine.serve)
    client = EngineClient(max_connections=4)
    rng = random.Random(1093)

    async def cancelled_at_random() -> None:
        with trio.move_on_after(rng.uniform(0.0, 0.15)):
            await _decode_all(client, url)

    async with trio.open_nursery() as crowd:
        for _ in range(64):
            crowd.start_soon(cancelled_at_random)
    open_conns, active = client.connections()[url]
    assert active == 0
    assert client.limiter(url).borrowed_tokens == 0
    assert open_conns <= 4
    with trio.fail_after(10):  # and the pool still serves, at full width
        async with trio.open_nursery() as after:
            for _ in range(8):
                after.start_soon(_decode_all, client, url)
    assert client.connections()[url][1] == 0
    await client.aclose()


async def test_an_idle_connection_the_engine_closed_is_replaced(nursery: trio.Nursery) -> None:
    engine = FakeEngine(FakeEngineConfig(model=MODEL))
    url = await nursery.start(engine.serve)
    client = EngineClient()
    assert await _decode_all(client, url) > 0
    assert client.connections()[url] == (1, 0)  # kept alive
    engine.stop()  # drops every open connection, as a restarted engine would
    await engine.wait_idle()
    await nursery.start(engine.serve)  # back on the same port
    with trio.fail_after(5):
        assert await _decode_all(client, url) > 0  # no error: a fresh connection was used
    assert engine.counters["connections"] == 2
    await client.aclose()


async def test_a_refused_connection_is_an_engine_fault(nursery: trio.Nursery) -> None:
    engine = FakeEngine(FakeEngineConfig(model=MODEL))
    url = await nursery.start(engine.serve)
    engine.stop()
    client = EngineClient()
    with pytest.raises(RequestFault, match=r"^cannot connect to engine") as info:
        await _decode_all(client, url)
    assert info.value.status == 502
    assert client.limiter(url).borrowed_tokens == 0
    await client.aclose()


async def test_reuse_check_works_beyond_a_thousand_descriptors(nursery: trio.Nursery) -> None:
    """select() cannot watch descriptors >= 1024; a busy router has many more."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # push new fds past 1024
    try:
        engine = FakeEngine(FakeEngineConfig(model=MODEL))
        url = await nursery.start(engine.serve)
        client = EngineClient()
        for _ in range(2):  # the second reuses a kept-alive connection with a high fd
            assert await _decode_all(client, url) > 0
        assert engine.counters["connections"] == 1
        await client.aclose()
    finally:
        for fd in filler:
            os.close(fd)


async def test_past_a_burst_only_max_idle_connections_stay_open(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Descriptors track the streams in flight: after a burst of 12 concurrent legs the
    pool keeps MAX_IDLE of their connections and closes the rest at once."""
    from narwhal.engines import transport

    monkeypatch.setattr(transport, "MAX_IDLE", 3)
    engine = FakeEngine(FakeEngineConfig(model=MODEL, itl_s=0.01))
    url = await nursery.start(engine.serve)
    client = EngineClient()
    async with trio.open_nursery() as burst:
        for _ in range(12):
            burst.start_soon(_decode_all, client, url)
    assert client.connections()[url] == (3, 0)
    assert await _decode_all(client, url) > 0  # and a kept one serves the next
    assert engine.counters["connections"] == 12
    await client.aclose()


async def test_a_request_the_kernel_takes_in_part_is_still_sent_whole() -> None:
    """The request goes out in one non-blocking write when the kernel takes it whole; what
    a full send buffer leaves is written after, in order, nothing lost or doubled."""
    ours, theirs = trio.socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn = EngineConnection(trio.SocketStream(ours))
    payload = bytes(random.Random(7).randbytes(1 << 20))  # far more than the buffer
    received = bytearray()

    async def read_all() -> None:
        while len(received) < len(payload):
            received.extend(await theirs.recv(65536))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_all)
            await conn.send(payload)
    assert bytes(received) == payload
    ours.close()
    theirs.close()


DONE = b"data: [DONE]\n\n"
DONE_CHUNK = b"%x\r\n%s\r\n" % (len(DONE), DONE)
LAST_CHUNK = b"0\r\n\r\n"


async def _read_to_done(client: EngineClient, url: str, timeout_s: float) -> None:
    """A decode stream read up to its ``[DONE]``, then drained as the relay does."""
    async with client.decode(url, "/v1/completions", BODY, None) as stream:
        seen = b""
        while DONE not in seen:
            batch = await stream.read()
            assert batch is not None
            seen += batch
        await stream.drain(timeout_s)


async def test_a_stream_whose_end_came_with_done_is_drained_at_once(
    nursery: trio.Nursery,
) -> None:
    """The body's last chunk in the read that brought ``[DONE]`` (an engine's usual
    answer): the drain has nothing to wait for, ends with no clock of its own, and the
    connection goes back to the pool for the next request."""
    url = await serve_once(nursery, [HEAD + CHUNK + DONE_CHUNK + LAST_CHUNK], [])
    client = EngineClient()
    with trio.fail_after(5):
        await _read_to_done(client, url, timeout_s=3600.0)
    assert client.connections()[url] == (1, 0)  # kept alive, no slot held
    await client.aclose()


async def test_a_stream_whose_end_never_comes_is_drained_within_its_bound(
    nursery: trio.Nursery,
) -> None:
    """``[DONE]`` without the body's last chunk, which never follows: the drain gives up
    at its bound and closes the connection rather than keep one in an unknown state."""
    url = await serve_once(nursery, [HEAD + CHUNK + DONE_CHUNK], [])
    client = EngineClient()
    with trio.fail_after(5):
        await _read_to_done(client, url, timeout_s=0.05)
    assert client.connections()[url] == (0, 0)  # closed, no slot held
    await client.aclose()
