"""A small trio + h11 HTTP/1.1 server loop for the fake engine.

The fake engine is a measuring instrument beside the router on two cores, and its faults
need byte-level control (a close before ``[DONE]``, headers then silence), so it speaks h11
directly instead of going through an ASGI server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import h11
import trio

MAX_BODY = 64 * 1024 * 1024


class Request:
    __slots__ = ("body", "headers", "method", "path")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.body = body


class Exchange:
    """One request/response cycle on a connection: the handler writes through it."""

    def __init__(self, conn: h11.Connection, stream: trio.abc.Stream) -> None:
        self.conn = conn
        self.stream = stream
        self.disconnected = False

    async def send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def respond(
        self, status: int, body: bytes, content_type: bytes = b"application/json"
    ) -> None:
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        await self.send(h11.Response(status_code=status, headers=headers))
        if body:
            await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def respond_partial(self, status: int, body: bytes) -> None:
        """Announce the whole body, send half of it, and drop the connection."""
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self.send(h11.Response(status_code=status, headers=headers))
        await self.send(h11.Data(data=body[: len(body) // 2]))
        await self.abort()

    async def start_stream(self) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await self.send(h11.Response(status_code=200, headers=headers))

    async def write(self, data: bytes) -> None:
        await self.send(h11.Data(data=data))

    async def end_stream(self) -> None:
        await self.send(h11.EndOfMessage())

    async def abort(self) -> None:
        """Close the connection mid-response, as an engine that died would."""
        self.conn = h11.Connection(h11.SERVER)  # forget the half-sent response
        await self.stream.aclose()
        self.disconnected = True

    async def watch_disconnect(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client goes away (EOF) while we are answering."""
        try:
            while True:
                data = await self.stream.receive_some(65536)
                if not data:
                    break
                self.conn.receive_data(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        self.disconnected = True
        scope.cancel()


Handler = Callable[[Request, Exchange], Awaitable[None]]


async def serve_connection(stream: trio.abc.Stream, handler: Handler) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            request = await _read_request(conn, stream)
            if request is None:
                return
            exchange = Exchange(conn, stream)
            await handler(request, exchange)
            if exchange.disconnected or conn.our_state is not h11.DONE:
                return
            if conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        return
    finally:
        with trio.move_on_after(1) as cleanup:
            cleanup.shield = True
            await stream.aclose()


async def _read_request(conn: h11.Connection, stream: trio.abc.Stream) -> Request | None:
    head: h11.Request | None = None
    parts: list[bytes] = []
    size = 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(bytes(data))
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_BODY:
                return None
            parts.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
            path = head.target.decode("latin-1")
            return Request(head.method.decode(), path, headers, b"".join(parts))
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None
