"""An in-memory network: fake engines, their KV side channels and the engine client over
``trio.testing`` memory streams, so timing tests run under trio's MockClock (autojump with
TCP sockets gives spurious timeouts; with memory streams virtual time is exact).

``sockets=True``: each connection is a ``socket.socketpair`` instead. A byte written to one
end is readable at the other before the write returns, so autojump stays exact, and the
router sees real descriptors: its stream reactor parks the engine's socket and the front
door writes to the client's without waiting, as in production (the paths that memory
streams switch off).

``network.open_stream`` is the ``connect`` function of both the router's engine client and
the fake engines' KV puller."""

from __future__ import annotations

import errno
import socket
from collections.abc import Awaitable, Callable

import trio
import trio.testing

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


async def _BLACKHOLE(stream: trio.abc.Stream) -> None:
    raise AssertionError("never called")


class MemoryNetwork:
    """Addresses (host, port) mapped to stream handlers run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery, *, sockets: bool = False) -> None:
        self.nursery = nursery
        self.sockets = sockets
        self.hosts: dict[tuple[str, int], StreamHandler] = {}
        self._made: list[trio.SocketStream] = []
        if sockets:
            nursery.start_soon(self._close_at_the_end)

    async def _close_at_the_end(self) -> None:
        """Every socket this network made is closed when its nursery ends (a handler
        cancelled mid-request leaves its stream to the collector otherwise)."""
        try:
            await trio.sleep_forever()
        finally:
            for stream in self._made:
                stream.socket.close()

    def socket_pair(self) -> tuple[trio.SocketStream, trio.SocketStream]:
        """Two connected trio streams over a kernel socketpair (AF_UNIX)."""
        one, other = socket.socketpair()
        pair = (
            trio.SocketStream(trio.socket.from_stdlib_socket(one)),
            trio.SocketStream(trio.socket.from_stdlib_socket(other)),
        )
        self._made += pair
        return pair

    def listen(self, host: str, port: int, handler: StreamHandler) -> None:
        self.hosts[(host, port)] = handler

    def unlisten(self, host: str, port: int) -> None:
        self.hosts.pop((host, port), None)

    def blackhole(self, host: str, port: int) -> None:
        """Connections to this address never complete (a host that drops SYNs)."""
        self.hosts[(host, port)] = _BLACKHOLE

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        handler = self.hosts.get((host, port))
        if handler is _BLACKHOLE:
            await trio.sleep_forever()
        if handler is None:
            raise OSError(errno.ECONNREFUSED, f"connection refused: {host}:{port}")
        pair = self.socket_pair() if self.sockets else trio.testing.memory_stream_pair()
        client, server = pair
        self.nursery.start_soon(handler, server)
        await trio.lowlevel.checkpoint()
        return client
