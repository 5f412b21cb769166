"""An in-memory network: fake engines, their KV side channels and the engine client over
``trio.testing`` memory streams, so timing tests run under trio's MockClock (autojump with
real sockets gives spurious timeouts; with memory streams virtual time is exact).

``network.open_stream`` is the ``connect`` function of both the router's engine client and
the fake engines' KV puller."""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable

import trio
import trio.testing

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


async def _BLACKHOLE(stream: trio.abc.Stream) -> None:
    raise AssertionError("never called")


class MemoryNetwork:
    """Addresses (host, port) mapped to stream handlers run in ``nursery``."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.hosts: dict[tuple[str, int], StreamHandler] = {}

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
        client, server = trio.testing.memory_stream_pair()
        self.nursery.start_soon(handler, server)
        await trio.lowlevel.checkpoint()
        return client
