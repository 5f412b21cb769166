"""A listener that takes a burst of connections per wakeup of the accept loop.

``trio.serve_listeners`` accepts one connection per pass of trio's scheduler (``accept``
is a checkpoint). Under load a pass is long, so a burst of clients connecting at once
waits in the kernel's listen queue; past its size (``somaxconn``) the kernel drops
handshakes, and a client whose handshake is dropped too often sees its connection reset
before any response: no status code, nothing in the journal. ``BurstListener.accept``
takes up to ``ACCEPT_BURST`` more connections that are already queued, without waiting,
and hands them out on the next calls (closing them if the listener closes first).
Admitted requests then get the router's own answers (``max_inflight`` -> 429). Figures:
``bench/results/server-fixes.md``.

It is a ``trio.abc.Listener`` of its own around a ``trio.SocketListener``: only the
router's listeners take bursts; trio's class is untouched (a fake engine or any other
server in the same process sees stock trio). With ``--workers N`` each worker has a
listener of its own (``narwhal.process.workers``, ``SO_REUSEPORT``): a burst takes only
connections the kernel already gave that worker.
"""

from __future__ import annotations

import socket as stdlib_socket
from collections import deque

import trio

ACCEPT_BURST = 64  # connections taken from the kernel's queue per wakeup of the accept loop


class BurstListener(trio.abc.Listener[trio.SocketStream]):
    def __init__(self, sock: stdlib_socket.socket) -> None:
        """``sock``: a bound, listening stdlib socket, which this listener then owns."""
        self._listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        self._raw = sock  # the same descriptor, for the non-blocking burst
        self._queued: deque[trio.socket.SocketType] = deque()

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._listener.socket

    async def accept(self) -> trio.SocketStream:
        if self._queued:
            await trio.lowlevel.checkpoint()  # a Listener's accept is a checkpoint
            return trio.SocketStream(self._queued.popleft())
        stream = await self._listener.accept()
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = self._raw.accept()
            except OSError:  # nothing queued (EAGAIN); any other error: the next accept
                break
            self._queued.append(trio.socket.from_stdlib_socket(sock))
        return stream

    async def aclose(self) -> None:
        while self._queued:
            self._queued.popleft().close()
        await self._listener.aclose()
