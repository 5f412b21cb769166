"""Reads and writes on a socket's descriptor, for the paths where trio's stream methods
cost a scheduler trip or a failed syscall per call: the uncontended write to a client or an
engine, the read of a parked engine stream, the read that follows readiness. And the one
list of errors that mean a stream is gone, however it went.

Only plain sockets: TLS and the tests' in-memory streams keep trio's stream methods (their
callers check for a descriptor first).
"""

from __future__ import annotations

import os

import trio

# a stream closed by us (Closed), reset or half-closed by the peer (Broken), or an OSError
# from the descriptor itself (EPIPE, ECONNRESET, EBADF once closed)
STREAM_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


def write_nowait(fd: int, data: bytes | memoryview) -> int:
    """The bytes the kernel took now, 0 when its buffer is full. A closed socket (fd -1),
    a reset or a broken pipe raise ``OSError``."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def read_nowait(fd: int, size: int) -> bytes | None:
    """What the kernel holds now (b"": the peer closed), None when nothing is there yet."""
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None


async def read_when_ready(fd: int, size: int) -> bytes:
    """Wait until ``fd`` is readable, then read once (trio's ``receive_some`` tries the
    read first, which between tokens always fails: a syscall and an exception each)."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        data = read_nowait(fd, size)
        if data is not None:
            return data
