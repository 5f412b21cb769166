"""The client connection's send lock, and what a write without waiting left for the
request's task (``narwhal.frontdoor.connection``): a write the stream reactor's task began
may be finished, and its lock released, by the request's task."""

from __future__ import annotations

from enum import Enum

import trio


class Rest(Enum):
    """What a write without waiting (``write_nowait``) left for ``write_rest``."""

    NONE = "nothing"
    UNLOCKED = "all of it, through the send lock"  # the socket was busy: nothing written
    LOCKED = "the rest, the send lock held"  # the kernel took a part
    BROKEN = "nothing: the write broke"  # closed or reset: the stream is told at once


class SendLock:
    """A lock that any task may release (trio's ``Lock`` insists on its owner): the part
    of ``trio.Lock`` that ``ClientConnection`` uses for its writes."""

    def __init__(self) -> None:
        self._semaphore = trio.Semaphore(1, max_value=1)

    def locked(self) -> bool:
        return self._semaphore.value == 0

    def acquire_nowait(self) -> None:
        self._semaphore.acquire_nowait()

    def release(self) -> None:
        self._semaphore.release()

    async def __aenter__(self) -> None:
        await self._semaphore.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._semaphore.release()
