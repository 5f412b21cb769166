"""Lingering close: the one set of bounds on reading and dropping what a client still sends
after the router has answered and is about to close (nginx's ``lingering_close``, with its
``lingering_time``, ``lingering_timeout`` and a cap on the bytes).

Closing a TCP socket with unread bytes in its receive buffer makes the kernel send a reset,
and a reset destroys what the client has not read yet: the answer it was sent, when the
client is still writing its body (it meets the failed write first, or the reset overtakes
the answer in flight). So the router reads and drops what comes until the client's end, or
a bound, before it closes. Two layers use it: the connection, whose close lingers whenever
input may be unread (``narwhal.frontdoor.connection``), and the early HTTP/1.1 answers,
which read the rest of the body through the ASGI receive (``narwhal.frontdoor.answers``) so
that the request ends with its body read under any server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

LINGER_TIME_S = 10.0  # the most time spent reading and dropping (nginx's lingering_time)
LINGER_READ_TIMEOUT_S = 2.0  # the most silence waited for in one read (lingering_timeout)
LINGER_MAX_BYTES = 64 * 1024 * 1024  # the most bytes read and dropped


async def discard(read: Callable[[], Awaitable[int | None]]) -> None:
    """Call ``read`` until the input ends or a bound is passed. ``read`` takes one piece of
    the input and drops it: it returns the bytes it dropped, None once the input has ended
    (or broken). Every wait is under a cancel scope: it returns within ``LINGER_TIME_S``."""
    dropped = 0
    with trio.move_on_after(LINGER_TIME_S):
        while dropped <= LINGER_MAX_BYTES:
            with trio.move_on_after(LINGER_READ_TIMEOUT_S) as silent:
                size = await read()
            if silent.cancelled_caught or size is None:
                return
            dropped += size
