"""The accept loop takes a burst of connections per wakeup (a change to trio's
``SocketListener``, applied by ``narwhal.server.install_server_fixes`` after
``narwhal.shapes`` verified ``SHAPES``; trio is pinned in pyproject.toml).

Hypercorn serves its listeners with ``trio.serve_listeners``, which accepts one connection
per pass of trio's scheduler (``accept`` is a checkpoint). Under load a pass is long, so a
burst of clients connecting at once waits in the kernel's listen queue; past its size
(``somaxconn``) the kernel drops handshakes, and a client whose handshake is dropped too
often sees its connection reset before any response: no status code, nothing in the
journal. The patched ``SocketListener.accept`` takes up to ``ACCEPT_BURST`` more
connections that are already queued, without waiting, and hands them out on the next
calls (closing them if the listener closes first). Admitted requests then get the router's
own answers (``max_inflight`` -> 429). Figures: ``bench/results/server-fixes.md``.

With ``--workers N`` each worker has a listener of its own (``narwhal.workers``,
``SO_REUSEPORT``): a burst takes only connections the kernel already gave that worker,
never another worker's share, as it did when the workers shared one listening socket.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from narwhal.hypercorn_fixes import ORIGINAL, PATCHED

SHAPES = {
    "trio:SocketListener.accept": "d61090197bfe208b",
    "trio:SocketListener.aclose": "eebb65c45297d4e7",
}

ACCEPT_BURST = 64  # connections taken from the kernel's queue per wakeup of the accept loop
_QUEUED = "_narwhal_queued"  # a listener's accepted connections not yet handed out


def accept_in_bursts() -> None:
    original: Callable[[Any], Awaitable[trio.SocketStream]] = trio.SocketListener.accept
    if getattr(original, PATCHED, False):
        return
    original_close: Callable[[Any], Awaitable[None]] = trio.SocketListener.aclose

    async def accept(self: Any) -> trio.SocketStream:
        queued: deque[trio.socket.SocketType] | None = self.__dict__.get(_QUEUED)
        if queued:
            return trio.SocketStream(queued.popleft())
        stream = await original(self)
        raw = getattr(self.socket, "_sock", None)  # the listening stdlib socket
        if raw is not None:
            queued = self.__dict__.setdefault(_QUEUED, deque())
            for _ in range(ACCEPT_BURST):
                try:
                    sock, _ = raw.accept()
                except OSError:  # nothing queued (EAGAIN); any other error: the next accept
                    break
                queued.append(trio.socket.from_stdlib_socket(sock))
        return stream

    async def aclose(self: Any) -> None:
        for sock in self.__dict__.pop(_QUEUED, ()):
            sock.close()
        await original_close(self)

    setattr(accept, PATCHED, True)
    setattr(accept, ORIGINAL, original)
    setattr(aclose, ORIGINAL, original_close)
    trio.SocketListener.accept = accept  # type: ignore[method-assign]
    trio.SocketListener.aclose = aclose  # type: ignore[method-assign]
