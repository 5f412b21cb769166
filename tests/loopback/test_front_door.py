"""The front door (contract 3 "HTTP hygiene", invariants 9 and 10): what a hostile or careless
client does on the wire, seen from outside with raw sockets, HTTP/2 frames and the clients
operators' users run (httpx sync and async, aiohttp, the openai client, curl).

Each test names the item of the front-door issue it holds; each failed before the
connection handler, the lingering close and the admin rule existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import msgspec
import openai
import pytest
import trio
import trio.testing
from hyperframe.frame import DataFrame
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuzz import examples
from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.frontdoor.http11 import Http11Protocol
from narwhal.router.app import RouterApp
from tests.support.fleet import MODEL, Harness, finish, start_fleet
from tests.support.wire import h2_post, read_answer

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
COMPLETION = msgspec.json.encode({"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
LIMIT = 1 << 20  # max_request_bytes of these fleets
DOOR = ServingConfig(
    graceful_timeout_s=0.5,
    client_idle_timeout_s=20.0,  # a connection left open is not closed by the idle timer here
    client_body_timeout_s=5.0,
    max_request_bytes=LIMIT,
)


@pytest.fixture
async def door(nursery: trio.Nursery) -> Harness:
    return await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=DOOR)


def address(h: Harness) -> tuple[str, int]:
    host, port = h.url.removeprefix("http://").split(":")
    return host, int(port)


def request(
    body: bytes, *headers: bytes, path: bytes = b"/v1/completions", method: bytes = b"POST"
) -> bytes:
    head = [method + b" " + path + b" HTTP/1.1", b"host: 127.0.0.1"]
    return b"\r\n".join([*head, *headers, b"", b""]) + body


async def exchange(h: Harness, *parts: bytes, limit_s: float = 5.0) -> bytes:
    """Send ``parts``, then read until the router closes; fails if it keeps the connection
    open past ``limit_s`` (the fleet's idle timer is far longer)."""
    received = bytearray()
    with trio.fail_after(limit_s):
        stream = await trio.open_tcp_stream(*address(h))
        async with stream:
            try:
                for part in parts:
                    await stream.send_all(part)
            except trio.BrokenResourceError:
                pass
            while chunk := await read_answer(stream):
                received += chunk
    return bytes(received)


def statuses(raw: bytes) -> list[int]:
    return [int(line.split()[1]) for line in raw.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def engine_legs(h: Harness) -> int:
    return sum(len(e.log) for e in h.engines.values())


async def assert_serving(h: Harness) -> None:
    """A well-formed request on a fresh connection still gets its tokens."""
    reply = await h.post("/v1/completions", COMPLETION)
    assert reply.status == 200, reply.body[:300]
    assert reply.json()["choices"][0]["text"]


# ---- 1. HTTP/2 and the per-connection error boundary ---------------------------------------


def h2_request(path: str, *, body_size: int, extra: list[tuple[str, str]] = ()) -> bytes:  # type: ignore[assignment]
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [
        (":method", "POST" if body_size else "GET"),
        (":path", path),
        (":scheme", "http"),
        (":authority", "127.0.0.1"),
        *extra,
    ]
    if body_size:
        headers.append(("content-length", str(body_size)))
    conn.send_headers(1, headers, end_stream=not body_size)
    data = conn.data_to_send()
    for _ in range(min(body_size, 60_000) // 15_000):
        conn.send_data(1, b"x" * 15_000)
        data += conn.data_to_send()
    return data


@pytest.mark.parametrize(
    ("path", "body_size"),
    [("/no/such/path", 50_000), ("/v1/completions", 10 * LIMIT), ("/health", 30_000)],
)
async def test_prior_knowledge_http2_is_refused_and_the_router_lives(
    door: Harness, path: str, body_size: int
) -> None:
    """Item 1: hypercorn's HTTP/2 path ended the process on an early answer with DATA still
    arriving. HTTP/2 is not served: the client gets GOAWAY(HTTP_1_1_REQUIRED)."""
    raw = await exchange(door, h2_request(path, body_size=body_size))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    events = client.receive_data(raw)
    ended = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert ended
    assert ended[0].error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
    assert engine_legs(door) == 0
    await assert_serving(door)
    assert door.router.metrics.connection_errors._value.get() == 0
    await finish(door)


async def test_an_h2c_upgrade_offer_is_answered_in_http11(door: Harness) -> None:
    offer = request(
        b"",
        b"connection: Upgrade, HTTP2-Settings",
        b"upgrade: h2c",
        b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA",
        b"connection: close",
        path=b"/health",
        method=b"GET",
    )
    raw = await exchange(door, offer)
    assert statuses(raw) == [200]
    assert b'{"status":"ok"}' in raw
    await finish(door)


async def test_one_failing_connection_is_closed_alone(
    door: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 1: an exception inside one connection's tasks closes that connection, is
    counted, and touches neither the process nor a stream running on another connection."""
    original = Http11Protocol.check_request

    async def explode(self: Any, event: Any) -> None:
        if event.target == b"/boom":
            raise KeyError("a codec bug")
        await original(self, event)

    monkeypatch.setattr(Http11Protocol, "check_request", explode)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    async with door.http.stream(
        "POST", door.url + "/v1/completions", content=msgspec.json.encode(body)
    ) as resp:
        assert resp.status == 200
        chunks = resp.aiter_stream()
        await chunks.__anext__()  # the stream is under way on its own connection
        for _ in range(3):
            raw = await exchange(door, request(b"", path=b"/boom", method=b"GET"))
            assert raw == b""  # closed, no answer: the failure is this connection's alone
        rest = b"".join([chunk async for chunk in chunks])
    assert rest.endswith(b"data: [DONE]\n\n")
    assert door.router.metrics.connection_errors._value.get() == 3
    await assert_serving(door)
    await finish(door)


# ---- 2. request smuggling: every framing-error 400 closes the connection --------------------


SMUGGLED = request(COMPLETION, b"content-length: %d" % len(COMPLETION))
TE_BODY = b"0\r\n\r\n" + SMUGGLED


@pytest.mark.parametrize(
    "shape",
    [
        request(TE_BODY, b"content-length: %d" % len(TE_BODY), b"transfer-encoding: chunked"),
        request(TE_BODY, b"transfer-encoding: chunked", b"content-length: %d" % len(TE_BODY)),
        request(TE_BODY, b"content-length: 5", b"transfer-encoding:  chunked  "),
        request(TE_BODY, b"content-length: 5", b"transfer-encoding:\tchunked"),
        request(TE_BODY, b"content-length: 5", b"transfer-encoding:", b" chunked"),  # obs-fold
        request(TE_BODY, b"Content-Length: 5", b"Transfer-Encoding: CHUNKED"),
        request(
            COMPLETION + SMUGGLED, b"content-length: %d" % len(COMPLETION), b"content-length: 5"
        ),
        request(b"zz\r\n" + SMUGGLED, b"transfer-encoding: chunked"),  # a bad chunk size
        request(COMPLETION + SMUGGLED, b"content-length: -%d" % len(COMPLETION)),
        request(COMPLETION + SMUGGLED, b"content-length: %d, 5" % len(COMPLETION)),
    ],
    ids=[
        "cl-te",
        "te-cl",
        "te-spaces",
        "te-tab",
        "te-obs-fold",
        "case",
        "two-cl",
        "bad-chunk",
        "negative-cl",
        "cl-list",
    ],
)
async def test_framing_errors_are_400_and_close_the_connection(door: Harness, shape: bytes) -> None:
    """Item 2 (RFC 9112 6.1): one 400, then the router closes; the request hidden behind it
    never runs (it would have reached both engines)."""
    raw = await exchange(door, shape)
    assert statuses(raw) == [400], raw[:400]
    assert b"connection: close" in raw.lower()
    assert engine_legs(door) == 0
    await finish(door)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ((b"transfer-encoding: chunked",), "transfer-encoding: malformed chunked body"),
        (
            (b"content-length: 2000000", b"transfer-encoding: chunked"),
            "transfer-encoding: not allowed together with content-length",
        ),
    ],
    ids=["endless-chunk-size", "cl-te"],
)
async def test_a_broken_body_that_came_with_its_head_is_a_400_not_a_431(
    door: Harness, headers: tuple[bytes, ...], message: str
) -> None:
    """100 KB after the head in one write, no line end among them: h11's buffer fills on
    the chunk-size line and hints 431 (headers too large); the head was fine, the body's
    framing is what broke, and the answer says so, as it does when the head comes alone."""
    shape = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n%s\r\n\r\n" % b"\r\n".join(headers)
    raw = await exchange(door, shape + b"a" * 100_000)
    assert statuses(raw) == [400], raw[:400]
    _, _, body = raw.partition(b"\r\n\r\n")
    assert msgspec.json.decode(body)["error"]["message"] == message
    assert engine_legs(door) == 0
    await finish(door)


async def test_a_body_that_breaks_its_framing_gets_a_400_with_its_request_id(
    door: Harness,
) -> None:
    """The head was good, the chunked body is not: the server's 400 carries the id the
    request was given, and the journal says rejected (not a client that left)."""
    shape = request(
        b"10\r\n" + COMPLETION[:16] + b"\r\nzz\r\n" + SMUGGLED,
        b"transfer-encoding: chunked",
        b"x-request-id: broken-body-1",
    )
    raw = await exchange(door, shape)
    assert statuses(raw) == [400]
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"x-request-id: broken-body-1" in head.lower()
    assert msgspec.json.decode(body)["error"]["code"] == 400
    await trio.testing.wait_all_tasks_blocked()  # the app reads on to the end of the body
    [line] = door.router.journal.lines
    assert (line.request_id, line.outcome, line.status) == ("broken-body-1", "rejected", 400)
    assert engine_legs(door) == 0
    await finish(door)


# ---- 3. a client that stops reading ---------------------------------------------------------


async def open_stalled_stream(h: Harness, max_tokens: int = 30_000) -> trio.SocketStream:
    """A streamed completion whose client reads its first bytes, then stops reading."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(address(h))
    stream = trio.SocketStream(sock)
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    )
    await stream.send_all(request(body, b"content-length: %d" % len(body)))
    assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 200")
    return stream


async def read_to_close(stream: trio.SocketStream) -> None:
    """Read what the router wrote until it closes (or resets) the connection: a stream it
    gave up on is never ended whole, even when its terminal event fit in the socket
    buffers (contract 6: the body is cut after it)."""
    tail = b""
    while chunk := await read_answer(stream):
        tail = (tail + chunk)[-4096:]
    assert not tail.endswith(b"\r\n0\r\n\r\n")


async def test_a_stalled_reader_is_cut_at_the_request_deadline(nursery: trio.Nursery) -> None:
    """Item 3 / invariant 10: the write to a client that stopped reading is bounded by the
    request deadline (it was shielded: still open 8 s past a 10 s deadline)."""
    serving = ServingConfig(request_timeout_s=2.0, prefill_timeout_s=1.0, graceful_timeout_s=0.5)
    h = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=serving,
        engine=EngineConfig(first_token_timeout_s=1.0),
    )
    stream = await open_stalled_stream(h)
    # deadline + the bound on telling the client + slack for a busy machine
    with trio.fail_after(2.0 + 2.0 + 3.0):
        await h.router.wait_drained()
        await read_to_close(stream)  # the router closed the connection
    await stream.aclose()
    [line] = h.router.journal.lines
    assert (line.outcome, line.status) == ("expired", 504)
    assert h.router.fleet.reserved() == 0
    await finish(h, disconnects=h.router.disconnects)


async def test_a_stalled_reader_does_not_hold_the_drain(nursery: trio.Nursery) -> None:
    """Item 3: after shutdown begins, a stream to a client that stopped reading ends within
    graceful_timeout_s and the server returns (it was alive 20 s after SIGTERM)."""
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=DOOR)
    stream = await open_stalled_stream(h)
    h.stop.set()
    # grace + the bound on telling the client + hypercorn's margin + slack
    with trio.fail_after(0.5 + 2.0 + 1.0 + 3.0):
        await h.stopped.wait()
        await read_to_close(stream)
    await stream.aclose()
    assert h.router.admission.admitted == 0
    assert h.router.fleet.reserved() == 0
    assert [line.outcome for line in h.router.journal.lines] == ["failed"]
    await h.http.aclose()


# ---- 5. early answers to a body still arriving: lingering close -----------------------------

TRIES = 20
BIG = b"x" * (5 * LIMIT)  # 5 MiB against a 1 MiB limit
KEYED = ServingConfig(
    graceful_timeout_s=0.5, max_request_bytes=LIMIT, api_keys_env="NARWHAL_TEST_DOOR_KEYS"
)


def _httpx_sync(url: str, body: bytes, tries: int) -> list[int]:
    out = []
    with httpx.Client(timeout=30) as client:
        for _ in range(tries):
            try:
                out.append(client.post(url, content=body).status_code)
            except httpx.HTTPError as exc:
                out.append(-1 if "reset" in str(exc).lower() else -2)
    return out


def _httpx_async(url: str, body: bytes, tries: int) -> list[int]:
    async def run() -> list[int]:
        out = []
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(tries):
                try:
                    out.append((await client.post(url, content=body)).status_code)
                except httpx.HTTPError:
                    out.append(-1)
        return out

    return asyncio.run(run())


def _aiohttp(url: str, body: bytes, tries: int) -> list[int]:
    async def run() -> list[int]:
        out = []
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(tries):
                try:
                    async with session.post(url, data=io.BytesIO(body)) as resp:
                        await resp.read()
                        out.append(resp.status)
                except aiohttp.ClientError:
                    out.append(-1)
        # aiohttp closes a transport the server closed on a later loop pass (its docs'
        # "graceful shutdown"); without it the socket is left to the garbage collector
        await asyncio.sleep(0.1)
        return out

    return asyncio.run(run())


def _curl(url: str, body: bytes, tries: int) -> list[int]:
    out = []
    for _ in range(tries):
        done = subprocess.run(
            [
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "30",
                "--data-binary",
                "@-",
                "-H",
                "content-type: application/json",
                url,
            ],
            input=body,
            capture_output=True,
            check=False,
        )
        out.append(int(done.stdout or b"0"))
    return out


CLIENTS = {"httpx-sync": _httpx_sync, "httpx-async": _httpx_async, "aiohttp": _aiohttp}
if shutil.which("curl"):
    CLIENTS["curl"] = _curl


# aiohttp leaves a closing transport to the garbage collector when the server closes first
UNCLOSED = pytest.mark.filterwarnings("ignore:unclosed transport:ResourceWarning")


@UNCLOSED
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_413_is_read_by_every_client(door: Harness, client: str) -> None:
    """Item 5: httpx's async client read the 413 to a 5 MiB body 0 times in 8."""
    seen = await trio.to_thread.run_sync(CLIENTS[client], door.url + "/v1/completions", BIG, TRIES)
    assert seen == [413] * TRIES
    await assert_serving(door)
    await finish(door)


@UNCLOSED
@pytest.mark.parametrize("client", CLIENTS)
async def test_a_401_to_a_big_body_is_read_by_every_client(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_DOOR_KEYS", "door-key")
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=KEYED)
    seen = await trio.to_thread.run_sync(CLIENTS[client], h.url + "/v1/completions", BIG[:LIMIT], 5)
    assert seen == [401] * 5
    await finish(h)


async def test_the_openai_client_reads_a_413(door: Harness) -> None:
    client = openai.AsyncOpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0)
    async with client:
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as caught:
                await client.completions.create(model=MODEL, prompt="x" * (2 * LIMIT), max_tokens=2)
            assert caught.value.status_code == 413
    await finish(door)


# Lingering close at the connection, checked at its limits: a client that writes a body far
# bigger than the socket buffers between it and the router (so bytes are certainly unread when
# the router answers), in pieces, while reading. Closing with them unread sends a reset: the
# client's next write fails, and a client that meets the failed write before it reads reports
# the reset and never reads the answer (httpx's async client, above, before the early answers
# lingered). The router must read and drop the rest, so every run ends with the whole answer,
# then the router's end (EOF), and the client meets no reset, writing or reading.
RUNS = 50
PIECE = 16 * 1024
FLOOD = 2 * LIMIT  # 2 MiB: unsent beyond the client's small send buffer and the router's window


async def send_while_reading(h: Harness, head: bytes, body: list[bytes]) -> tuple[bytes, list[str]]:
    """Write ``head``, then each piece of ``body``, reading all the while: what the router
    answered up to its end, and each reset the client met (writing or reading)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIECE)  # the body waits on the router
    await sock.connect(address(h))
    stream = trio.SocketStream(sock)
    received = bytearray()
    resets: list[str] = []

    async def write() -> None:
        try:
            await stream.send_all(head)
            for piece in body:
                await stream.send_all(piece)
        except trio.BrokenResourceError as exc:
            resets.append(f"write, {len(received)} bytes read: {exc.__cause__!r}")

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(write)
        try:
            while chunk := await stream.receive_some(65536):
                received += chunk
        except trio.BrokenResourceError as exc:
            resets.append(f"read, {len(received)} bytes read: {exc.__cause__!r}")
    return bytes(received), resets


def h2_flood_head() -> bytes:
    """A prior-knowledge HTTP/2 preface and a POST's HEADERS announcing ``FLOOD`` bytes."""
    return h2_post(FLOOD).data_to_send()


def h2_flood_body() -> list[bytes]:
    """``FLOOD`` bytes of DATA frames on stream 1, framed by hand: a client that sends its
    body without waiting for the window (h2 itself would stop at 64 KiB)."""
    frame = DataFrame(1, data=b"x" * PIECE).serialize()
    return [frame] * (FLOOD // PIECE)


def goaway(raw: bytes) -> h2.events.ConnectionTerminated | None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    ended = [e for e in client.receive_data(raw) if isinstance(e, h2.events.ConnectionTerminated)]
    return ended[0] if ended else None


async def test_an_http2_client_flooding_a_body_reads_the_goaway_every_time(door: Harness) -> None:
    """The HTTP/2 refusal closed with the body unread: the kernel's reset destroyed the
    GOAWAY for a client still writing (1 run in 3 from outside; every run here)."""
    head, body = h2_flood_head(), h2_flood_body()
    failed = []
    with trio.fail_after(30):
        for run in range(RUNS):
            raw, resets = await send_while_reading(door, head, body)
            ended = goaway(raw)
            if (
                resets
                or ended is None
                or ended.error_code != h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
            ):
                failed.append((run, resets, raw[-60:]))
    assert not failed, f"{len(failed)} of {RUNS} runs failed; the first: {failed[0]}"
    await assert_serving(door)
    assert door.router.metrics.connection_errors._value.get() == 0
    await finish(door)


def flood_chunked() -> list[bytes]:
    """``FLOOD`` bytes of a chunked body, one chunk per piece, and its end."""
    return [b"%x\r\n" % PIECE + b"x" * PIECE + b"\r\n"] * (FLOOD // PIECE) + [b"0\r\n\r\n"]


@pytest.mark.parametrize(
    ("head", "body", "status"),
    [
        # the router answers before the body: no such path
        (
            request(b"", b"content-length: %d" % LIMIT, path=b"/no/such/path"),
            [b"x" * PIECE] * (LIMIT // PIECE),
            404,
        ),
        # the length announced is past the limit
        (request(b"", b"content-length: %d" % FLOOD), [b"x" * PIECE] * (FLOOD // PIECE), 413),
        # a chunk announced past the limit: h11's refusal, answered by the server
        (
            request(b"%x\r\n" % FLOOD, b"transfer-encoding: chunked"),
            [b"x" * PIECE] * (FLOOD // PIECE),
            413,
        ),
        # chunks whose sum passes the limit: the app's refusal
        (request(b"", b"transfer-encoding: chunked"), flood_chunked(), 413),
    ],
    ids=["404-length", "413-length", "413-chunk-announced", "413-chunks-summed"],
)
async def test_an_http11_client_flooding_a_body_reads_the_early_answer_every_time(
    door: Harness, head: bytes, body: list[bytes], status: int
) -> None:
    failed = []
    with trio.fail_after(30):
        for run in range(RUNS):
            raw, resets = await send_while_reading(door, head, body)
            if resets or statuses(raw) != [status]:
                failed.append((run, resets, raw[:60]))
    assert not failed, f"{len(failed)} of {RUNS} runs failed; the first: {failed[0]}"
    await assert_serving(door)
    await finish(door)


# ---- 8. 401 ids, WebSocket, HEAD ------------------------------------------------------------


async def test_a_401_carries_the_request_id_the_journal_records(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_DOOR_KEYS", "door-key")
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=KEYED)
    reply = await h.post("/v1/completions", COMPLETION)
    assert reply.status == 401
    assert reply.headers["www-authenticate"] == "Bearer"
    assert [line.request_id for line in h.router.journal.lines] == [reply.headers["x-request-id"]]
    reply = await h.post("/v1/completions", COMPLETION, {"x-request-id": "caller-7"})
    assert reply.headers["x-request-id"] == "caller-7"
    assert h.router.journal.lines[-1].request_id == "caller-7"
    await finish(h)


async def test_a_websocket_upgrade_gets_a_clean_400(door: Harness) -> None:
    upgrade = request(
        b"",
        b"connection: Upgrade",
        b"upgrade: websocket",
        b"sec-websocket-version: 13",
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==",
        path=b"/v1/completions",
        method=b"GET",
    )
    raw = await exchange(door, upgrade)
    assert statuses(raw) == [400]
    assert b"websocket" in raw.split(b"\r\n\r\n", 1)[1]
    await finish(door)


async def test_head_answers_like_get(door: Harness) -> None:
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        resp = await door.http.request("HEAD", door.url + path)
        assert resp.status in (200, 503), path
        assert resp.content == b""
    await finish(door)


# ---- 9. admin endpoints ---------------------------------------------------------------------


async def test_admin_endpoints_take_admin_keys_only(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_DOOR_KEYS", "client-key")
    monkeypatch.setenv("NARWHAL_TEST_DOOR_ADMIN", "admin-key")
    serving = ServingConfig(
        graceful_timeout_s=0.5,
        api_keys_env="NARWHAL_TEST_DOOR_KEYS",
        admin_keys_env="NARWHAL_TEST_DOOR_ADMIN",
    )
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=serving)
    for key in (None, "client-key", "wrong"):
        headers = [("authorization", f"Bearer {key}")] if key else []
        for method, path in (
            ("GET", "/narwhal/engines"),
            ("POST", "/narwhal/reload"),
            ("POST", "/narwhal/lifecycle/readmit"),
        ):
            resp = await h.http.request(method, h.url + path, headers=headers)
            assert resp.status == 403, (key, path)
    assert engine_legs(h) == 0  # a readmit wave runs real generation legs
    admin = [("authorization", "Bearer admin-key")]
    resp = await h.http.request("GET", h.url + "/narwhal/engines", headers=admin)
    assert resp.status == 200
    for open_path in ("/health", "/ready", "/metrics"):
        assert (await h.get(open_path)).status == 200
    await finish(h)


def test_without_admin_keys_only_loopback_peers_are_admitted() -> None:
    app = RouterApp.__new__(RouterApp)
    app.router = type("R", (), {"admin_keys": type("K", (), {"required": False})()})()  # type: ignore[assignment]
    for peer in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"):
        assert app._admin_refusal({"client": (peer, 1234), "headers": []}) is None
    for peer in ("10.0.0.7", "192.168.1.2", "2001:db8::1", "::ffff:10.0.0.1"):
        assert app._admin_refusal({"client": (peer, 1234), "headers": []}) is not None
    assert app._admin_refusal({"client": None, "headers": []}) is not None


# ---- 11. client request ids -----------------------------------------------------------------


async def test_a_well_formed_client_request_id_is_adopted_and_sent_to_engines(
    door: Harness,
) -> None:
    reply = await door.post("/v1/completions", COMPLETION, {"x-request-id": "trace-A.1:b_c-9"})
    assert reply.status == 200
    assert reply.headers["x-request-id"] == "trace-A.1:b_c-9"
    seen = [e["request_id"] for e in door.engines["p0"].log] + [
        e["request_id"] for e in door.engines["d0"].log
    ]
    assert seen == ["trace-A.1:b_c-9-a1-prefill", "trace-A.1:b_c-9-a1-decode"]
    for bad in ("", "x" * 129, "has space", "semi;colon", "a/b"):
        reply = await door.post("/v1/completions", COMPLETION, {"x-request-id": bad})
        assert reply.status == 200
        rid = reply.headers["x-request-id"]
        assert rid != bad
        assert len(rid) == 16
    await finish(door)


# ---- the property: malformed HTTP/1.1 never gets a 5xx, never ends the router --------------


@dataclass
class LiveRouter:
    """A router over fake engines on its own trio loop, in a thread of its own, so that a
    synchronous hypothesis test can drive it with blocking sockets."""

    harness: Harness
    token: trio.lowlevel.TrioToken
    thread: threading.Thread
    crashed: list[BaseException]


@pytest.fixture(scope="module")
def live_router() -> Iterator[LiveRouter]:
    ready: queue.Queue[tuple[Harness, trio.lowlevel.TrioToken]] = queue.Queue()
    crashed: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            h = await start_fleet(
                nursery,
                {"p0": "prefill", "d0": "decode"},
                serving=FUZZED,
                engine=EngineConfig(first_token_timeout_s=10.0),  # a busy machine is no fault
            )
            ready.put((h, trio.lowlevel.current_trio_token()))
            await h.stopped.wait()
            await h.http.aclose()
            nursery.cancel_scope.cancel()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported by the test, not lost in the thread
            crashed.append(exc)

    thread = threading.Thread(target=run, name="live-router", daemon=True)
    thread.start()
    harness, token = ready.get(timeout=30)
    live = LiveRouter(harness, token, thread, crashed)
    yield live
    trio.from_thread.run_sync(harness.stop.set, trio_token=token)
    thread.join(timeout=10)
    assert not crashed, crashed


FUZZED = ServingConfig(
    graceful_timeout_s=0.5,
    client_idle_timeout_s=5.0,
    client_body_timeout_s=1.0,
    max_request_bytes=4096,
)
_METHODS = [b"GET", b"POST", b"HEAD", b"PUT", b"PRI", b"CONNECT", b"G ET", b"", b"\x00"]
_TARGETS = [b"/v1/completions", b"/v1/chat/completions", b"/health", b"/narwhal/reload", b"*"]
_VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"HTTP/0.9", b"", b"http/1.1"]
_NAMES = [
    b"content-length",
    b"transfer-encoding",
    b"host",
    b"connection",
    b"expect",
    b"upgrade",
    b"x-request-id",
    b"authorization",
    b"content-type",
    b"Transfer-Encoding ",
    b" content-length",
]
_VALUES = [
    b"0",
    b"5",
    b"-1",
    b"99999999999999999999999",
    b"5, 5",
    b"chunked",
    b"gzip, chunked",
    b"chunked, gzip",
    b"identity",
    b"close",
    b"keep-alive",
    b"100-continue",
    b"websocket",
    b"h2c",
    b"application/json",
    b"",
]
_EOL = st.sampled_from([b"\r\n", b"\n", b"\r"])


@st.composite
def malformed_requests(draw: st.DrawFn) -> bytes:
    eol = draw(_EOL)
    line = b" ".join(
        [
            draw(st.sampled_from(_METHODS) | st.binary(max_size=8)),
            draw(st.sampled_from(_TARGETS) | st.binary(max_size=16)),
            draw(st.sampled_from(_VERSIONS) | st.binary(max_size=10)),
        ]
    )
    headers = draw(
        st.lists(
            st.tuples(
                st.sampled_from(_NAMES) | st.binary(max_size=12),
                st.sampled_from(_VALUES) | st.binary(max_size=24),
            ),
            max_size=8,
        )
    )
    head = eol.join(
        [line, *(n + b":" + draw(st.sampled_from([b" ", b"", b"\t"])) + v for n, v in headers)]
    )
    body = draw(
        st.sampled_from([b"", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\n", COMPLETION])
        | st.binary(max_size=64)
    )
    return head + eol + eol + body


def _statuses_from(sock: socket.socket) -> list[int]:
    """Every status the router wrote before it closed, or went quiet for a moment."""
    sock.settimeout(0.2)
    raw = b""
    try:
        while chunk := sock.recv(65536):
            raw += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return statuses(raw)


@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=malformed_requests())
@example(data=b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
@example(data=b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999999999999999\r\n\r\n")
@example(data=b"POST /v1/completions HTTP/1.1\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n")
@example(data=b"GET /health HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 3\r\n\r\nabc")
@example(data=b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64)
def test_malformed_http11_gets_4xx_or_a_close_and_never_ends_the_router(
    live_router: LiveRouter, data: bytes
) -> None:
    """Item 13's property: whatever a request head and body hold, the answer is 4xx (or 2xx
    for what happens to be well formed) or a close, never a 5xx, and the router goes on."""
    h = live_router.harness
    with socket.create_connection(address(h), timeout=5) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        seen = _statuses_from(sock)
    assert all(status < 500 for status in seen), (seen, data)
    assert live_router.thread.is_alive()
    assert not live_router.crashed
    with socket.create_connection(address(h), timeout=5) as sock:
        sock.sendall(
            request(COMPLETION, b"content-length: %d" % len(COMPLETION), b"connection: close")
        )
        sock.settimeout(10)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    assert statuses(raw) == [200], raw[:300]
