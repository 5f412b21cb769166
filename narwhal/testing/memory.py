"""An in-memory network: fake engines, their KV side channels and the engine client over
``trio.testing`` memory streams, so timing tests run under trio's MockClock (autojump with
real sockets gives spurious timeouts; with memory streams virtual time is exact)."""

from __future__ import annotations

import errno
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpcore
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

    def backend(self) -> httpcore.AsyncNetworkBackend:
        return _Backend(self)


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self, network: MemoryNetwork) -> None:
        self.network = network

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        # httpcore leaves the connect timeout to its network backend
        with trio.move_on_after(math.inf if timeout is None else timeout):
            try:
                return _Stream(await self.network.open_stream(host, port))
            except OSError as exc:
                raise httpcore.ConnectError(str(exc)) from exc
        raise httpcore.ConnectTimeout(f"connect to {host}:{port} timed out")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        try:
            return bytes(await self.stream.receive_some(max_bytes))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(str(exc)) from exc

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        try:
            await self.stream.send_all(buffer)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.WriteError(str(exc)) from exc

    async def aclose(self) -> None:
        await self.stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        return None
