"""The control channel between the parent of ``serve --workers N``
(``narwhal.process.workers``) and each worker (``narwhal.process.worker_process``): what a
worker is started with (``WorkerSpec``), the messages both sides send (``Message``), one
JSON line each, and the channel that carries them over one end of a socketpair, with its
bounds.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Literal

import msgspec
import trio

log = logging.getLogger("narwhal.workers")

SPEC_ENV = "NARWHAL_WORKER"  # a worker's WorkerSpec, as JSON
RELOAD_BOUND_S = 10.0  # a worker answers a reload within this, or is reported silent
SEND_BOUND_S = 5.0  # one control message; a peer that does not read is treated as gone
MAX_MESSAGE = 1 << 20


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker is started with (``SPEC_ENV``); the parent's copy has no fds."""

    index: int
    count: int
    config: str  # absolute path of the fleet file
    host: str
    port: int
    journal: str | None = None
    log_format: Literal["text", "json"] = "text"
    log_level: str = "info"
    certfile: str | None = None
    keyfile: str | None = None
    listen_fd: int = -1  # the worker's own listening socket (already listening)
    control_fd: int = -1  # its end of the control channel
    # [kv_events] mode = "listen": where the parent hands on every batch it receives
    kv_relay: str = ""

    @staticmethod
    def from_environment() -> WorkerSpec:
        return msgspec.json.decode(os.environ[SPEC_ENV], type=WorkerSpec)


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """One line of the control channel.

    worker -> parent: ``serving`` (started), ``reload`` (a POST asked; ``id`` is the
    worker's), ``reloaded`` (its answer to the parent's ``reload``: ``results`` holds one).
    parent -> worker: ``reload`` (``journal``: reopen it too), ``reload-done`` (every
    worker's answer to the worker's ``reload`` of that ``id``), ``stop`` (drain and exit).
    """

    op: Literal["serving", "reload", "reloaded", "reload-done", "stop"]
    id: int = 0
    journal: bool = False
    results: list[dict[str, Any]] = []


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Message).decode


class Channel:
    """JSON lines over one end of the control socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._buffer = bytearray()
        self._lock = trio.Lock()

    async def send(self, message: Message) -> bool:
        """False when the other side is gone, or does not read within ``SEND_BOUND_S``
        (the channel is closed then: a line cut in half is never followed by another)."""
        data = _encode(message) + b"\n"
        with trio.move_on_after(SEND_BOUND_S):
            async with self._lock:
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return False
                return True
        await self.aclose()
        return False

    async def receive(self) -> Message | None:
        """The next message; None once the other side is gone (or broke the protocol)."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                try:
                    return _decode(line)
                except msgspec.MsgspecError:
                    log.error("control channel: not a message: %r", line[:200])
                    return None
            if len(self._buffer) > MAX_MESSAGE:
                return None
            try:
                data = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._buffer += data

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):  # closing a socket does not block
            await self._stream.aclose()
