"""Hostile clients: what they send never reaches an engine it must not, never
becomes two requests, never ties a connection up past a configured bound, never a 500.

Raw sockets where the shape cannot be sent by an HTTP client library. The bounds that time
alone decides (slowloris headers, a trickled body, an idle keep-alive connection, a chunk
announced past the body limit) are timed to the tick in ``tests/shell/test_front_door_timing.py``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.frontdoor.answers import read_body
from narwhal.router.health import live_tasks
from tests.support.fleet import MODEL, Harness, finish, start_fleet
from tests.support.wire import read_answer, request, statuses

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
COMPLETION = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 2})


async def raw_exchange(url: str, *parts: bytes) -> bytes:
    """Send ``parts``, then read until the router closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    received = bytearray()
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            try:
                for part in parts:
                    await stream.send_all(part)
            except trio.BrokenResourceError:
                pass  # the router closed on us mid-send: what comes next says why
            while chunk := await read_answer(stream):
                received += chunk
    return bytes(received)


def engine_requests(*engines: FakeEngine) -> int:
    return sum(len(e.log) for e in engines)


# ---- client kv_transfer_params ----------------------------------------------------------

FORGED: list[Any] = [
    None,
    "string",
    42,
    3.5,
    True,
    [],
    [{"do_remote_prefill": True}],
    {},
    {"do_remote_decode": False},
    {"do_remote_decode": True},
    {"do_remote_prefill": True},
    {"do_remote_prefill": True, "remote_engine_id": "evil"},
    {
        "do_remote_prefill": True,
        "remote_engine_id": "evil",
        "remote_block_ids": [[1]],
        "remote_host": "10.0.0.1",
        "remote_port": 1,
    },
    {"remote_host": "169.254.169.254", "remote_port": 80},
    {"remote_host": "127.0.0.1", "remote_port": 22, "do_remote_prefill": True},
    {"remote_block_ids": list(range(100_000))},
    {"remote_block_ids": [[i] for i in range(10_000)]},
    {"tp_size": 10**18, "do_remote_prefill": True},
    {"tp_size": -1},
    {"nested": {"kv_transfer_params": {"do_remote_prefill": True}}},
    {"kv_transfer_params": {"kv_transfer_params": {"remote_engine_id": "x"}}},
    {"remote_engine_id": None, "remote_block_ids": None},
    {"remote_request_id": "someone-elses-request", "transfer_mode": "push"},
]


async def test_client_descriptors_never_reach_an_engine(nursery: trio.Nursery) -> None:
    """In every shape, pointing at a real producer too: the engines see only the router's."""
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    producer, consumer = h.engines["p0"], h.engines["d0"]
    # one aimed at the real producer's KV side channel, with its real engine id
    real_target = {
        "do_remote_prefill": True,
        "remote_engine_id": producer.engine_id,
        "remote_host": producer.host,
        "remote_port": producer.kv_port,
        "remote_block_ids": [[1, 2]],
        "remote_request_id": "guessed",
    }
    shapes = [*FORGED, real_target]
    assert len(shapes) >= 20
    for i, forged in enumerate(shapes):
        for endpoint, extra in (
            ("/v1/completions", {"prompt": PROMPT}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
        ):
            body = {"model": MODEL, "max_tokens": 2, "stream": i % 2 == 0, **extra}
            reply = await h.post(endpoint, {**body, "kv_transfer_params": forged})
            assert reply.status == 200, (forged, reply.body[:200])
    issued = {e["request_id"] for e in producer.store.events} | set(producer.store.released)
    for entry in producer.log:
        assert entry["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    for entry in consumer.log:
        kv = entry["body"]["kv_transfer_params"]
        assert kv["remote_engine_id"] == producer.engine_id
        assert kv["remote_request_id"] in issued
    assert consumer.counters["kv_pull_failed"] == 0
    assert producer.counters["kv_pull_refused_forged"] == 0
    assert producer.counters["kv_release_declined_forged"] == 0
    await finish(h)


# ---- HTTP framing, headers and paths (raw sockets) ----------------------------------------

BOUNDED = ServingConfig(
    graceful_timeout_s=0.5, client_idle_timeout_s=1.0, client_body_timeout_s=1.0
)


@pytest.fixture
async def bounded(nursery: trio.Nursery) -> Harness:
    return await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=BOUNDED)


async def test_bytes_after_a_request_that_said_close_are_ignored(bounded: Harness) -> None:
    """RFC 9112 9.6: the request that asked to close is answered, and what the client sent
    after it is neither served nor an error (h11 raised on it, and the router answered the
    valid request with a 400 after placing both its legs)."""
    follow = request(b"", path=b"/v1/models", close=False).replace(b"POST", b"GET")
    shape = request(COMPLETION, b"content-length: %d" % len(COMPLETION)) + follow
    raw = await raw_exchange(bounded.url, shape)
    assert statuses(raw) == [200], raw[:300]
    assert b'"choices"' in raw
    await finish(bounded)


async def test_headers_too_long_or_too_many_are_refused(bounded: Harness) -> None:
    length = b"content-length: %d" % len(COMPLETION)
    for size in (40, 70, 120):  # KiB, in one field or spread over many
        long_header = b"x-filler: " + b"a" * (size * 1024)
        raw = await raw_exchange(bounded.url, request(COMPLETION, length, long_header))
        assert statuses(raw) == [431], size
        spread = [b"x-f%d: " % i + b"a" * (size * 1024 // 50) for i in range(50)]
        raw = await raw_exchange(bounded.url, request(COMPLETION, length, *spread))
        assert statuses(raw) == [431], size
    many = [b"x-h%d: v" % i for i in range(500)]
    raw = await raw_exchange(bounded.url, request(COMPLETION, length, *many))
    assert statuses(raw) == [431]
    assert b"header fields; at most 100" in raw
    # a 1 MiB request id is refused before any engine sees it (never echoed onwards)
    rid = b"x-request-id: " + b"r" * (1 << 20)
    raw = await raw_exchange(bounded.url, request(COMPLETION, rid))
    assert statuses(raw) == [431]
    assert engine_requests(*bounded.engines.values()) == 0
    await finish(bounded)


async def test_a_body_broken_two_ways_at_once_gets_one_answer_and_the_journal_says_it(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A chunk announced past the limit whose bytes past the limit came with it (the app
    refuses those bytes), or a chunk past the limit with a malformed end (the server
    refuses the framing): one answer goes out, with no error in the router, and the journal
    says what the client was told (an outside tester's finding)."""
    small = ServingConfig(max_request_bytes=4096, client_body_timeout_s=30.0)
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=small)
    head = request(b"", b"transfer-encoding: chunked", close=False)
    shapes = [
        b"fff4\r\n" + b" " * 8000,  # 65,524 announced, 8,000 (over 4,096) already sent
        b"1001\r\n" + b" " * 5000,  # 4,097 sent, then no chunk end where it must be
        b"1000\r\n" + b" " * 4096 + b"\r\n1\r\n P",
    ]
    for body in shapes:
        raw = await raw_exchange(h.url, head + body)
        [status] = statuses(raw)
        await trio.testing.wait_all_tasks_blocked()  # the request's journal line is written
        line = h.router.journal.lines[-1]
        assert (line.outcome, line.status) == ("rejected", status), raw[:300]
        assert msgspec.json.encode(line.message)[1:-1] in raw, (line.message, raw[-300:])
    assert h.router.metrics.connection_errors._value.get() == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert engine_requests(*h.engines.values()) == 0


async def test_only_documented_paths_are_served(bounded: Harness) -> None:
    for path in (
        b"/invocations",  # /tokenize and /detokenize are served (contract 3, test_tokenize.py)
        b"/v1/embeddings",
        b"/../v1/completions",
        b"/v1/../v1/completions",
        b"//v1/completions",
        b"/v1/completions/",
        b"/V1/COMPLETIONS",
        b"/v1/completions%00",
    ):
        raw = await raw_exchange(
            bounded.url, request(COMPLETION, b"content-length: %d" % len(COMPLETION), path=path)
        )
        assert statuses(raw) in ([404], [400]), (path, raw[:200])
    assert engine_requests(*bounded.engines.values()) == 0
    await finish(bounded)


# ---- bodies --------------------------------------------------------------------------------


async def test_an_oversized_body_is_refused_after_reading_at_most_limit_plus_64k() -> None:
    limit = 1 << 20
    chunk = b"x" * 65536
    delivered = 0

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        delivered += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    scope = {"headers": [(b"transfer-encoding", b"chunked")]}  # no length to refuse up front
    with pytest.raises(Exception, match="exceeds max_request_bytes") as caught:
        await read_body(scope, receive, limit)
    assert getattr(caught.value, "status", None) == 413
    assert delivered <= limit + 64 * 1024


async def test_json_bombs_are_400_in_bounded_cpu(bounded: Harness) -> None:
    bombs = [
        b'{"model": "fake-model", "prompt": "x", "n": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
        b'{"model": "fake-model", "prompt": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
        b'{"model": "fake-model", "prompt": "x", "max_tokens": ' + b"9" * 100_000 + b"}",
        b'{"model": "fake-model", "prompt": "x", "temperature": 1e999999}',
        b'{"model": "fake-model", "prompt": "x", "top_p": -' + b"9" * 100_000 + b".5}",
        b'{"model": "fake-model", "prompt": [' + b"1," * 200_000 + b'1], "max_tokens": "x"}',
    ]
    for bomb in bombs:
        start = time.process_time()
        reply = await bounded.post("/v1/completions", bomb)
        assert reply.status == 400, reply.body[:200]
        assert time.process_time() - start < 1.0  # bounded CPU, generous for a busy machine
    assert engine_requests(*bounded.engines.values()) == 0
    await finish(bounded)


async def _answered_and_kept(url: str) -> trio.SocketStream:
    """A keep-alive connection whose one request has been answered whole."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(request(COMPLETION, b"content-length: %d" % len(COMPLETION), close=False))
    seen = b""
    while b'"choices"' not in seen:
        seen += await stream.receive_some(65536)
    return stream


async def _closed_within(stream: trio.SocketStream, limit_s: float) -> float:
    """Seconds until the router closes ``stream`` (nothing else may arrive)."""
    start = time.monotonic()
    with trio.fail_after(limit_s):
        assert await read_answer(stream) == b""
    return time.monotonic() - start


async def test_shutdown_closes_idle_connections_at_once_and_lets_a_stream_end(
    nursery: trio.Nursery,
) -> None:
    """At a graceful shutdown an idle keep-alive connection closes at once; a stream goes on
    to its end; a response that starts after the shutdown began says ``connection: close``
    (no client may send another request on it, nor count on one it pipelined)."""
    slow = {"itl_s": 0.05}  # a 20-token stream: 1 s, longer than the idle connection waits
    h = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine_config=slow,
        serving=ServingConfig(graceful_timeout_s=5.0, client_idle_timeout_s=30.0),
    )
    idle = await _answered_and_kept(h.url)
    host, port = h.url.removeprefix("http://").split(":")
    whole = await trio.open_tcp_stream(host, int(port))  # answered at its end, after the stop
    body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 20})
    pipelined = request(b"", path=b"/v1/models", close=False).replace(b"POST", b"GET")
    await whole.send_all(request(body, b"content-length: %d" % len(body), close=False) + pipelined)
    busy = await trio.open_tcp_stream(host, int(port))
    body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True})
    await busy.send_all(request(body, b"content-length: %d" % len(body), close=False))
    first = await busy.receive_some(65536)
    assert first.startswith(b"HTTP/1.1 200")
    await trio.testing.wait_all_tasks_blocked()
    assert h.router.admission.admitted == 2
    h.stop.set()
    async with idle:
        assert await _closed_within(idle, limit_s=1.0) < 1.0  # not the 30 s idle bound
    rest = bytearray(first)
    answer = bytearray()
    async with busy, whole:
        with trio.fail_after(5):
            while chunk := await read_answer(busy):
                rest += chunk
            while chunk := await read_answer(whole):
                answer += chunk
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), bytes(rest[-80:])
    assert statuses(bytes(answer)) == [200]  # the pipelined request is not served
    assert b"\r\nconnection: close\r\n" in answer.lower().split(b"\r\n\r\n")[0] + b"\r\n"
    with trio.fail_after(5):
        await h.stopped.wait()


async def test_a_closed_client_connection_is_released_at_once(bounded: Harness) -> None:
    """hypercorn kept a connection's idle timer (and its socket, in CLOSE_WAIT) running after
    the client closed; ``narwhal.frontdoor.direct`` stops it when reading ends."""
    idle_timers = ("hypercorn.trio.tcp_server.TCPServer._idle_timeout",)
    body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True})
    host, port = bounded.url.removeprefix("http://").split(":")
    for _ in range(3):
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(request(body, b"content-length: %d" % len(body), close=False))
            seen = b""
            while not seen.endswith(b"0\r\n\r\n"):  # the end of the chunked body
                seen += await stream.receive_some(65536)
    # the idle bound is 1 s here: once every task has settled, none may still be waiting on it
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)
    assert live_tasks(idle_timers) == 0
    await finish(bounded)
