"""Reads and writes on a socket, for the paths where trio's stream methods cost a scheduler
trip or a failed syscall per call: the uncontended write to a client or an engine, the read
of a parked engine stream, the read that follows readiness. And the one list of errors that
mean a stream is gone, however it went.

**No descriptor number outlives a checkpoint** (docs/architecture.md, "Descriptors";
contract 8, invariant 13). A
socket may be closed by a task other than its reader (a client's connection by the app's
task after a ``Connection: close`` answer; an engine's by a drain or a shutdown), and the
kernel gives the freed number to the next socket the process opens. A number kept across a
wait then names another socket: its reader would take another connection's bytes. So every
function here takes the socket object, and the number is read from it afresh, with no
checkpoint between that read and the system call that uses it.

Only plain sockets: TLS and the tests' in-memory streams keep trio's stream methods (their
callers check for a socket first).
"""

from __future__ import annotations

import os
import struct
import termios
from collections.abc import Callable
from fcntl import ioctl
from typing import Protocol

import trio

# a stream closed by us (Closed), reset or half-closed by the peer (Broken), or an OSError
# from the descriptor itself (EPIPE, ECONNRESET, EBADF once closed)
STREAM_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)

wait_readable = trio.lowlevel.wait_readable
SIOCOUTQNSD = 0x894B  # linux/sockios.h: bytes in a socket's send queue not yet sent


class Socket(Protocol):
    """What these functions need of a socket: its descriptor now (-1 once closed). A trio
    socket and a stdlib socket both are one."""

    def fileno(self) -> int: ...


class Parkable(Socket, Protocol):
    """A socket a reader waits on outside trio's own wait (the stream reactor's epoll),
    where trio's ``close`` cannot wake it: whoever closes the socket calls
    ``before_close`` first, with the error that reader is to raise, and the reader ends
    its registration there, while the number is still this socket's."""

    before_close: Callable[[BaseException], None] | None


def write_nowait(sock: Socket, data: bytes | memoryview) -> int:
    """The bytes the kernel took now, 0 when its buffer is full. A closed socket, a reset or
    a broken pipe raise ``OSError``."""
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("socket was closed")
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


def read_nowait(sock: Socket, size: int) -> bytes | None:
    """What the kernel holds now (b"": the peer closed), None when nothing is there yet. A
    closed socket raises ``trio.ClosedResourceError``."""
    fd = sock.fileno()
    if fd < 0:
        raise trio.ClosedResourceError("socket was closed")
    try:
        return os.read(fd, size)
    except BlockingIOError:
        return None


async def read_when_ready(sock: Socket, size: int) -> bytes:
    """Wait until ``sock`` is readable, then read once (trio's ``receive_some`` tries the
    read first, which between tokens always fails: a syscall and an exception each).

    The wait is on the socket object and the read takes its number afresh: a socket closed
    by another task while this waited (trio's ``close`` wakes the wait with
    ``ClosedResourceError``), or between the wake-up and this task's next step (its number
    is -1 then, however soon the kernel reuses it), raises ``ClosedResourceError`` here and
    never reads the socket that took the number."""
    while True:
        if sock.fileno() < 0:
            raise trio.ClosedResourceError("socket was closed")
        await wait_readable(sock)
        data = read_nowait(sock, size)
        if data is not None:
            return data


def unread(sock: Socket) -> int:
    """Bytes the kernel holds from the peer, not yet read (0 once closed, or unknown)."""
    return _queued(sock, termios.FIONREAD) or 0


def unsent(sock: Socket) -> int | None:
    """Bytes the kernel holds for the peer, not yet sent (its window is full); 0 once
    closed, None when the kernel cannot say (not Linux)."""
    return _queued(sock, SIOCOUTQNSD)


def _queued(sock: Socket, request: int) -> int | None:
    if sock.fileno() < 0:
        return 0
    try:
        answer = ioctl(sock, request, b"\0" * 4)
    except OSError:
        return None
    return int(struct.unpack("i", answer)[0])
