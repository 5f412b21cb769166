"""A client that leaves while the router writes the answer's last bytes got part of it:
the journal says ``cancelled`` (phase ``stream``), never ``completed`` (contract 8, invariant 1).

From the wire: a client with a tiny receive buffer reads until the last write has begun
(a marker in it arrives), then resets the connection. That write is far bigger than what
the kernel buffers hold for such a client, so the router is still writing it when the reset
comes. Real clock over loopback; every wait is on a condition, bounded.
"""

from __future__ import annotations

import socket
import struct

import msgspec
import trio

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.faults import Fault
from narwhal.router.journal import JournalLine
from tests.support.fleet import MODEL, Harness, finish, start_fleet

RECEIVE_BUFFER = 1024  # the kernel doubles it; the router's writes back up at once
BIG = 900_000  # bytes of text in the last event: under the router's 1 MiB event limit


def _request(body: dict[str, object]) -> bytes:
    data = msgspec.json.encode(body)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(data) + data


async def _fleet(nursery: trio.Nursery) -> Harness:
    return await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=30.0),
    )


async def _leave_once(harness: Harness, request: bytes, marker: bytes) -> tuple[JournalLine, int]:
    """Send ``request``, read until ``marker`` has arrived, then reset the connection;
    the request's journal line, and how many bytes the client got."""
    host, port = harness.url.removeprefix("http://").split(":")
    got = b""
    with trio.socket.socket() as sock, trio.fail_after(20):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        await sock.connect((host, int(port)))
        await sock.send(request)
        while marker not in got:
            data = await sock.recv(4096)
            assert data, "the router closed before the last write began"
            got += data
        # a zero linger: close() resets the connection, as a client killed mid-read does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with trio.fail_after(20):
        await harness.router.wait_drained()
    return harness.router.journal.lines[-1], len(got)


def _chunk(text: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    chunk = {
        "id": "cmpl-big",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
    }
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


async def test_a_client_that_leaves_during_the_last_streamed_write_is_cancelled(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    # the consumer streams two small tokens, then one big last event with [DONE] behind it:
    # the router writes that event and the end of the stream in its last write
    last = _chunk("LAST-WRITE-BEGINS" + "x" * BIG, "length") + b"data: [DONE]\n\n"
    script = [
        ("headers", None),
        ("write", _chunk("a") + _chunk("b")),
        ("write", last),
        ("end", None),
    ]
    harness.engines["d0"].faults.push(Fault(kind="script", value=script))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "stream": True}
    line, got = await _leave_once(harness, _request(body), b"LAST-WRITE-BEGINS")
    assert got < BIG  # the client never had the end
    assert (line.outcome, line.phase) == ("cancelled", "stream")
    assert line.status is None
    assert harness.router.disconnects == 0  # the request had finished on the engine's side
    await finish(harness)


async def test_a_client_that_leaves_during_the_json_answer_is_cancelled(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 20000}
    # the whole JSON answer (about 100 KB) is the one last write: its head begins it
    line, got = await _leave_once(harness, _request(body), b"HTTP/1.1 200 ")
    assert got < 50_000
    assert (line.outcome, line.phase) == ("cancelled", "stream")
    assert line.status is None
    assert line.tokens == 20000  # the engine finished; only the write to the client did not
    await finish(harness)


async def test_a_client_that_reads_the_whole_answer_is_completed(nursery: trio.Nursery) -> None:
    """The same answers read to their end: completed, 200 (the check is not a false alarm)."""
    harness = await _fleet(nursery)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2000, "stream": stream}
        reply = await harness.post("/v1/completions", body)
        assert reply.status == 200
        await harness.router.wait_drained()
        line = harness.router.journal.lines[-1]
        assert (line.outcome, line.status, line.tokens) == ("completed", 200, 2000)
    await finish(harness)
