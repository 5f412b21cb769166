"""pyzmq on trio: the one place a ZMQ socket meets the event loop.

A ZMQ socket is not a file descriptor; pyzmq exposes ``zmq.FD``, a descriptor that becomes
readable when the socket's state *changes* (edge-triggered), and ``zmq.EVENTS``, which says
what the socket can do now and, when read, resets that descriptor. pyzmq's rules for such a
descriptor (the ones its own asyncio and gevent integrations follow): try the operation
without blocking first; only when it would block, read ``zmq.EVENTS`` and wait on the
descriptor if the socket still cannot do it, since a message may have arrived, and consumed
the edge, between the try and the wait. Each socket has one task that waits on it (trio
refuses two waiters on one descriptor), and a socket is closed with ``close`` here so trio
wakes that task first (``notify_closing``).

Why this and not a thread per socket: a batch of KV events is a few kilobytes decoded in a
few microseconds; handing every one across a thread boundary would cost more than decoding
it, and a thread would need its own shutdown path. docs/upstream.md says the same for
operators.
"""

from __future__ import annotations

from typing import cast

import trio
import zmq

Frames = list[bytes]


async def recv_multipart(sock: zmq.Socket[bytes]) -> Frames:
    """The next whole message on ``sock``, waiting in trio while there is none."""
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        if _events(sock) & zmq.POLLIN:
            continue  # a message arrived between the try and the check: no edge will come
        await trio.lowlevel.wait_readable(_fd(sock))


def recv_ready(sock: zmq.Socket[bytes], limit: int) -> list[Frames]:
    """Every whole message ``sock`` holds now, at most ``limit`` of them, without waiting:
    a publisher that floods is read in bounded helpings between checkpoints."""
    out: list[Frames] = []
    while len(out) < limit:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            break
    return out


async def send_multipart(sock: zmq.Socket[bytes], frames: Frames) -> None:
    """Send ``frames``, waiting in trio while the socket is at its high-water mark (a PUB
    socket never waits: it drops, as ZMQ's PUB does)."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        if _events(sock) & zmq.POLLOUT:
            continue
        await trio.lowlevel.wait_readable(_fd(sock))


def close(sock: zmq.Socket[bytes]) -> None:
    """Close ``sock`` at once (no linger), waking a task that waits on it first."""
    if sock.closed:
        return
    trio.lowlevel.notify_closing(_fd(sock))
    sock.close(linger=0)


def _events(sock: zmq.Socket[bytes]) -> int:
    return cast(int, sock.getsockopt(zmq.EVENTS))


def _fd(sock: zmq.Socket[bytes]) -> int:
    return cast(int, sock.getsockopt(zmq.FD))
