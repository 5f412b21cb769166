"""One kept-alive HTTP/1.1 connection to an engine, as the transport's pools hold it
(``narwhal.engines.transport``): its stream, its h11 state, and its sockets, held as
objects, never as descriptor numbers (``narwhal.lowlevel.fast_io``, docs/architecture.md
"Descriptors")."""

from __future__ import annotations

import select
from collections.abc import Callable

import h11
import trio

from narwhal.lowlevel.fast_io import read_when_ready, write_nowait

IDLE_EXPIRY_S = 4.0  # below uvicorn's (vLLM's) 5 s keep-alive timeout: never race its close
READ_SIZE = 65536


class EngineConnection:
    """One connection to an engine. Its sockets are held as objects, never as descriptor
    numbers (``narwhal.lowlevel.fast_io``): the number is read afresh at each system call."""

    __slots__ = ("before_close", "h11", "idle_since", "poll_socket", "socket", "stream")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        # socket: read and written directly (plain TCP only); poll_socket: the socket under
        # TLS too, which ``looks_alive`` polls (readable while idle: closed, or a TLS
        # alert); None: in memory (tests)
        self.socket: trio.socket.SocketType | None = None
        self.poll_socket: trio.socket.SocketType | None = None
        if isinstance(stream, trio.SocketStream):
            self.socket = self.poll_socket = stream.socket
        elif isinstance(stream, trio.SSLStream) and isinstance(
            stream.transport_stream, trio.SocketStream
        ):
            self.poll_socket = stream.transport_stream.socket
        # set while a reader waits on this connection outside trio (the stream reactor's
        # epoll): called with the error that reader is to raise, before the socket closes,
        # so the registration ends while the number is still this socket's
        self.before_close: Callable[[BaseException], None] | None = None

    def fileno(self) -> int:
        """The plain socket's descriptor now: -1 once closed, or when there is none."""
        sock = self.socket
        return -1 if sock is None else sock.fileno()

    def closing(self, error: BaseException) -> None:
        """The connection is about to close: a reader parked outside trio gets ``error``."""
        hook, self.before_close = self.before_close, None
        if hook is not None:
            hook(error)

    async def send(self, data: bytes) -> None:
        """Write ``data``. On a socket, one non-blocking write first, which the kernel takes
        whole for a request of a few KB: trio's ``send_all`` adds a trip through the
        scheduler after its write, two per request on the way to the first token. The
        leg's cancellation point is the limiter's checkpoint just before (``request``);
        what the kernel did not take goes through ``send_all``."""
        sock = self.socket
        if sock is not None:
            sent = write_nowait(sock, data)
            if sent == len(data):
                return
            data = data[sent:]
        await self.stream.send_all(data)

    async def receive(self) -> bytes:
        """What one read brings. On a socket: wait until readable, then read once. Trio's
        ``receive_some`` tries the read first, and between tokens of a stream that try
        always fails (a syscall and an exception per token), before it waits anyway."""
        sock = self.socket
        if sock is None:
            return bytes(await self.stream.receive_some(READ_SIZE))
        return await read_when_ready(sock, READ_SIZE)

    def looks_alive(self, now: float) -> bool:
        """Fresh enough and with nothing to read (readable while idle means closed)."""
        if now - self.idle_since > IDLE_EXPIRY_S:
            return False
        sock = self.poll_socket
        if sock is None:
            return True  # an in-memory stream (tests)
        if sock.fileno() < 0:
            return False  # closed already
        # poll, not select: a busy router has descriptors beyond select's 1024 limit
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)


async def close(conn: EngineConnection) -> None:
    """Close ``conn``, a parked reader told first; shielded, and bounded by a second."""
    conn.closing(trio.ClosedResourceError("engine connection closed"))
    with trio.CancelScope(shield=True), trio.move_on_after(1):
        await conn.stream.aclose()
