"""The production per-token path and the front door's client bounds to the tick: client and
engines over socketpairs, the real front door, trio's MockClock.

With real descriptors the engine's socket is parked in the stream reactor and each token is
written to the client's socket without waiting (``router/token_path.py``), the paths that
in-memory streams switch off. A socketpair delivers a write before it returns, so autojump
stays exact: each assertion is about when a byte reached the client's socket, or when the
router closed it, in virtual seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import trio.testing

from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, memory_fleet
from tests.support.wire import read_answer, request, statuses

STREAM = {"model": MODEL, "prompt": "one two three", "max_tokens": 4, "stream": True}
LAST_CHUNK = b"\r\n0\r\n\r\n"


async def exchange(fleet: MemoryFleet, body: dict[str, Any]) -> list[tuple[float, bytes]]:
    """POST ``body`` on a new client connection; each SSE payload of the answer, with the
    virtual time (from the send) its bytes reached the client's socket."""
    stream = await fleet.connect()
    data = msgspec.json.encode(body)
    start = trio.current_time()
    await stream.send_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(data), data)
    )
    received, parser, head = b"", SSEParser(), True
    payloads: list[tuple[float, bytes]] = []
    for _ in range(1000):  # a 4-token answer comes in far fewer reads
        piece = await stream.receive_some(65536)
        if not piece:
            break
        received += piece
        if head:  # the body starts after the head; chunk sizes are not SSE lines
            if b"\r\n\r\n" not in received:
                continue
            head, piece = False, received.split(b"\r\n\r\n", 1)[1]
        when = trio.current_time() - start
        payloads += [(when, p) for p in parser.feed(_unchunk(piece))]
        if received.endswith(LAST_CHUNK):
            break
    await stream.aclose()
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]
    return payloads


def _unchunk(piece: bytes) -> bytes:
    """The SSE bytes of a piece of chunked body whose chunks each hold whole lines (the
    router writes one chunk per engine read): the size lines dropped."""
    lines = piece.split(b"\r\n")
    return b"\r\n".join(line for line in lines if not _is_size(line)).replace(b"\r\n", b"\n")


def _is_size(line: bytes) -> bool:
    return bool(line) and all(c in b"0123456789abcdef" for c in line)


def texts(payloads: list[tuple[float, bytes]]) -> list[tuple[float, str]]:
    out = []
    for when, payload in payloads:
        if payload == b"[DONE]":
            continue
        choices = msgspec.json.decode(payload).get("choices") or []
        if choices and choices[0].get("text"):
            out.append((when, choices[0]["text"]))
    return out


async def test_tokens_reach_the_client_socket_at_the_engines_pace(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, itl_s=1.0, sockets=True)
    payloads = await exchange(fleet, STREAM)
    assert [when for when, _ in texts(payloads)] == [0.0, 1.0, 2.0, 3.0]
    assert payloads[-1] == (3.0, b"[DONE]")
    await trio.testing.wait_all_tasks_blocked()  # the request's task writes its line last
    assert fleet.router.journal.lines[-1].outcome == "completed"


async def test_a_parked_stream_that_goes_silent_ends_exactly_at_the_budget(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery, itl_s=1.0, sockets=True, engine=EngineConfig(decode_read_timeout_s=10.0)
    )
    # tokens at t=0, 1, 2 then silence: the client reads the terminal event at 2 + 10
    fleet.consumer.faults.push(Fault(kind="tokens_then_silence", tokens=3))
    payloads = await exchange(fleet, STREAM | {"max_tokens": 8})
    assert [when for when, _ in texts(payloads)] == [0.0, 1.0, 2.0]
    when, last = payloads[-1]
    error = msgspec.json.decode(last)["error"]
    assert (when, error["code"]) == (12.0, 504)
    assert error["message"].startswith("engine went silent between tokens")
    await trio.testing.wait_all_tasks_blocked()
    assert fleet.router.journal.lines[-1].outcome == "failed"


# ---- the bounds on what a client may hold: hostile clients, to the tick -------------------

COMPLETION = msgspec.json.encode({"model": MODEL, "prompt": "one two three", "max_tokens": 2})
BOUNDED = ServingConfig(
    graceful_timeout_s=0.5, client_idle_timeout_s=1.0, client_body_timeout_s=1.0
)


@dataclass
class Connection:
    """One client connection as its client saw it, in virtual seconds from its first send."""

    answered_at: float | None  # the first byte of the answer, if any came
    closed_at: float  # the router closed the connection
    raw: bytes  # everything it answered


async def connection(fleet: MemoryFleet, *parts: bytes, pause_s: float = 0.0) -> Connection:
    """Send ``parts`` ``pause_s`` apart on a new client connection, reading all the while,
    until the router closes it."""
    stream = await fleet.connect()
    start = trio.current_time()
    answered_at: float | None = None
    raw = b""

    async def send() -> None:
        try:
            for i, part in enumerate(parts):
                if i:
                    await trio.sleep(pause_s)  # virtual: the trickle is the behaviour under test
                await stream.send_all(part)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the router closed on us mid-send: what it answered says why

    async with stream, trio.open_nursery() as sender:
        sender.start_soon(send)
        while data := await read_answer(stream):
            answered_at = trio.current_time() - start if answered_at is None else answered_at
            raw += data
        closed_at = trio.current_time() - start
        sender.cancel_scope.cancel()
    return Connection(answered_at, closed_at, raw)


def engine_requests(fleet: MemoryFleet) -> int:
    return sum(len(engine.log) for engine in (fleet.producer, fleet.consumer))


async def test_slowloris_headers_are_closed_at_the_idle_bound(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, sockets=True, serving=BOUNDED)
    head = request(b"", b"content-length: 2")
    trickle = [head[i : i + 1] for i in range(len(head))]  # one byte every 0.2 s: ~20 s
    seen = await connection(fleet, *trickle, pause_s=0.2)
    assert seen.closed_at == 1.0  # the idle bound, to the tick
    assert statuses(seen.raw) in ([], [408])  # closed, never served
    assert engine_requests(fleet) == 0
    assert fleet.router.journal.lines == []  # never a request


async def test_a_trickled_body_is_408_at_the_body_bound(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, sockets=True, serving=BOUNDED)
    head = request(b"", b"content-length: %d" % len(COMPLETION))
    parts = [head, *(COMPLETION[i : i + 4] for i in range(0, len(COMPLETION), 4))]
    seen = await connection(fleet, *parts, pause_s=0.2)
    assert (seen.answered_at, seen.closed_at) == (1.0, 1.0)  # the body bound, to the tick
    assert statuses(seen.raw) == [408]
    assert b"client_body_timeout_s=1s" in seen.raw
    assert engine_requests(fleet) == 0
    # one journal line: the router received it and rejected it
    assert [(line.outcome, line.status) for line in fleet.router.journal.lines] == [
        ("rejected", 408)
    ]


async def test_a_chunk_announced_past_the_body_limit_is_413_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """The body's size is known once the chunk is announced: 413 then, not a 408 after the
    body timeout (30 s here) while the client sends nothing more. Nothing after it runs."""
    fleet = await memory_fleet(nursery, sockets=True)
    follow = request(b"", path=b"/v1/models", close=False).replace(b"POST", b"GET")
    head = request(b"", b"transfer-encoding: chunked", close=False)
    for announced in (b"ffffffff", b"400001"):  # 4 GiB; the 4 MiB limit plus one byte
        seen = await connection(fleet, head + announced + b"\r\n" + b"x" * 10, follow)
        assert (seen.answered_at, seen.closed_at) == (0.0, 0.0)  # at once
        assert statuses(seen.raw) == [413], seen.raw[:300]
        assert b"max_request_bytes=4194304" in seen.raw
        await trio.testing.wait_all_tasks_blocked()  # the request's journal line is written
        line = fleet.router.journal.lines[-1]
        assert (line.outcome, line.status) == ("rejected", 413)
    assert engine_requests(fleet) == 0


async def test_an_idle_keep_alive_connection_is_closed_at_the_idle_bound(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, sockets=True, serving=BOUNDED)
    kept = request(COMPLETION, b"content-length: %d" % len(COMPLETION), close=False)
    seen = await connection(fleet, kept)
    assert statuses(seen.raw) == [200]
    assert b'"choices"' in seen.raw
    # answered at once, then idle: closed the idle bound (1 s) after its answer
    assert (seen.answered_at, seen.closed_at) == (0.0, 1.0)
