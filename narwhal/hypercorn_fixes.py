"""One change to hypercorn's trio worker (0.18, with h11 0.16): a streamed body chunk is
framed here, not through four layers. ``narwhal.server.install_server_fixes`` applies it
explicitly at start, after ``narwhal.shapes`` has verified that every function it replaces
or copies is the one it was written against (``SHAPES``); hypercorn and h11 are pinned in
pyproject.toml. The connection handler's own changes live in ``narwhal.client_connection``
(a subclass), the accept loop's in ``narwhal.trio_accept``; ``docs/upstream.md`` writes
each up as an upstream bug report, ``bench/results/server-fixes.md`` has their figures.

Each chunk of a streamed response went ASGI ``send`` -> ``HTTPStream.app_send`` (checks, a
``Body`` event) -> ``H11Protocol.stream_send`` (an isinstance chain) -> h11 (its state
machine, then its chunked writer) -> ``protocol_send``. When h11 has agreed chunked framing
and is in the middle of the body, a chunk is ``size CRLF data CRLF`` whatever came before,
and h11's state does not change with it; the patched ``app_send`` writes exactly those
bytes to ``protocol_send``. Start, end (h11 writes the last chunk), HEAD, 204/304 and
anything else keep hypercorn's path.

``DirectBody`` goes one step further for the relay (issue 19): found from the ASGI ``send``
once per request, it writes each chunk of a streamed response to the connection itself
(``ClientConnection.write_nowait``), after the same checks, and corks the connection so
that the head goes out with the first chunk and the last chunk with the end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import h11
from h11._writers import ChunkedWriter
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from narwhal.client_connection import ON_DISCONNECT, ClientConnection, Http11Protocol

PATCHED = "_narwhal_patched"  # marks a method already replaced (apply twice, patch once)
ORIGINAL = "__narwhal_original__"  # on a replacement: what it replaced (narwhal.shapes reads it)
# what frame_body_chunks_directly replaces, and the framing it reproduces
SHAPES = {
    "hypercorn.protocol.http_stream:HTTPStream.app_send": "6371d58b7f58ae8d",
    "h11._writers:ChunkedWriter.send_data": "a526bf1ca03da915",
}


def frame_body_chunks_directly() -> None:
    original: Callable[[Any, Any], Awaitable[None]] = HTTPStream.app_send
    if getattr(original, PATCHED, False):
        return
    streaming = ASGIHTTPState.RESPONSE

    async def app_send(self: Any, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.body"
            and message.get("more_body", False)
            and self.state is streaming
        ):
            body = message.get("body", b"")
            protocol = getattr(self.send, "__self__", None)
            if body and type(body) is bytes and isinstance(protocol, H11Protocol):
                conn = protocol.connection
                # chunked framing agreed and the body under way (HEAD, 204 and 304 have
                # no chunked writer): the chunk is the same bytes h11 would write
                if conn.our_state is h11.SEND_BODY and type(conn._writer) is ChunkedWriter:
                    await protocol.send(RawData(data=b"%x\r\n%s\r\n" % (len(body), body)))
                    return
        await original(self, message)

    setattr(app_send, PATCHED, True)
    setattr(app_send, ORIGINAL, original)
    HTTPStream.app_send = app_send  # type: ignore[method-assign]


class DirectBody:
    """The client connection under one request's ASGI ``send`` (None from ``of`` when that
    is not hypercorn's HTTP/1.1 stream on a ``ClientConnection``: tests, other servers)."""

    __slots__ = ("_conn", "_h11", "_stream")

    def __init__(self, stream: HTTPStream, h11_conn: Any, conn: ClientConnection) -> None:
        self._stream = stream
        self._h11 = h11_conn
        self._conn = conn

    @classmethod
    def of(cls, send: Callable[..., Awaitable[None]]) -> DirectBody | None:
        stream = getattr(send, "__self__", None)
        if not isinstance(stream, HTTPStream):
            return None
        protocol = getattr(stream.send, "__self__", None)
        if not isinstance(protocol, H11Protocol):
            return None
        conn = getattr(protocol.send, "__self__", None)
        if not isinstance(conn, ClientConnection):
            return None
        return cls(stream, protocol.connection, conn)

    def write_nowait(self, body: bytes) -> bool | None:
        """One body chunk, framed as h11 would, straight to the connection when the
        response is streaming a chunked body (the checks of ``app_send`` above); True: it
        all went out. False: ``write_rest`` writes the rest. None: not now, nothing
        written: the caller uses the ASGI ``send``."""
        h = self._h11
        if (
            body
            and self._stream.state is ASGIHTTPState.RESPONSE
            and h.our_state is h11.SEND_BODY
            and type(h._writer) is ChunkedWriter
        ):
            return self._conn.write_nowait(b"%x\r\n%s\r\n" % (len(body), body))
        return None

    async def write_rest(self) -> None:
        await self._conn.write_rest()

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


def disconnect_hook(
    send: Callable[..., Awaitable[None]], scope: MutableMapping[str, Any]
) -> Callable[[Callable[[], None]], None] | None:
    """For ``Router.handle``'s ``on_disconnect``: registers a callback that
    ``Http11Protocol._close_stream`` calls when this request's stream closes (at once
    when it has closed already). None off hypercorn's HTTP/1.1 stream (a watcher task
    reads ``http.disconnect`` then)."""
    stream = getattr(send, "__self__", None)
    if not isinstance(stream, HTTPStream):
        return None
    if not isinstance(getattr(stream.send, "__self__", None), Http11Protocol):
        return None

    def register(callback: Callable[[], None]) -> None:
        if stream.closed:
            callback()
        else:
            scope[ON_DISCONNECT] = callback

    return register
