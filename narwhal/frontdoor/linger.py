"""Lingering close: the one set of bounds on reading and dropping what a client still sends
after the router has answered and is about to close (contract 8, invariant 13: nginx's
``lingering_close``, with its ``lingering_time``, ``lingering_timeout`` and a cap on the
bytes).

Closing a TCP socket with unread bytes in its receive buffer makes the kernel send a reset,
and a reset destroys what the client has not read yet: the answer it was sent, when the
client is still writing its body (it meets the failed write first, or the reset overtakes
the answer in flight). So the router reads and drops what comes until the client's end, or
a bound, before it closes. Two layers use it: the connection, whose close lingers whenever
input may be unread (``narwhal.frontdoor.connection``), and the early HTTP/1.1 answers,
which read the rest of the body through the ASGI receive (``narwhal.frontdoor.answers``) so
that the request ends with its body read under any server.

The connection's ``_close`` half-closes after the answer (a FIN; TLS cannot, and goes on
without), then lingers where input may be unread: the client's end not read, and its
request not read to its end, a request pipelined behind or a head in part, or bytes waiting
in the socket. The closes that come there: the HTTP/2 refusal, the 400 or 413 that answers
what h11 refuses, and the end of a response that said ``connection: close`` (each a
``Closed`` from the protocol, which stops the read loop: the lingering close reads in its
task, the only reader); the idle timer and the shutdown; the end of the connection's
tasks. ``_abort``'s reset never lingers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import h11
import trio

from narwhal.lowlevel.fast_io import STREAM_GONE, unread

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


READ_SIZE = 2**16
# the client's request is not read to its end: its body, or a request h11 refused
_UNFINISHED = (h11.SEND_BODY, h11.ERROR)


async def half_close(stream: trio.abc.Stream) -> None:
    """Our end after what was written (a FIN): the client reads the answer whole, and knows
    no more comes, while the router may still read. TLS cannot half-close: it goes on."""
    with suppress(
        trio.BrokenResourceError,
        AttributeError,  # TLS: the stream cannot half-close
        trio.BusyResourceError,
        trio.ClosedResourceError,
    ):
        await stream.send_eof()  # type: ignore[attr-defined]


def unread_input(connection: Any, socket: Any) -> bool:
    """nginx's test for a lingering close, the client's end not being read yet: its request
    not read to its end by h11's ``connection`` (a body, a refused request, a head in part,
    a request pipelined behind), or bytes waiting in the TCP ``socket`` (None: a test's)."""
    if connection is not None:  # hypercorn's WebSocket wrapper has no states
        if getattr(connection, "their_state", None) in _UNFINISHED:
            return True
        if getattr(connection, "trailing_data", (b"",))[0]:
            return True
    return socket is not None and unread(socket) != 0


async def drop_a_read(stream: trio.abc.Stream) -> int | None:
    """One read of the lingering close, dropped: its size, None at the client's end."""
    try:
        data = await stream.receive_some(READ_SIZE)
    except (*STREAM_GONE, trio.BusyResourceError):  # Busy: a second reader, a bug
        return None
    return len(data) or None
