"""Invariant 10: a connection the router gives up on a client write (the request deadline,
the graceful drain) is reset, so a client that reads slowly sees the end at once, not after
the megabytes the kernel still holds for it (a plain close queues its FIN behind them: the
client saw the stream open 8 s past a 10 s deadline, and the kernel held the memory).

The reader: a raw socket with a 4 KB receive buffer, reading a byte every 10 ms, of a stream
of fat tokens (5 KB each, 10 MB in all). What the router's kernel holds for it (16 KB not
yet sent, trio's ``TCP_NOTSENT_LOWAT``, plus what is in flight) takes minutes to read at
that pace: before the reset, the FIN came only after all of it."""

from __future__ import annotations

import select
import socket

import msgspec
import trio

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, start_fleet

TIMEOUT_S = 2.0
GRACE_S = 0.5
WINDOW_S = 1.0  # the client sees the end within this of the deadline (contract 8, invariant 10)
FAT = b"x" * 5000
TOKENS = 2000


def fat_stream() -> Fault:
    """A decode response of TOKENS fat tokens, written as fast as the router takes them."""
    chunk = msgspec.json.encode(
        {
            "id": "cmpl-fat",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [
                {"index": 0, "text": FAT.decode(), "logprobs": None, "finish_reason": None}
            ],
        }
    )
    event = b"data: " + chunk + b"\n\n"
    steps = [("headers", None), *[("write", event)] * TOKENS, ("write", b"data: [DONE]\n\n")]
    return Fault(kind="script", leg="decode", value=[*steps, ("end", None)])


async def fleet(nursery: trio.Nursery) -> Harness:
    serving = ServingConfig(request_timeout_s=TIMEOUT_S, graceful_timeout_s=GRACE_S)
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=serving)
    h.engines["d0"].faults.push(fat_stream())
    return h


async def open_slow_reader(h: Harness) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = h.url.removeprefix("http://").split(":")
    await sock.connect((host, int(port)))
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": "fat", "max_tokens": TOKENS, "stream": True}
    )
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    await sock.send(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    return sock


async def read_slowly_until_the_end(sock: trio.socket.SocketType) -> tuple[float, int]:
    """Read a byte every 10 ms until the end of the connection reaches the client: (when,
    bytes read). The end is what the client's kernel tells (a FIN: ``POLLRDHUP``; a reset:
    ``POLLERR``, ``POLLHUP``), as an event loop watching the socket sees it: a reset is told
    at once, while the bytes already in the receive buffer are still to be read."""
    ends = select.poll()
    ends.register(sock.fileno(), select.POLLRDHUP)  # POLLHUP and POLLERR always count
    got = 0
    while not ends.poll(0):
        got += len(await sock.recv(1))
        await trio.sleep(0.01)  # the slow reader is the behaviour under test
    return trio.current_time(), got


async def test_a_slow_reader_sees_the_end_at_the_deadline(nursery: trio.Nursery) -> None:
    h = await fleet(nursery)
    sock = await open_slow_reader(h)
    deadline = trio.current_time() + TIMEOUT_S  # the router's is a little later
    with sock, trio.fail_after(TIMEOUT_S + WINDOW_S + 1.0):
        seen, got = await read_slowly_until_the_end(sock)
    print("DEADLINE", seen - deadline, got)
    assert seen - deadline < WINDOW_S, f"the end came {seen - deadline:.2f}s past the deadline"
    assert got < TOKENS * len(FAT) // 4  # the stream was far from over
    await h.router.wait_drained()
    [line] = h.router.journal.lines
    assert (line.outcome, line.status) == ("expired", 504)
    await finish(h)  # reservations and engine connections back to none


async def test_a_slow_reader_sees_the_end_when_the_drain_ends(nursery: trio.Nursery) -> None:
    h = await fleet(nursery)
    sock = await open_slow_reader(h)
    with sock:
        assert (await sock.recv(100)).startswith(b"HTTP/1.1 200")
        h.stop.set()  # what SIGTERM does: the drain begins, graceful_timeout_s to go
        drain_ends = trio.current_time() + GRACE_S
        with trio.fail_after(GRACE_S + WINDOW_S + 1.0):
            seen, _ = await read_slowly_until_the_end(sock)
    assert seen - drain_ends < WINDOW_S, f"the end came {seen - drain_ends:.2f}s past the drain"
    with trio.fail_after(5):
        await h.stopped.wait()
    assert [line.outcome for line in h.router.journal.lines] == ["failed"]
    assert h.router.fleet.reserved() == 0
    await h.http.aclose()
