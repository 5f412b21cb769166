"""One client connection: hypercorn's trio ``TCPServer``, written again with the router's
front-door rules, over hypercorn's HTTP/1.1 protocol (``narwhal.frontdoor.http11``).

The router faces the open network (contract 3, "HTTP hygiene"; invariants 9 and 10). Hypercorn's
connection handler is written again with six rules of its own, each in code below:

1. **One connection's failure is its own.** An exception escaping a connection's tasks
   (a protocol bug, a codec bug) reaches hypercorn's server nursery and ends the process.
   ``run`` is an error boundary: the exception is logged, counted
   (``narwhal_connection_errors_total``) and closes that connection only. ``Cancelled``
   passes through.
2. **HTTP/1.1 only.** Hypercorn's HTTP/2 path crashes the process when it answers a stream
   whose DATA frames are still arriving (hypercorn bug #329: ``KeyError`` in
   ``H2Protocol``), and no OpenAI client, load balancer health check or vLLM engine needs
   HTTP/2 from us. A prior-knowledge HTTP/2 preface is answered with an HTTP/2 ``GOAWAY``
   (``HTTP_1_1_REQUIRED``, RFC 9113 7) and the connection closes, lingering (rule 6); an
   ``Upgrade: h2c`` offer is declined by answering in HTTP/1.1 (RFC 9110 7.8); TLS offers
   only ``http/1.1`` in ALPN.
3. **Writes to the client are bounded.** Hypercorn shields ``send_all`` with no deadline, so
   a client that stops reading pins its request past the request deadline and the graceful
   drain. Here a write is cancelled with the request that makes it; a write cut short
   leaves half a chunk on the wire, so the connection is closed at once, with a reset
   (``_abort``): the kernel drops what the client has not taken, and the client sees the
   end at the deadline, not after reading megabytes the router gave up on.
4. **The idle timer stops when reading ends.** Hypercorn closes the socket only when every
   task of the connection has ended, and nothing stopped the idle timer after the client
   closed: the socket sat in CLOSE_WAIT, with three tasks, for ``keep_alive_timeout``
   (found by ``bench/soak.py``). Here the timer is the read loop's cancel scope: it ends
   with the reading.
5. **A client that pipelined a request and left is seen at once** (``PipelineWatch``):
   hypercorn stops reading while the pipelined request waits, so its close was seen only
   when the response before it ended.
6. **A close lingers** (nginx's ``lingering_close``): hypercorn closes as soon as the
   protocol is done, and a close with bytes unread sends a reset that destroys an answer
   the client has not read yet (the HTTP/2 refusal to a client sending a body). Every
   close but ``_abort``'s reset goes through ``_close``, which half-closes, then reads and
   drops what may be unread within the bounds of ``narwhal.frontdoor.linger`` (whose
   docstring lists the closes that come here).

Per-chunk and per-request costs trimmed (``bench/results/relay-reactor.md``,
``bench/results/server-fixes.md``): a write nothing contends for goes straight to the
socket (one non-blocking ``send``, not a lock, a shielded scope and two scheduler trips);
the idle timer is the read loop's cancel scope, reached at shutdown through ``ServerEnd``
(no task per connection); the read loop waits for readiness before it reads; ``cork``
sends a response's head with its first chunk, and its last chunk with the end.
``ClientConnection`` runs none of ``TCPServer``'s code; what of hypercorn's protocol and h11
runs against ours is checked at start (``narwhal.frontdoor.seams``, the only module that
touches their private names; ``docs/upstream.md`` writes each up for upstream).
"""

from __future__ import annotations

import logging
import socket as stdlib_socket
import struct
from contextlib import suppress
from functools import partial
from math import inf
from typing import Any

import trio
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from narwhal.frontdoor.app_queue import AppTaskGroup
from narwhal.frontdoor.http11 import AppHooks, ClientGone, Http11Only, Http11Protocol
from narwhal.frontdoor.linger import discard, drop_a_read, half_close, unread_input
from narwhal.frontdoor.send_lock import Rest, SendLock
from narwhal.frontdoor.server_end import ServerEnd
from narwhal.lowlevel.fast_io import STREAM_GONE, read_when_ready, unsent, write_nowait

log = logging.getLogger("narwhal.connection")


MAX_RECV = 2**16  # hypercorn's read size
ERROR_LOG_INTERVAL_S = 10.0  # one traceback per interval: a hostile client must not flood logs
# SO_LINGER on, zero seconds: close() sends a reset and drops what the kernel still holds
_LINGER_RESET = struct.pack("ii", 1, 0)


class ClientConnection:
    """Hypercorn's trio connection handler (``TCPServer``, 0.18) written again with the
    rules in this module's docstring: the same arguments, the same protocol events, none of
    its code (``docs/upstream.md``)."""

    _last_logged = -ERROR_LOG_INTERVAL_S

    def __init__(
        self,
        app: Any,
        config: Any,
        context: Any,
        state: Any,
        stream: Any,
        *,
        hooks: AppHooks | None = None,
    ) -> None:
        self.app = app  # the ASGI app itself, called with (scope, receive, send)
        self.config = config
        self.context = context
        self.state = state  # the lifespan's state, copied into each request's scope
        self.stream = stream  # a trio SocketStream, or an SSLStream over one
        self.protocol: Http11Only  # made once the connection's addresses are known
        self._hooks = hooks
        # the idle timer: the read loop's scope, whose deadline is keep_alive_timeout after
        # the connection went idle, inf while a request is served (no task of its own)
        self._idle = trio.CancelScope(deadline=trio.current_time() + self.config.keep_alive_timeout)
        self._busy = False
        self._terminating = False  # the server is shutting down: close once idle
        self._server_end = ServerEnd.of(self.context)
        self._corked: list[bytes] | None = None  # writes held back by cork()
        self._rest: bytes | memoryview | None = None  # what write_nowait left to write_rest
        self._rest_state = Rest.NONE
        self.aborted = False  # _abort closed it: no disconnect is told for it
        self._protocol_done = False  # the protocol sent Closed: it reads no more of the client
        self._input_ended = False  # the client's end (or a reset) was read: nothing is unread
        self._closed = False  # the lingering close has begun (``_close``)
        self._half_closed = False  # our end was sent (``_half_close``): once is enough
        self._reader: trio.lowlevel.Task | None = None  # the read loop's task, while it reads
        self.write_failed = False  # a write broke (reset, closed): later bytes never arrive
        # hypercorn's trio.Lock, owner-free: a write that the stream reactor's task began
        # (write_nowait) may leave its rest to the request's task (write_rest)
        self._lock = SendLock()
        self._h11: Http11Protocol | None = None  # the protocol, once it is made
        self._server_end.add(self)  # last: it may call server_ends at once

    async def run(self) -> None:
        try:
            await self._serve()
        except* Exception as group:  # the error boundary; Cancelled is not an Exception
            self._failed(group)
        finally:
            self._server_end.discard(self)
            await self._close()

    async def _close(self) -> None:
        """The end of the connection, lingering (nginx's ``lingering_close``): our half
        closed, so the client reads the answer and then our end; what the client still
        sends read and dropped, within the bounds of ``narwhal.frontdoor.linger``, when any
        of it may be unread (``_may_have_unread``); then the stream closed. Closing with
        bytes unread makes the kernel send a reset, which destroys the answer a client still
        writing has not read. Every close of the connection comes here but ``_abort``'s
        reset. Its caller is the only reader of the stream: the read loop has ended."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._half_close()
            if self._may_have_unread():
                await discard(partial(drop_a_read, self.stream))
        finally:
            await self.stream.aclose()

    async def _half_close(self) -> None:
        """Our end, after the answer: sent once, whether the protocol's close or ``_close``
        comes first."""
        if not self._half_closed:
            self._half_closed = True
            await half_close(self.stream)

    def _may_have_unread(self) -> bool:
        """The client's end not read yet, and input it sent may be unread (``unread_input``)."""
        if self.aborted or self.write_failed or self._input_ended:
            return False
        protocol = self._h11
        return unread_input(None if protocol is None else protocol.connection, self._tcp_socket())

    async def _serve(self) -> None:
        """Hypercorn's ``TCPServer.run`` with ``Http11Only`` in place of its
        ``ProtocolWrapper``, ``AppTaskGroup`` in place of its task group, and the idle timer
        as the read loop's cancel scope."""
        stream = self.stream
        try:
            try:
                with trio.fail_after(self.config.ssl_handshake_timeout):
                    await stream.do_handshake()
            except (trio.BrokenResourceError, trio.TooSlowError):
                return
            socket = stream.transport_stream.socket
            ssl = True
        except AttributeError:  # not TLS
            socket = stream.socket
            ssl = False
        try:
            client = parse_socket_addr(socket.family, socket.getpeername())
            server = parse_socket_addr(socket.family, socket.getsockname())
            async with AppTaskGroup() as task_group:
                h11_protocol = Http11Protocol(
                    self.app,
                    self.config,
                    self.context,
                    task_group,
                    ConnectionState(self.state),
                    ssl,
                    client,
                    server,
                    self.protocol_send,
                    client=self,
                    hooks=self._hooks,
                )
                # hypercorn's ProtocolWrapper would switch to HTTP/2; ours has its interface
                self.protocol = Http11Only(h11_protocol, self.protocol_send)
                self._h11 = h11_protocol
                if self._terminating:
                    self._serve_no_more()
                self._reader = trio.lowlevel.current_task()
                try:
                    with self._idle:
                        await self._read_data()
                finally:
                    self._reader = None
                if self._protocol_done:  # the read loop stopped for the close
                    await self._close()
                elif self._idle.cancelled_caught:  # idle past keep_alive_timeout, or shutdown
                    with trio.CancelScope(shield=True):
                        await self.protocol.handle(Closed())
                    await self._close()
        except OSError:
            pass

    def _failed(self, group: BaseExceptionGroup[Exception]) -> None:
        if self._hooks is not None:
            self._hooks.connection_failed()
        now = trio.current_time()
        if now - ClientConnection._last_logged >= ERROR_LOG_INTERVAL_S:
            ClientConnection._last_logged = now
            log.error("client connection failed; closed it", exc_info=group)
        self._abort()

    async def _read_data(self) -> None:
        try:
            socket = getattr(self.stream, "socket", None)  # None: TLS, or a test's stream
            if self._h11 is not None:
                self._h11.watch.watch(self._tcp_socket())
            if socket is None or self.config.read_timeout:
                try:
                    await self._receive_stream()
                except ClientGone:
                    self._input_ended = True
                    await self.protocol.handle(Closed())
            else:
                await self._read_socket(socket)
        finally:
            self._idle.deadline = inf  # reading is over: nothing is left to time out

    async def _receive_stream(self) -> None:
        """Hypercorn's read loop, through trio's stream (TLS, a test's stream, or a read
        timeout to keep): read until the client's end, an error, the timeout, or the
        protocol's close (``Closed``, whose lingering close then reads)."""
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._input_ended = True
                break
            except trio.TooSlowError:
                break
            if data == b"":
                self._input_ended = True
            await self.protocol.handle(RawData(bytes(data)))
            if self._protocol_done:
                return
            if data == b"":
                break
        await self.protocol.handle(Closed())

    async def _read_socket(self, socket: trio.socket.SocketType) -> None:
        """The read loop on a plain socket (no read timeout): wait until readable, then
        read once. Another task may close the socket (``_abort``'s reset), even between the
        wake-up and this loop's next step: ``read_when_ready`` takes its number afresh after
        the wait, so a closed socket ends the loop and the socket that took its number is
        never read here. The protocol's close (``Closed``, which the app's task sends after
        a ``Connection: close`` answer) ends it too, without closing the socket: this
        task's lingering close reads and closes from then on."""
        handle = self.protocol.handle
        while True:
            try:
                data = await read_when_ready(socket, MAX_RECV)
            except STREAM_GONE:
                self._input_ended = True
                break
            if not data:
                self._input_ended = True
            try:
                await handle(RawData(data))
            except ClientGone:
                self._input_ended = True
                break
            if self._protocol_done:
                return
            if not data:
                break
        await handle(Closed())

    def server_ends(self) -> None:
        """The server is shutting down (``ServerEnd``): close now if idle, else once the
        response ends (``_updated``), as hypercorn's idle timer does at shutdown."""
        self._terminating = True
        if not self._busy:
            self._idle.deadline = trio.current_time()
        self._serve_no_more()

    def _serve_no_more(self) -> None:
        """A response that starts from now on says ``connection: close``: the connection
        closes after it, and the client must not send another request on it (nor count on
        one it pipelined). Hypercorn's own rule for a spent keep-alive budget."""
        protocol = self._h11
        if protocol is not None:
            protocol.keep_alive_requests = protocol.config.keep_alive_max_requests

    def _updated(self, idle: bool) -> None:
        self._busy = not idle
        if not idle:
            self._idle.deadline = inf
        elif self._terminating:
            self._idle.deadline = trio.current_time()
        else:
            self._idle.deadline = trio.current_time() + self.config.keep_alive_timeout

    async def protocol_send(self, event: Event) -> None:
        if type(event) is not RawData:
            if self._corked is not None:
                await self.uncork()  # what was held back goes before a close or a recycle
            if type(event) is Updated:
                self._updated(event.idle)
            elif isinstance(event, Closed):  # the protocol is done with the connection
                await self._protocol_closed()
            return
        if self._corked is not None:
            self._corked.append(event.data)
            return
        try:
            await self._write(event.data)
        except STREAM_GONE:
            self.write_failed = True
            await self.protocol.handle(Closed())

    async def _protocol_closed(self) -> None:
        """The protocol is done with the connection (an answer that ends it: a refusal of
        HTTP/2, a 400 to a malformed request, a response that said ``connection: close``),
        perhaps with the client's request unread. Our half closes at once, after the answer.
        The read loop stops handing the protocol what it reads and ends (cancelled from
        here when this is another task: a wait for the client's next bytes ends now), and
        the lingering close (``_close``) reads from there, in its task. When the read loop
        has ended already (the client's end), the close comes when the connection's tasks
        have (``run``)."""
        self._protocol_done = True
        await self._half_close()
        await self.protocol.handle(Closed())
        reader = self._reader
        if reader is not None and reader is not trio.lowlevel.current_task():
            self._idle.cancel()

    def cork(self) -> None:
        """Hold writes back until ``uncork`` (or any event other than a write): a response's
        head and first chunk, or its last chunk and end, go out in one write. Nothing that
        waits may run while corked: the held bytes go out only at ``uncork``."""
        self._corked = []

    async def uncork(self) -> None:
        held, self._corked = self._corked, None
        if held:
            await self.protocol_send(RawData(data=b"".join(held)))

    def uncork_nowait(self) -> None:
        """``uncork`` without waiting, for an exception on its way out (a cancellation at
        hypercorn's checkpoint after the end, which comes before the response's last bytes
        would have gone out uncorked): the held bytes are written whole if the kernel takes
        them now, else the connection closes (half a response may not be followed)."""
        held, self._corked = self._corked, None
        if held and not self.write_nowait(b"".join(held)):
            self.give_up()

    def give_up(self) -> None:
        """Reset the connection (``_abort``), dropping what ``write_nowait`` left unwritten
        (its rest is not to be awaited then)."""
        if self._rest_state is Rest.LOCKED:
            self._lock.release()
        self._rest, self._rest_state = None, Rest.NONE
        self._abort()

    def cut(self, *, abandon: bool) -> None:
        """The response ends here without the last chunk of its body (contract 6): h11 has not
        finished it, so hypercorn closes the connection when the app returns, and every
        client sees a failed transfer, none reuses the connection. ``abandon``: the request
        deadline or the drain gave the request up; a client that has not taken every byte
        is not waited for, the connection is reset now (invariant 10)."""
        if abandon and self._unsent() != 0:
            self._abort()

    def _unsent(self) -> int | None:
        """Bytes the kernel holds for the client and has not sent (its window is full)."""
        socket = self._tcp_socket()
        return 0 if socket is None else unsent(socket)  # None: a test's stream

    def write_nowait(self, data: bytes) -> bool:
        """Write ``data`` now when nothing contends for the socket: True when the kernel took
        all of it. False: what is left is written by ``write_rest``, which must be awaited at
        once (a partial write holds the send lock until then; a failed one closes there)."""
        lock = self._lock
        socket = getattr(self.stream, "socket", None)  # None: TLS, or a test's stream
        if socket is None or lock.locked() or self._corked is not None:
            self._rest, self._rest_state = data, Rest.UNLOCKED
            return False
        try:
            sent = write_nowait(socket, data)  # closed, reset: STREAM_GONE
        except STREAM_GONE:
            self._rest_state = Rest.BROKEN
            return False
        if sent == len(data):
            return True
        lock.acquire_nowait()
        self._rest, self._rest_state = memoryview(data)[sent:], Rest.LOCKED
        return False

    async def write_rest(self) -> None:
        """The rest of a ``write_nowait`` that returned False: through the lock and the
        bounded send (a cancelled send closes the connection, ``_send_all``)."""
        rest, state = self._rest, self._rest_state
        self._rest, self._rest_state = None, Rest.NONE
        try:
            if state is Rest.LOCKED:
                assert rest is not None
                try:
                    await self._send_all(rest)
                finally:
                    self._lock.release()
            elif state is Rest.UNLOCKED:
                assert rest is not None
                await self.protocol_send(RawData(data=bytes(rest)))
                return
            elif state is Rest.BROKEN:
                raise trio.BrokenResourceError
        except STREAM_GONE:
            self.write_failed = True
            await self.protocol.handle(Closed())

    async def _write(self, data: bytes) -> None:
        lock = self._lock
        socket = getattr(self.stream, "socket", None)  # None: TLS, or a test's stream
        if socket is None or lock.locked():
            async with lock:
                await self._send_all(data)
            return
        lock.acquire_nowait()  # the send that nothing contends for: no scheduler trip
        try:
            sent = write_nowait(socket, data)  # closed, reset: STREAM_GONE
            if sent < len(data):
                await self._send_all(memoryview(data)[sent:])
        finally:
            lock.release()

    async def _send_all(self, data: bytes | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except trio.Cancelled:
            # the request that wrote gave up (deadline, drain, its client gone): half a
            # chunk may be on the wire, so nothing more may follow it
            self._abort()
            raise

    def _abort(self) -> None:
        """Give the connection up: close the socket now, with a reset (``SO_LINGER`` 0, as
        nginx's ``reset_timedout_connection``). A plain close queues its FIN behind every
        byte the kernel still holds (megabytes, for a client that reads slowly): the client
        would see the end minutes past the deadline, and the kernel would hold the memory
        meanwhile. (A trio socket closes synchronously, waking its waiters.)"""
        self.aborted = True
        socket = self._tcp_socket()
        if socket is not None:
            if socket.fileno() >= 0:
                with suppress(OSError):
                    socket.setsockopt(
                        stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, _LINGER_RESET
                    )
            socket.close()
        if self._h11 is not None:
            self._h11.watch.close()

    def _tcp_socket(self) -> Any:
        """The TCP socket, beneath TLS too; None for a test's in-memory stream."""
        transport: Any = getattr(self.stream, "transport_stream", self.stream)
        return getattr(transport, "socket", None)
