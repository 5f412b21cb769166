"""The production per-token path to the tick: client and engines over socketpairs, the real
front door, trio's MockClock.

With real descriptors the engine's socket is parked in the stream reactor and each token is
written to the client's socket without waiting (``router/token_path.py``), the paths that
in-memory streams switch off. A socketpair delivers a write before it returns, so autojump
stays exact: each assertion is about when a byte reached the client's socket, in virtual
seconds.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from narwhal.core.config import EngineConfig
from narwhal.fake_engine.faults import Fault
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, memory_fleet

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
