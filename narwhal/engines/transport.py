"""The data legs' HTTP/1.1 transport: h11 over trio streams, one keep-alive pool per engine.

Why not httpcore here: a decode stream is many small chunks, and httpcore hands them over
one h11 event at a time through several async generators, so the router paid a client
write per token even when one socket read had brought ten (measured: one engine read per
token at 32 concurrent streams). Reading h11 directly, ``Response.next_batch()`` returns
everything one socket read completed, which the router relays in one write. It also keeps
cancellation simple: a response closed early closes its connection, nothing is left in a
pool's wait queue (the httpcore pool-slot leak under contended cancellation,
encode/httpcore#1093, cannot happen), and the capacity limiter in front bounds the pool.

Timeouts are the caller's cancel scopes, except the connect timeout, which bounds the TCP
connect and, for an ``https://`` engine, the TLS handshake together (``tls_connect``), and a
request's ``send_by``, the handoff clock of the descriptor it carries (``Pool.request``).
What the libraries raise leaves as engine faults: ``EngineErrors`` (``narwhal.engines.boundary``)
wraps the connect and each of a response's steps (``send``, ``read_head``, ``next_batch``,
``read_nowait``).
"""

from __future__ import annotations

import math
import socket
import ssl
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

import h11
import trio

from narwhal.core.faults import Phase, StreamBroken
from narwhal.engines.boundary import BodyTooLarge, EngineClosed, EngineErrors, Step
from narwhal.engines.engine_connection import (
    IDLE_EXPIRY_S,
    READ_SIZE,
    EngineConnection,
    close,
)
from narwhal.lowlevel.fast_io import read_nowait, read_when_ready
from narwhal.stream.chunked import ChunkedDecoder, ChunkedError

# (host, port) -> an open stream; OSError when the engine cannot be reached
Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]
# idle connections kept per engine: past a burst the rest close at once, so the descriptors
# a router holds track the streams it carries (at 9,000 open streams the prefill legs'
# idle connections, kept 4 s, pushed the process past its descriptor limit)
MAX_IDLE = 128


async def tcp_connect(host: str, port: int) -> trio.abc.Stream:
    stream = await trio.open_tcp_stream(host, port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # trio's default too
    return stream


def tls_context(ca_file: str = "") -> ssl.SSLContext:
    """Certificate and host name verification against ``ca_file``, or the system trust store
    when it is "" (``ssl.create_default_context``: TLS 1.2 at least); HTTP/1.1 offered by
    ALPN, so a front end that also speaks h2 answers in the protocol we speak."""
    context = ssl.create_default_context(cafile=ca_file or None)
    context.set_alpn_protocols(["http/1.1"])
    return context


def tls_connect(connect: Connect, context: ssl.SSLContext) -> Connect:
    """``connect``, then a TLS handshake verifying the engine's certificate for the host it
    was reached by. Its failure (an untrusted or mismatched certificate, a peer that does
    not speak TLS: trio's BrokenResourceError) is the engine's unreachability, as a refused
    connection is (the boundary's table); the pool's connect timeout bounds the handshake
    too. Nothing is sent before the handshake has verified the peer."""

    async def connect_tls(host: str, port: int) -> trio.abc.Stream:
        stream = await connect(host, port)
        tls = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
        try:
            await tls.do_handshake()
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return tls

    return connect_tls


class Pool:
    """Kept-alive connections to the engine at ``url``, at most ``max_connections`` in use."""

    def __init__(
        self, url: str, connect: Connect, connect_timeout_s: float, max_connections: int
    ) -> None:
        parts = urlsplit(url)
        self.url = url  # as the engine's faults name it
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.connect = connect
        self.connect_timeout_s = connect_timeout_s
        self.limiter = trio.CapacityLimiter(max_connections)
        self.idle: list[EngineConnection] = []
        self.active = 0

    async def _checkout(self, phase: Phase) -> tuple[EngineConnection, bool]:
        now = trio.current_time()
        while self.idle:
            conn = self.idle.pop()
            if conn.looks_alive(now):
                return conn, True
            await close(conn)
        connect_errors = EngineErrors(Step.CONNECT, self.url, phase)
        with connect_errors, trio.fail_after(self.connect_timeout_s):
            stream = await self.connect(self.host, self.port)
        return EngineConnection(stream), False

    def _checkin(self, conn: EngineConnection, *, fresh: bool = False) -> bool:
        """Keep ``conn`` for reuse; False when ``MAX_IDLE`` are kept already (close it)."""
        if len(self.idle) >= MAX_IDLE:
            return False
        if not fresh:
            conn.h11.start_next_cycle()
        conn.idle_since = trio.current_time()
        self.idle.append(conn)
        return True

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        phase: Phase,
        send_by: float = math.inf,
    ) -> Response:
        """Send a request and read the response head; the caller reads the body and closes
        the Response. Holds a capacity-limiter slot until then. Its faults are of ``phase``.

        ``send_by``: the time by which the request's last byte must be written (a KV
        descriptor's handoff clock, contract 5): the wait for a slot, the connect and the
        write all run under it, and when it fires ``SendTooLate`` is raised with the
        request unsent or cut short on a connection closed at once, so the engine never
        holds a complete request. The response head is read after, outside it."""
        response = Response(self, phase)
        try:
            for _ in range(2):  # a reused connection closed under us gets one fresh retry
                clock = _NO_CLOCK if send_by == math.inf else trio.CancelScope(deadline=send_by)
                with clock:
                    reused = await self._send(response, method, target, headers, body)
                if clock.cancelled_caught:
                    raise SendTooLate(send_by)
                try:
                    await response.read_head()
                    return response
                except StreamBroken:
                    await response.drop_connection()
                    if not (reused and response.errors.gone):
                        raise
            raise AssertionError("unreachable")  # pragma: no cover
        except BaseException:
            await response.aclose()
            raise

    async def _send(
        self,
        response: Response,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> bool:
        """A slot (once), a connection, the request written: whether it was a reused one."""
        if not response.holding:
            # with its checkpoint even when a slot is free: dropping it saved no CPU that
            # could be measured, and it paces a burst of new requests' connects
            await self.limiter.acquire_on_behalf_of(response)
            response.holding = True
        conn, reused = await self._checkout(response.errors.phase)
        response.conn = conn
        self.active += 1
        await response.send(method, target, headers, body)
        return reused

    async def sweep(self) -> None:
        """Close idle connections past their expiry: once traffic stops, the router holds no
        descriptors (nor engine-side connection slots) it will never use again."""
        now = trio.current_time()
        stale = [c for c in self.idle if now - c.idle_since > IDLE_EXPIRY_S]
        self.idle = [c for c in self.idle if now - c.idle_since <= IDLE_EXPIRY_S]
        for conn in stale:
            await close(conn)

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            await close(conn)


class _NoClock:
    """The handoff clock of a request that has none (every one but a handed-off decode):
    no cancel scope, whose entry and exit are a fair share of a request's router CPU
    (bench/results/request-machine-events/)."""

    cancelled_caught = False

    def __enter__(self) -> _NoClock:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_CLOCK = _NoClock()


class SendTooLate(Exception):
    """A request's ``send_by`` came before its last byte was written (``Pool.request``)."""

    def __init__(self, send_by: float) -> None:
        super().__init__(f"not sent by its deadline (t={send_by:.3f})")
        self.send_by = send_by


def _feed_chunked(decoder: ChunkedDecoder, data: bytes) -> list[bytes]:
    """One socket read's bytes through the chunked decoder; never an empty part. The
    connection's end (no bytes) before the last chunk breaks the framing too."""
    if not data:
        raise ChunkedError(
            "peer closed connection without sending complete message body (incomplete chunked read)"
        )
    return decoder.feed(data)


class Response:
    """One response being read; ``next_batch`` coalesces what each socket read brought.
    Each step that calls the libraries (``send``, ``read_head``, ``next_batch``,
    ``read_nowait``) runs inside ``errors``: what they raise leaves as the engine's fault."""

    def __init__(self, pool: Pool, phase: Phase) -> None:
        self.pool = pool
        self.errors = EngineErrors(Step.EXCHANGE, pool.url, phase)
        self.conn: EngineConnection | None = None
        self.status = 0
        self.done = False
        self.holding = False  # a slot of the pool's limiter, from the request to aclose
        # a chunked body is decoded here, not by h11 (see narwhal.stream.chunked)
        self._chunked: ChunkedDecoder | None = None
        self._early: list[bytes] = []  # body bytes that came in with the head
        self._keep_alive = False

    async def send(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """Write the request whole on ``conn``."""
        conn = self.conn
        assert conn is not None
        pool = self.pool
        all_headers = [
            (b"host", f"{pool.host}:{pool.port}".encode()),
            (b"content-length", b"%d" % len(body)),
            *headers,
        ]
        with self.errors:
            data = conn.h11.send(h11.Request(method=method, target=target, headers=all_headers))
            data += conn.h11.send(h11.Data(data=body)) or b""
            data += conn.h11.send(h11.EndOfMessage()) or b""
            await conn.send(data)

    async def read_head(self) -> None:
        """Read the response head (past any 1xx); a chunked body is decoded here after."""
        conn = self.conn
        assert conn is not None
        with self.errors:
            event = await self._next_event()
            while isinstance(event, h11.InformationalResponse):
                event = await self._next_event()
            assert isinstance(event, h11.Response)
            self.status = event.status_code
            chunked, closes = _framing(event)
            if chunked:
                self._take_chunked_body(conn, event, closes)

    def _take_chunked_body(self, conn: EngineConnection, head: h11.Response, closes: bool) -> None:
        """From here on the body is ours to decode; h11 saw only the head (it accepts no
        transfer coding but chunked, so a head it parsed with one is chunked)."""
        self._chunked = ChunkedDecoder()
        self._keep_alive = head.http_version == b"1.1" and not closes
        early, _ = conn.h11.trailing_data
        if early:
            self._early = self._chunked.feed(bytes(early))  # never an empty part

    def _h11_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        """The next parsed event; the engine's close where more was due, EngineClosed."""
        conn = self.conn
        assert conn is not None
        event = conn.h11.next_event()
        if isinstance(event, h11.ConnectionClosed):
            raise EngineClosed
        return event

    async def _next_event(self) -> h11.Event:
        while True:
            event = self._h11_event()
            if isinstance(event, h11.Event):
                return event
            await self._receive()  # NEED_DATA (PAUSED only follows a complete response)

    async def _receive(self) -> None:
        conn = self.conn
        assert conn is not None
        conn.h11.receive_data(await conn.receive())

    async def _next_chunked(self, decoder: ChunkedDecoder) -> bytes | None:
        """The relay's read, in one function: wait until readable, read once, decode."""
        conn = self.conn
        assert conn is not None
        parts = self._early
        if parts:
            self._early = []
        sock = conn.socket
        while not parts and not decoder.done:
            if sock is None:
                data = await conn.receive()
            else:  # conn.receive's socket path, one call less: this runs once per token
                data = await read_when_ready(sock, READ_SIZE)
            parts = _feed_chunked(decoder, data)
        if decoder.done:
            self.done = True
            if not parts:
                await self.aclose()
                return None
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def park_socket(self) -> EngineConnection | None:
        """The connection to wait on before ``read_nowait`` can bring more; None: call
        ``next_batch`` (not a chunked body on a plain socket, or the rest of the body is
        read already: its socket may never be readable again)."""
        decoder, conn = self._chunked, self.conn
        if decoder is None or decoder.done or conn is None or self._early or self.done:
            return None
        return None if conn.socket is None else conn

    def read_nowait(self) -> bytes | None:
        """``next_batch`` without waiting, for a parked stream (``StreamReactor``): what one
        read of a chunked body on a plain socket brought, b"" when nothing is there yet.
        None: ``next_batch`` goes on (the end of the body, bytes that came with the head,
        or a body this cannot read), with nothing lost: the last parts wait for it."""
        conn, decoder = self.park_socket(), self._chunked
        if conn is None or conn.socket is None or decoder is None:
            return None
        try:
            data = read_nowait(conn.socket, READ_SIZE)
            if data is None:
                return b""  # a spurious readiness: nothing yet
            parts = _feed_chunked(decoder, data)
        except Exception as exc:  # per token: see EngineErrors.raise_fault
            self.errors.raise_fault(exc)
            raise
        if decoder.done:
            self._early = parts
            return None
        if not parts:
            return b""
        return b"".join(parts) if len(parts) != 1 else parts[0]

    def body_read(self) -> bool:
        """Whether the body's end has been read off the connection already: what is left
        of it comes without a wait."""
        decoder = self._chunked
        return self.done or (decoder is not None and decoder.done)

    async def next_batch(self) -> bytes | None:
        """The body bytes that arrived together; None at the end of the body."""
        if self.done:
            return None
        try:
            if self._chunked is not None:
                return await self._next_chunked(self._chunked)
            return await self._next_data()
        except Exception as exc:  # per token: see EngineErrors.raise_fault
            self.errors.raise_fault(exc)
            raise

    async def _next_data(self) -> bytes | None:
        """``next_batch`` of a body h11 reads (one with a length, or up to the close)."""
        parts: list[bytes] = []
        while True:
            event = self._h11_event()
            if isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.done = True
                break
            elif event is h11.NEED_DATA:
                if parts:
                    break
                await self._receive()
        if self.done and not parts:
            await self.aclose()
            return None
        return b"".join(parts) if len(parts) != 1 else parts[0]

    async def read_within(self, limit: int) -> bytes | None:
        """The whole body; None when it is larger than ``limit`` (the rest is not read)."""
        parts, size = [], 0
        while (part := await self.next_batch()) is not None:
            parts.append(part)
            size += len(part)
            if size > limit:
                return None
        return b"".join(parts)

    async def read_all(self, limit: int) -> bytes:
        """The whole body; one larger than ``limit`` is the engine's fault."""
        data = await self.read_within(limit)
        if data is None:
            with self.errors:
                raise BodyTooLarge(limit)
        return data

    async def drop_connection(self) -> None:
        """Give the connection back (complete exchange) or close it; keep the slot."""
        conn, self.conn = self.conn, None
        if conn is None:
            return
        self.pool.active -= 1
        if conn.before_close is not None:  # its reader is parked: another task closes it
            conn.closing(self._closed_under_reader())
        h = conn.h11
        if self._chunked is not None:
            # h11 never saw this body, so it cannot judge reuse: the decoder's clean end,
            # nothing sent past it, the request fully sent, keep-alive agreed
            chunked = self._chunked
            clean = chunked.done and not chunked.leftover and h.our_state is h11.DONE
            if clean and self._keep_alive:
                conn.h11 = h11.Connection(h11.CLIENT)
                if self.pool._checkin(conn, fresh=True):
                    return
        elif self.done and h.our_state is h11.DONE and h.their_state is h11.DONE:
            kept = self.pool._checkin(conn)
            if kept:
                return
        await close(conn)

    def _closed_under_reader(self) -> BaseException:
        error = trio.ClosedResourceError("closed by another task while its reader waited")
        fault = self.errors.fault(error)
        return error if fault is None else fault

    async def aclose(self) -> None:
        """End the exchange: connection back to the pool or closed, capacity slot freed."""
        try:
            await self.drop_connection()
        finally:
            if self.holding:
                self.holding = False
                self.pool.limiter.release_on_behalf_of(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _framing(head: h11.Response) -> tuple[bool, bool]:
    """Whether the body is chunked, and whether the engine said ``connection: close``: one
    pass over the head's raw items (a ``Headers`` iterated as a sequence costs a call per
    field, on every response)."""
    chunked = closes = False
    for raw_name, value in head.headers.raw_items():
        name = raw_name.lower()
        if name == b"transfer-encoding":
            chunked = True
        elif name == b"connection" and b"close" in value.lower():
            closes = True
    return chunked and head.status_code not in (204, 304), closes
