"""Hypercorn's HTTP/1.1 protocol as the front door runs it (``Http11Protocol``, over the
hooks of ``narwhal.frontdoor.seams``): its h11 connection of our own, its pipeline watch,
the app called with the extensions of ``narwhal.frontdoor.direct``, and HTTP/2 refused
(``Http11Only``); with the request id and the scope keys it shares with the app. The
client connection under it is ``narwhal.frontdoor.connection``, whose docstring gives the
front door's rules: the second (HTTP/1.1 only: ``Http11Only``) and the fifth (a client
that pipelined a request and left is seen at once: ``PipelineWatch``) are kept here. So is
what h11 refuses or leaves out (``_Http11Connection``): bytes after ``Connection: close``
are ignored, a chunk announced past the body limit is refused when announced, and every
status line carries its reason phrase.
"""

from __future__ import annotations

import re
import secrets
import select
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from functools import cache, partial
from http import HTTPStatus
from typing import Any, Protocol

import h2.config
import h2.connection
import h2.errors
import h11
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.http_stream import HTTPStream

from narwhal.core.faults import FramingError
from narwhal.frontdoor.direct import DIRECT_BODY, ON_DISCONNECT, Connection, DirectBody
from narwhal.frontdoor.seams import H11Hooks, announced_chunk_rest, with_reason

# scope keys shared with the app (the router's): the request id it gave the request,
# and the framing error that ended the request's body
REQUEST_ID = "narwhal.request_id"
FRAMING_ERROR = "narwhal.framing_error"
FRAMING_STATUS = "narwhal.framing_status"  # the status that answered it (400, 413)


_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


def request_id(scope: MutableMapping[str, Any]) -> bytes:
    """The client's ``x-request-id`` when well formed (contract 3), else a fresh one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _REQUEST_ID.fullmatch(value):
            return bytes(value)
    return secrets.token_hex(8).encode()


class PriorKnowledgeHTTP2(Exception):
    """The client opened with the HTTP/2 connection preface."""


def _http2_refusal() -> bytes:
    """A server preface and a GOAWAY saying HTTP/1.1 is required, as HTTP/2 frames."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    conn.initiate_connection()
    conn.close_connection(
        error_code=h2.errors.ErrorCodes.HTTP_1_1_REQUIRED,
        additional_data=b"HTTP/2 is not served here; use HTTP/1.1",
    )
    return conn.data_to_send()


HTTP2_REFUSAL = _http2_refusal()


class AppHooks(Protocol):
    """What the connection asks of the app it serves (the router's), handed to it by the
    serve loop (``narwhal.frontdoor.server``)."""

    def max_request_bytes(self) -> int | None: ...
    def connection_failed(self) -> None: ...


@cache
def reason_phrase(status: int) -> bytes:
    """The standard reason phrase of ``status`` (b"" for a code the standard lacks)."""
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


class _Http11Connection(h11.Connection):
    """h11 that ignores what a client sends after a request that said ``Connection:
    close`` (RFC 9112 §9.6), where h11 raises on it and hypercorn then answers the request
    it is already serving with a 400. What is ignored is never buffered; the end of the
    stream is still told, so a client that leaves still cancels its request.

    Every status line it writes carries its standard reason phrase (contract 3): hypercorn
    gives h11 none, and clients print it (``HTTP/1.1 502 Bad Gateway``, not ``502 ``)."""

    _eof = False
    _body_read = 0  # the request body's bytes h11 has handed out so far
    # the router's serving.max_request_bytes (None: no limit here), read when a chunk of
    # the request body is announced and its bytes are awaited
    body_limit: Callable[[], int | None] = staticmethod(lambda: None)
    refusal = ""  # why ``next_event`` refused the body, for the answer's message
    _both_lengths = False  # the request's head had Content-Length and Transfer-Encoding

    def send_with_data_passthrough(self, event: Any) -> list[bytes] | None:
        kind = type(event)
        if (kind is h11.Response or kind is h11.InformationalResponse) and not event.reason:
            event = with_reason(event, reason_phrase(event.status_code))
        return super().send_with_data_passthrough(event)

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
        elif self.their_state is h11.MUST_CLOSE:
            return
        super().receive_data(data)

    def next_event(self) -> Any:
        if self.their_state is h11.MUST_CLOSE:
            return h11.ConnectionClosed() if self._eof else h11.NEED_DATA
        in_body = self.their_state is h11.SEND_BODY
        try:
            event = super().next_event()
        except h11.RemoteProtocolError:
            if in_body and not self.refusal:
                raise self._body_broke() from None
            raise
        kind = type(event)
        if kind is h11.Data:
            self._body_read += len(event.data)  # type: ignore[union-attr]
        elif kind is h11.Request:
            self._body_read = 0
            # its raw items: a ``Headers`` iterated as a sequence costs a call per field
            names = {raw.lower() for raw, _ in event.headers.raw_items()}  # type: ignore[union-attr]
            self._both_lengths = {b"content-length", b"transfer-encoding"} <= names
        elif event is h11.NEED_DATA and self.their_state is h11.SEND_BODY:
            self._refuse_a_chunk_too_large()
        return event

    def _body_broke(self) -> h11.RemoteProtocolError:
        """The head was good and its body's framing is not: a 400 that says so. h11 hints
        431 (its buffer full) for a chunk-size line that never ends, when the bytes after
        the head came with it; that is the body's framing, not the head's size. A head with
        both lengths is named as the app names it when the body is not there yet."""
        if self._both_lengths:
            self.refusal = "transfer-encoding: not allowed together with content-length"
        else:
            self.refusal = "transfer-encoding: malformed chunked body"
        return h11.RemoteProtocolError(self.refusal, error_status_hint=400)

    def _refuse_a_chunk_too_large(self) -> None:
        """A chunk announced larger than the body may be is refused (413) when announced:
        waiting for its bytes would hold the connection until the body timeout, and end in
        a 408 that blames the client's speed, not its size."""
        rest = announced_chunk_rest(self)
        if rest is None:
            return
        announced = self._body_read + rest  # read, and the chunk's rest
        limit = self.body_limit()
        # past the limit already read, the app has the bytes that exceed it, and answers
        if limit is not None and self._body_read <= limit < announced:
            self.refusal = (
                f"body exceeds max_request_bytes={limit}: {announced} bytes announced so far"
            )
            raise h11.RemoteProtocolError(self.refusal, error_status_hint=413)


class ClientGone(Exception):
    """The client closed (or reset) its connection while hypercorn held a pipelined
    request back (``PipelineWatch``)."""


class PipelineWatch:
    """Hypercorn's ``can_read`` event, which it waits on while a request that the client
    pipelined behind the one being served sits in h11's buffer: it stops reading then, so
    a client that closes is not seen until the response ends (an hour-long stream served
    to nobody). Here the wait also watches the socket for the client's end: its close or
    half-close (``EPOLLRDHUP``) or a reset (``EPOLLHUP``, ``EPOLLERR``) raises
    ``ClientGone`` to the read loop, which tells the app at once as any close (invariant
    7). Bytes the client sends meanwhile are not read (hypercorn reads them when it
    resumes), and do not hide a close that follows them. Under TLS the TCP socket beneath
    is watched. The router's own close of the socket (``close``) ends the wait too."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self._socket: trio.socket.SocketType | None = None
        self._watching: trio.CancelScope | None = None
        self._closed = False

    def watch(self, socket: trio.socket.SocketType) -> None:
        self._socket = socket

    def close(self) -> None:
        """The router closed the socket (``ClientConnection._abort``)."""
        self._closed = True
        if self._watching is not None:
            self._watching.cancel()

    async def clear(self) -> None:
        await self._event.clear()

    async def set(self) -> None:
        await self._event.set()
        if self._watching is not None:
            self._watching.cancel()  # the response ended: hypercorn reads again

    def is_set(self) -> bool:
        return bool(self._event.is_set())

    async def wait(self) -> None:
        if self._socket is not None and not self._event.is_set():
            await self._until_hangup(self._socket)
        await self._event.wait()

    async def _until_hangup(self, socket: trio.socket.SocketType) -> None:
        """Return when ``set`` is called; raise ``ClientGone`` if the client's end (or the
        router's close) comes first."""
        fd = socket.fileno()
        if self._closed or fd < 0:
            raise ClientGone
        with select.epoll() as hangup:  # the end only: EPOLLIN would see every byte sent
            hangup.register(fd, select.EPOLLRDHUP)  # EPOLLHUP and EPOLLERR always count
            try:
                with trio.CancelScope() as self._watching:
                    await trio.lowlevel.wait_readable(hangup.fileno())
                    raise ClientGone
            finally:
                self._watching = None
        if self._closed:
            raise ClientGone


class Http11Protocol(H11Hooks):
    """Hypercorn's HTTP/1.1 protocol with the front door's h11 (``_Http11Connection``), its
    pipeline watch, and the app called with the extensions ``narwhal.frontdoor.direct``
    names: the direct write and the disconnect hook of the request's stream. Hypercorn's
    private hooks are reached through ``H11Hooks`` (``narwhal.frontdoor.seams``)."""

    def __init__(
        self, *args: Any, client: Connection, hooks: AppHooks | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _Http11Connection(
            h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
        )
        if hooks is not None:
            self.connection.body_limit = hooks.max_request_bytes
        self.can_read = self.watch = PipelineWatch(self.can_read)
        self._client = client
        self._app: Any = self.app  # the ASGI app itself (``narwhal.frontdoor.server.serve``'s)
        self.app = self.call_app  # what hypercorn's HTTPStream calls for each request
        # the stream whose app asked to hear of its close, and the callback
        self._on_close: tuple[Any, Callable[[], None]] | None = None

    def call_app(
        self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any
    ) -> Coroutine[Any, Any, None]:
        """The app's call for one request, with the server's features in its scope: the
        app's own coroutine, returned, not awaited here, so the request's task holds no
        frame of this call while it runs (a held stream's memory, bench/results/)."""
        stream = self.stream  # HTTP/1.1: the stream of this request (one at a time)
        if scope["type"] == "http" and isinstance(stream, HTTPStream):
            direct = DirectBody(stream, self.connection, self._client)
            scope["extensions"][DIRECT_BODY] = direct
            scope["extensions"][ON_DISCONNECT] = partial(self._hear_close, stream)
            send = direct.framing_send(send, self.send)
        coroutine: Coroutine[Any, Any, None] = self._app(scope, receive, send)
        return coroutine

    def _hear_close(self, stream: HTTPStream, callback: Callable[[], None]) -> None:
        """``ON_DISCONNECT``: ``callback`` is called once, when ``stream`` closes (at once
        when it has closed already)."""
        if stream.closed:
            callback()
        else:
            self._on_close = (stream, callback)

    async def check_request(self, event: h11.Request) -> None:
        if event.method == b"PRI" and event.target == b"*" and event.http_version == b"2.0":
            raise PriorKnowledgeHTTP2
        # Anything else, ``Upgrade: h2c`` included, is served in HTTP/1.1: hypercorn's own
        # check would switch the connection to its HTTP/2 protocol.

    async def answer_malformed(self, status_code: int) -> None:
        """h11 found the request malformed: answer it, then hypercorn closes the connection.

        h11 hints 501 for a transfer coding other than chunked; to us, fronting an HTTP API,
        that is a malformed request like any other: 4xx. When the request's head was good
        and its body is what broke (a bad chunk), the app is reading that body: the answer
        carries the request id the app gave it, and the app is told (``FRAMING_ERROR`` in
        its scope) so its journal says rejected, not a client that left.
        """
        status = 400 if status_code >= 500 else status_code
        refusal = getattr(self.connection, "refusal", "")
        message = refusal or f"request framing: malformed HTTP/1.1 ({status})"
        payload = FramingError(status, message).error_json()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
            (b"connection", b"close"),
        ]
        scope = getattr(self.stream, "scope", None)
        if isinstance(scope, dict):  # its app may not have run yet: the id is given here
            scope[FRAMING_ERROR], scope[FRAMING_STATUS] = message, status
            headers.append((b"x-request-id", scope.setdefault(REQUEST_ID, request_id(scope))))
        headers += self.config.response_headers("h11")
        await self.write_event(h11.Response(status_code=status, headers=headers))
        await self.write_event(h11.Data(data=payload))
        await self.write_event(h11.EndOfMessage())

    async def write_event(self, event: Any) -> None:
        """``event`` through h11 to the connection, as hypercorn writes its own: once the
        client's side has failed, what h11 refuses to write is dropped."""
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
        else:
            if data is not None:
                await self.send(RawData(data=data))

    def stream_closing(self) -> None:
        """Tells the app's ``ON_DISCONNECT`` callback (hypercorn's ``http.disconnect``
        follows). Not when the router closed the connection itself
        (``ClientConnection._abort``): the request that made it close knows already, and
        ends with its own outcome."""
        heard, self._on_close = self._on_close, None
        if heard is not None and heard[0] is self.stream and not self._client.aborted:
            heard[1]()


class Http11Only:
    """Takes the place of hypercorn's ``ProtocolWrapper``, which switches to HTTP/2."""

    def __init__(self, protocol: Http11Protocol, send: Callable[[Event], Awaitable[None]]):
        self.protocol = protocol
        self.send = send

    async def initiate(self) -> None:
        pass

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except PriorKnowledgeHTTP2:
            await self.send(RawData(data=HTTP2_REFUSAL))
            await self.send(Closed())
