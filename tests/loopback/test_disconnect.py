"""A client that goes away mid-decode cancels the engine leg at once (contract invariant 7)."""

from __future__ import annotations

import socket

import pytest
import trio

from narwhal.core.config import ServingConfig
from tests.support.fleet import MODEL, Harness, finish, start_fleet
from tests.support.wire import open_stream_and_vanish


async def test_client_disconnect_mid_decode_cancels_the_engine_leg(
    nursery: trio.Nursery,
) -> None:
    # 200 tokens at 50 ms: ten seconds of decode unless the leg is cancelled
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.05}
    )
    consumer = harness.engines["d0"]
    body = (
        b'{"model": "%s", "prompt": "hello there", "max_tokens": 200, "stream": true}'
        % MODEL.encode()
    )
    with trio.fail_after(5):
        await open_stream_and_vanish(harness.url, body)
        await harness.router.wait_drained()
    assert harness.router.disconnects == 1
    assert harness.router.fleet.reserved() == 0
    # the fake engine saw its client (the router) go away, well before 200 tokens
    with trio.fail_after(2):
        await consumer.wait_idle()
    assert consumer.counters["decode_disconnects"] == 1
    assert consumer.counters["generation_tokens"] < 100
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.status, line.phase) == ("cancelled", None, "stream")
    await finish(harness, disconnects=1)


def _post(body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body


async def _pipeline_behind_a_long_answer(url: str) -> trio.SocketStream:
    """A connection that sent, in one write, a JSON completion of ten seconds' decode (200
    tokens at 50 ms) and a small request pipelined behind it."""
    long = b'{"model": "%s", "prompt": "hello there", "max_tokens": 200}' % MODEL.encode()
    waiting = b'{"model": "%s", "prompt": "and then", "max_tokens": 5}' % MODEL.encode()
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(_post(long) + _post(waiting))
    return stream


@pytest.mark.parametrize(
    "then",
    [b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"],
    ids=["close", "half-a-request-then-close"],
)
async def test_a_client_that_pipelined_a_request_and_left_cancels_at_once(
    nursery: trio.Nursery, then: bytes
) -> None:
    """Hypercorn stops reading while a pipelined request waits for the response before
    it, so a client that closed was seen only when that response ended: a JSON answer
    of ten seconds' decode, written to nobody. Now the close is seen at once, and the
    waiting request never runs; bytes sent before the close (half of a third request) do
    not hide it: the watch is for the client's end, not for readable bytes."""
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.05}
    )
    consumer = harness.engines["d0"]
    with trio.fail_after(5):
        stream = await _pipeline_behind_a_long_answer(harness.url)
        await consumer.wait_running()  # the first is being decoded
        if then:
            await stream.send_all(then)
        await stream.aclose()
        await harness.router.wait_drained()
        await consumer.wait_idle()
    assert harness.router.disconnects == 1
    assert consumer.counters["decode_disconnects"] == 1
    assert consumer.counters["generation_tokens"] < 100
    (line,) = harness.router.journal.lines  # the pipelined request was never served
    assert line.outcome == "cancelled"
    await finish(harness, disconnects=1)


async def test_pipelined_requests_are_still_each_answered_in_order(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.01}
    )
    first = b'{"model": "%s", "prompt": "one", "max_tokens": 20, "stream": true}' % MODEL.encode()
    second = b'{"model": "%s", "prompt": "two", "max_tokens": 3}' % MODEL.encode()
    host, port = harness.url.removeprefix("http://").split(":")
    received = b""
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(host, int(port))
        await stream.send_all(_post(first) + _post(second) + _post(second))
        while received.count(b"HTTP/1.1 200") < 3 or not received.endswith(b"}"):
            received += await stream.receive_some(65536)
        await stream.aclose()
        await harness.router.wait_drained()
    assert received.index(b"data: [DONE]") < received.index(b"content-type: application/json")
    assert [line.outcome for line in harness.router.journal.lines] == ["completed"] * 3
    await finish(harness)


async def test_the_router_closing_a_pipelining_connection_is_no_connection_error(
    nursery: trio.Nursery,
) -> None:
    """A client that pipelines and never reads: the request deadline cuts the write and
    the router closes the socket under the watch, which ends quietly (no error logged or
    counted, the pipelined request never runs)."""
    streamed = (
        b'{"model": "%s", "prompt": "hello there", "max_tokens": 16000, "stream": true}'
        % MODEL.encode()
    )
    waiting = b'{"model": "%s", "prompt": "and then", "max_tokens": 5}' % MODEL.encode()
    harness = await _send_and_never_read(nursery, _post(streamed) + _post(waiting))
    (line,) = harness.router.journal.lines  # the pipelined request never ran
    assert (line.outcome, line.status) == ("expired", 504)
    assert harness.router.metrics.connection_errors._value.get() == 0
    await finish(harness)


async def test_a_json_answer_cut_by_the_deadline_on_its_way_is_not_a_completion(
    nursery: trio.Nursery,
) -> None:
    """A client that never reads: the whole JSON answer is ready, but its write is cut by
    the request deadline. The client got part of it: the journal says expired, 504, not
    completed (found by an outside test)."""
    body = b'{"model": "%s", "prompt": "hello there", "max_tokens": 20000}' % MODEL.encode()
    harness = await _send_and_never_read(nursery, _post(body))
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.status) == ("expired", 504)
    await finish(harness)


async def _send_and_never_read(nursery: trio.Nursery, data: bytes) -> Harness:
    """A fleet with a 1 s request deadline, and a client (a 1 KiB receive buffer) that sends
    ``data`` and never reads; returned once the router has drained."""
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=1.0),
    )
    host, port = harness.url.removeprefix("http://").split(":")
    with trio.socket.socket() as sock, trio.fail_after(5):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        await sock.connect((host, int(port)))
        await sock.send(data)
        await harness.engines["d0"].wait_running()
        await harness.router.wait_drained()
    return harness
