"""A request's direct write to its client connection, offered to the app as an ASGI
extension (``scope["extensions"][DIRECT_BODY]``, set by ``http11.Http11Protocol``).

Each chunk of a streamed response went ASGI ``send`` -> ``HTTPStream.app_send`` (checks, a
``Body`` event) -> ``H11Protocol.stream_send`` (an isinstance chain) -> h11 (its state
machine, then its chunked writer) -> ``protocol_send``. When h11 has agreed chunked framing
and is in the middle of the body, a chunk is ``size CRLF data CRLF`` whatever came before,
and h11's state does not change with it; ``DirectBody`` writes exactly those bytes: through
the app's ``send`` (``framing_send``, in place of hypercorn's four layers) and, for the
relay's per-token path, to the connection itself without waiting (``write_nowait``). It
corks the connection so that a response's head goes out with its first chunk and its last
chunk with the end. Start, end (h11 writes the last chunk), HEAD, 204/304 and anything else
keep hypercorn's path. The framing and the checks it reproduces are checked at start with
the rest of ``narwhal.frontdoor.seams``. ``docs/upstream.md`` writes it up as an upstream
report, ``bench/results/server-fixes.md`` has the figures.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import h11
from hypercorn.events import RawData
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from narwhal.frontdoor.seams import writes_chunks

# the ASGI extensions the front door offers the app (scope["extensions"])
DIRECT_BODY = "narwhal.direct_body"  # a DirectBody
ON_DISCONNECT = "narwhal.on_disconnect"  # register(callback): called once, when the stream closes


class Connection(Protocol):
    """The writes of ``narwhal.frontdoor.connection.ClientConnection`` that ``DirectBody``
    uses."""

    aborted: bool  # the connection closed it: a write was cut
    write_failed: bool  # a write broke (reset, closed): later bytes never arrive

    def write_nowait(self, data: bytes) -> bool: ...
    async def write_rest(self) -> None: ...
    def cork(self) -> None: ...
    async def uncork(self) -> None: ...
    def uncork_nowait(self) -> None: ...
    def give_up(self) -> None: ...
    def cut(self, *, abandon: bool) -> None: ...


class DirectBody:
    """The client connection under one request's HTTP/1.1 stream (``DIRECT_BODY``; absent
    under another server, or a test's)."""

    __slots__ = ("_chunked", "_conn", "_h11", "_stream")

    def __init__(self, stream: HTTPStream, h11_conn: Any, conn: Connection) -> None:
        self._stream = stream
        self._h11 = h11_conn
        self._conn = conn
        # whether the response's body goes out in chunks: known once its head is sent, and
        # the same until its end (asked of h11 once, not on every token)
        self._chunked: bool | None = None

    def framing_send(
        self,
        send: Callable[[Any], Awaitable[None]],
        protocol_send: Callable[[Any], Awaitable[None]],
    ) -> Callable[[Any], Awaitable[None]]:
        """The app's ASGI ``send``: a body chunk in the middle of a chunked body goes to the
        connection framed (``protocol_send``); anything else through hypercorn's ``send``."""
        framed = self._framed

        async def app_send(message: Any) -> None:
            if message is not None and message["type"] == "http.response.body":
                body = message.get("body", b"")
                if message.get("more_body", False) and type(body) is bytes:
                    chunk = framed(body)
                    if chunk is not None:
                        await protocol_send(RawData(data=chunk))
                        return
            await send(message)

        return app_send

    def _framed(self, body: bytes) -> bytes | None:
        """``body`` as one chunk, as h11 would frame it, when the response is streaming a
        chunked body; None otherwise (HEAD, 204 and 304 have no chunked writer)."""
        h = self._h11
        if body and self._stream.state is ASGIHTTPState.RESPONSE and h.our_state is h11.SEND_BODY:
            chunked = self._chunked
            if chunked is None:
                chunked = self._chunked = writes_chunks(h)
            if chunked:
                return b"%x\r\n%s\r\n" % (len(body), body)
        return None

    def write_nowait(self, body: bytes) -> bool | None:
        """One body chunk, framed as h11 would, straight to the connection when the
        response is streaming a chunked body (the checks of ``app_send`` above); True: it
        all went out. False: ``write_rest`` writes the rest. None: not now, nothing
        written: the caller uses the ASGI ``send``."""
        chunk = self._framed(body)
        return None if chunk is None else self._conn.write_nowait(chunk)

    async def write_rest(self) -> None:
        await self._conn.write_rest()

    def delivered(self) -> bool:
        """False once a write to the client failed or was abandoned (``ClientConnection``
        swallows the error and closes the stream)."""
        conn = self._conn
        return not (conn.aborted or conn.write_failed)

    def cork(self) -> None:
        self._conn.cork()

    async def uncork(self) -> None:
        await self._conn.uncork()

    def uncork_nowait(self) -> None:
        self._conn.uncork_nowait()

    def give_up(self) -> None:
        self._conn.give_up()

    def cut(self, *, abandon: bool) -> None:
        self._conn.cut(abandon=abandon)
