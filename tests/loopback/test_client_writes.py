"""Writes to the client (``narwhal.frontdoor.direct``): a write nothing contends for goes
straight to the socket, and what the kernel does not take still arrives, whole and in order."""

from __future__ import annotations

import socket

import httpcore
import msgspec
import pytest
import trio

from narwhal.core.config import EngineConfig
from narwhal.lowlevel import fast_io
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, Harness, finish, start_fleet

PROMPT = "a narwhal swims north under the ice"
TOKENS = 3000  # about 400 KB of events: far more than a 16 KiB receive window holds


async def read_stream(url: str, *, slow: bool, tokens: int = TOKENS) -> list[bytes]:
    """The events of one streamed completion; ``slow`` reads through a tiny receive buffer
    and pauses between reads, so the router's writes back up into its send buffer."""
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)] if slow else None
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": tokens, "stream": True}
    parser, events = SSEParser(), []
    async with (
        httpcore.AsyncConnectionPool(socket_options=options) as http,
        http.stream("POST", url + "/v1/completions", content=msgspec.json.encode(body)) as resp,
    ):
        assert resp.status == 200
        async for data in resp.aiter_stream():
            events += parser.feed(data)
            if slow and len(events) % 500 == 0:
                await trio.sleep(0.05)  # the slow reader is the behaviour under test
    return events


async def test_a_slow_reader_gets_every_byte_in_order(pd: Harness) -> None:
    slow = await read_stream(pd.url, slow=True)
    fast = await read_stream(pd.url, slow=False)
    assert slow[-1] == b"[DONE]"
    texts = [msgspec.json.decode(e)["choices"][0]["text"] for e in slow[:-1]]
    assert len([t for t in texts if t]) == TOKENS
    # the same prompt read at full speed: the same events, byte for byte, in the same order
    strip = [msgspec.json.decode(e)["choices"] for e in slow[:-1]]
    assert strip == [msgspec.json.decode(e)["choices"] for e in fast[:-1]]
    await pd.router.wait_drained()
    assert [j.outcome for j in pd.router.journal.lines] == ["completed", "completed"]


async def test_an_http10_client_gets_the_stream_until_close(pd: Harness) -> None:
    """HTTP/1.0 has no chunked framing: the stream is the body up to the close (the chunk
    shortcut applies only where h11 agreed chunked framing)."""
    body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True})
    host, port = pd.url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    head = b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
    async with stream:
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        raw = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                raw += data
    status, _, payload = raw.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.0 200") or status.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in status.lower()
    events = SSEParser().feed(payload)
    assert events[-1] == b"[DONE]"
    assert sum(1 for e in events[:-1] if msgspec.json.decode(e)["choices"][0]["text"]) == 20


async def test_answers_given_without_reading_the_body_keep_the_connection(pd: Harness) -> None:
    """A 404 to a POST with a body, sent before hypercorn has read that body, used to close
    the kept-alive connection under the client's next request ("server disconnected")."""
    async with httpcore.AsyncConnectionPool(max_connections=1) as http:
        for _ in range(60):
            resp = await http.request("POST", pd.url + "/no/such/path", content=b"x" * 2048)
            assert resp.status == 404
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        resp = await http.request(
            "POST", pd.url + "/v1/completions", content=msgspec.json.encode(body)
        )
        assert resp.status == 200


async def test_the_head_goes_out_with_the_first_chunk_and_the_last_chunk_with_the_end(
    pd: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write for the 200 head and the first events, one for the last events and the
    end of the chunked body (the router's writes to client sockets, counted)."""
    writes: list[bytes] = []
    real_write = fast_io.os.write

    def write(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(fast_io.os, "write", write)
    events = await read_stream(pd.url, slow=False, tokens=5)
    assert events[-1] == b"[DONE]"
    head = [w for w in writes if w.startswith(b"HTTP/1.1 200")]
    assert len(head) == 1
    assert b"data: {" in head[0].partition(b"\r\n\r\n")[2]
    assert writes[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_client_slow_to_take_the_end_is_not_a_silent_engine(
    nursery: trio.Nursery,
) -> None:
    """The last engine read (with [DONE]) is written under no silence clock: a client whose
    slow reading holds that write longer than ``decode_read_timeout_s`` still gets the whole
    stream (before, the clock cut the write, the journal said completed, the engine was
    blamed)."""
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine=EngineConfig(decode_read_timeout_s=0.2)
    )
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    )
    host, port = harness.url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    got = b""
    async with stream:
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        with trio.fail_after(20):  # a steady slow reader: the router's writes back up
            while not got.endswith(b"\r\n0\r\n\r\n") and (data := await stream.receive_some(600)):
                got += data
                await trio.sleep(0.01)
    assert b"data: [DONE]\n\n" in got
    assert b'"error"' not in got
    await harness.router.wait_drained()
    assert harness.router.journal.lines[-1].outcome == "completed"
    assert [e.breaker.streak for e in harness.router.fleet.engines] == [0, 0]
    await finish(harness)
