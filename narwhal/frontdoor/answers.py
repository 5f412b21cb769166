"""The ASGI side of the front door: the sink a request's output goes to (``AsgiSink``),
the answers given before or instead of the app's work (early answers, lingering close,
refusals), and a request body read within its limits and its time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from typing import Any

import trio

from narwhal.core.config import ServingConfig
from narwhal.core.faults import (
    BadRequest,
    BodyTimeout,
    HeadersTooLarge,
    Phase,
    RequestFault,
    TooLarge,
)
from narwhal.frontdoor.direct import DirectBody
from narwhal.frontdoor.linger import discard

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_TYPE = b"application/json"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
RETRY_AFTER_S = b"1"
# More header fields, or header bytes, than any OpenAI client sends. Hypercorn's h11 buffer
# limit only catches a header block still incomplete past 64 KiB, so a bigger block that
# arrives in two reads gets through; and it has no bound on the number of fields.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024
DISCARD_LIMIT = 64 * 1024  # the most of an unused body read to keep its connection
DISCARD_TIMEOUT_S = 1.0


class Disconnected(Exception):
    """The client went away before its request was read."""


class AsgiSink:
    """Client output for one request (where the response stands is the request's lifecycle).

    Under the front door (``DirectBody``, from the scope's extensions), the head goes out
    with the first chunk and the last chunk with the end, in one write each, and ``direct``
    is the write without the ASGI layers that the token path uses."""

    __slots__ = ("_direct", "_send", "rid")

    def __init__(self, send: Send, rid: bytes, direct: DirectBody | None = None) -> None:
        self._send = send
        self.rid = rid
        self._direct = direct

    async def commit(self, data: bytes) -> None:
        headers = [*_SSE_HEADERS, (b"x-request-id", self.rid)]
        await self._corked(
            {"type": "http.response.start", "status": 200, "headers": headers},
            {"type": "http.response.body", "body": data, "more_body": True},
        )

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    @property
    def direct(self) -> DirectBody | None:
        """The write to the connection without waiting (the router's per-token path)."""
        return self._direct

    async def end(self, data: bytes = b"") -> None:
        await self._corked({"type": "http.response.body", "body": data, "more_body": False})

    async def cut(self, data: bytes, *, abandon: bool = False) -> None:
        """``data`` (the terminal event), then the body is cut: the response is never
        ended, so the connection closes without the chunked body's last chunk (contract 6) and
        a client that ignores error events still sees a failed transfer. ``abandon`` (the
        deadline or the drain gave up): the client is not waited for; what it has not taken
        is dropped with a reset (invariant 10)."""
        direct = self._direct
        if direct is None:
            await self.send(data)  # another server: the app's return without an end cuts it
            return
        done = direct.write_nowait(data) if abandon else None
        if done is False:  # the client is behind: nothing more is written to it
            direct.give_up()
            return
        if done is None:  # the ASGI path (bounded by the request's caller)
            await self.send(data)
        direct.cut(abandon=abandon)

    async def respond_json(self, status: int, body: bytes) -> None:
        headers = _json_headers(status, body, self.rid)
        await self._corked(
            {"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body},
        )

    def delivered(self) -> bool:
        """False once a write to the connection broke (the client reset or closed it): what
        was written since did not reach the client whole. The server swallows such a
        failure, so only the connection can tell. Off hypercorn's HTTP/1.1 stream a broken
        write raises instead, and this is True."""
        direct = self._direct
        return direct is None or direct.delivered()

    async def _corked(self, *messages: Message) -> None:
        """The messages through the ASGI send, their writes in one: the connection only
        collects the bytes until ``uncork``. The end's path has one checkpoint (hypercorn
        tells the app's receive of the disconnect) after the last bytes are collected: an
        exception there still sends them, as it would have uncorked."""
        direct = self._direct
        if direct is None:
            for message in messages:
                await self._send(message)
            return
        direct.cork()
        try:
            for message in messages:
                await self._send(message)
        except BaseException:
            direct.uncork_nowait()
            raise
        await direct.uncork()


def _json_headers(
    status: int,
    body: bytes,
    rid: bytes | None,
    extra: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = JSON_TYPE,
) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *extra]
    if rid is not None:
        headers.append((b"x-request-id", rid))
    if status in (429, 503):
        headers.append((b"retry-after", RETRY_AFTER_S))
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


async def respond(
    send: Send, status: int, body: bytes, rid: bytes | None = None, content_type: bytes = JSON_TYPE
) -> None:
    headers = _json_headers(status, body, rid, content_type=content_type)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def respond_and_close(
    receive: Receive,
    send: Send,
    status: int,
    body: bytes,
    rid: bytes | None = None,
    *,
    linger: bool = True,
    content_type: bytes = JSON_TYPE,
) -> None:
    """Answer with ``connection: close`` while the body may still be arriving, then linger.

    The whole answer goes out at once; the end of the response, which makes the server close
    the connection, waits until the client's body is read and dropped through ``receive``
    (within the bounds of ``narwhal.frontdoor.linger``). Closing with unread bytes in the
    socket would send a reset, and a client still writing its body then loses the answer
    unread (httpx's async client, aiohttp). The body is read here, by the app, so that the
    request ends with its body read under any server: a server's read loop that finds the
    request's receive queue full waits for room (hypercorn's, and the front door's), and
    nothing empties it once the app has returned. The front door's close lingers on
    whatever is left after (``narwhal.frontdoor.connection``).
    After a framing error h11 never parses a byte of this connection as a new request.
    A body that trickles in too slowly (408) is not waited for here: ``linger=False``.
    """
    headers = _json_headers(status, body, rid, ((b"connection", b"close"),), content_type)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": linger})
    if linger:
        await _linger(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _linger(receive: Receive) -> None:
    """The rest of the body, read and dropped within the lingering bounds
    (``narwhal.frontdoor.linger``)."""

    async def read() -> int | None:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return None  # the body's end, or the client's
        return len(message.get("body", b""))

    await discard(read)


async def refuse_websocket(receive: Receive, send: Send) -> None:
    """A WebSocket upgrade gets a plain 400 (hypercorn's ``websocket.http.response``)."""
    await receive()  # websocket.connect
    status, body = BadRequest("websocket: not served here; the API is plain HTTP").answer()
    headers = _json_headers(status, body, None, ((b"connection", b"close"),))
    await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def answer_unread(
    scope: Scope, receive: Receive, send: Send, status: int, body: bytes, rid: bytes | None = None
) -> None:
    """An answer that uses no body: a small one is read first so the connection is kept."""
    complete = await finish_reading(scope, receive)
    await answer_read(receive, send, status, body, rid, complete)


async def answer_read(
    receive: Receive,
    send: Send,
    status: int,
    body: bytes,
    rid: bytes | None,
    complete: bool,
    content_type: bytes = JSON_TYPE,
) -> None:
    """Keep the connection when the body was read to its end, else close it, lingering."""
    if complete:
        await respond(send, status, body, rid, content_type)
    else:
        await respond_and_close(receive, send, status, body, rid, content_type=content_type)


def headers_problem(headers: list[tuple[bytes, bytes]]) -> HeadersTooLarge | None:
    if len(headers) > MAX_HEADERS:
        message = f"request has {len(headers)} header fields; at most {MAX_HEADERS}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        message = f"request headers hold {size} bytes; at most {MAX_HEADER_BYTES}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    return None


async def finish_reading(scope: Scope, receive: Receive) -> bool:
    """Read (and drop) a small body we answer without using, so the client's kept-alive
    connection can carry its next request: hypercorn closes a connection whose request was
    not read to its end when the answer is, and our writes do not wait for its read loop
    to catch up. False when a bigger or slower body is still arriving (the answer then
    closes the connection, lingering)."""
    with trio.move_on_after(DISCARD_TIMEOUT_S), suppress(Disconnected, RequestFault):
        await read_body(scope, receive, DISCARD_LIMIT)
        return True
    return False


def framing_problem(headers: list[tuple[bytes, bytes]]) -> BadRequest | None:
    """RFC 9112 6.1: a request with both lengths is a smuggling shape; refuse it rather than
    pick a framing, and close the connection (``respond_and_close``)."""
    names = {name for name, _ in headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        return BadRequest(
            "transfer-encoding: not allowed together with content-length", "transfer-encoding"
        )
    return None


def body_too_slow(serving: ServingConfig) -> BodyTimeout:
    """408: the body trickled in slower than ``client_body_timeout_s``."""
    return BodyTimeout(
        f"request body not received within client_body_timeout_s="
        f"{serving.client_body_timeout_s:g}s",
        phase=Phase.ADMISSION,
    )


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """At most ``limit`` bytes plus one received chunk are read before a 413."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise BadRequest("content-length: not a number", "content-length")
            if int(value) > limit:
                raise TooLarge(
                    f"body of {int(value)} bytes exceeds max_request_bytes={limit}",
                    phase=Phase.ADMISSION,
                )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds max_request_bytes={limit}", phase=Phase.ADMISSION)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
