"""The server's end, told to every live client connection without a task per connection
(``narwhal.frontdoor.connection``)."""

from __future__ import annotations

from typing import Any, Protocol


class Told(Protocol):
    """A live connection, told when the server shuts down."""

    def server_ends(self) -> None: ...


class ServerEnd:
    """Hypercorn's ``context.terminated`` event, which also tells every live connection
    when the server shuts down (``ClientConnection.server_ends``): the idle timer needs no
    task per connection to wait on the event. Installed on the worker's context by its
    first connection; hypercorn sets, waits on and reads the event as before."""

    def __init__(self, event: Any) -> None:
        self._event = event
        self._connections: set[Told] = set()

    @classmethod
    def of(cls, context: Any) -> ServerEnd:
        end = context.terminated
        if not isinstance(end, ServerEnd):
            end = context.terminated = cls(end)
        return end

    def add(self, connection: Told) -> None:
        self._connections.add(connection)
        if self.is_set():  # accepted as the server began to shut down
            connection.server_ends()

    def discard(self, connection: Told) -> None:
        self._connections.discard(connection)

    async def set(self) -> None:
        await self._event.set()
        for connection in list(self._connections):
            connection.server_ends()

    async def clear(self) -> None:
        await self._event.clear()

    async def wait(self) -> None:
        await self._event.wait()

    def is_set(self) -> bool:
        return bool(self._event.is_set())
