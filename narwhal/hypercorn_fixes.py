"""One fix to hypercorn's trio worker (0.18), applied when ``narwhal.server`` is imported.

Hypercorn's ``TCPServer.run`` starts an idle timer (``keep_alive_timeout``) next to its read
loop and closes the socket only once every task of the connection has ended. When the
client closes a kept-alive connection, the read loop ends but nothing stops the idle timer,
so the socket sits in CLOSE_WAIT, with three tasks, for the rest of the keep-alive timeout.
Clients that open a connection per request (curl, many SDKs) would pile up one descriptor
per request for ``serving.client_idle_timeout_s``. The soak found it (``bench/soak.py``:
descriptors and tasks did not come back to their idle level after the drain).

The fix stops the idle timer once the read loop is over: the connection reads nothing
more, so there is nothing left for it to time out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.trio.tcp_server import TCPServer

_PATCHED = "_narwhal_stops_idle_timer"


def stop_idle_timer_when_reading_ends() -> None:
    original: Callable[[Any], Awaitable[None]] = TCPServer._read_data
    if getattr(original, _PATCHED, False):
        return

    async def _read_data(self: Any) -> None:
        try:
            await original(self)
        finally:
            await self.idle_task.stop()

    setattr(_read_data, _PATCHED, True)
    TCPServer._read_data = _read_data  # type: ignore[method-assign]
