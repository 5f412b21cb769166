"""A loopback TCP proxy in front of one engine that holds chosen requests before they reach
it: the e2e tests' way to make a client leave "right after prefill" (the router's decode
leg held on its way to the consumer, so the consumer never sees it) or to age a handoff
past the KV lease (the prefill leg held on its way to the producer).

Requests are read one at a time per connection (the router's pooled keep-alive
connections, never pipelined; bodies with ``content-length``), and one whose
``x-request-id`` ends with a held suffix waits ``hold_s`` before it is forwarded. If the
router closes the connection while a request is held, the request is dropped unsent.
Responses are piped back unparsed. Threads, not trio: the e2e suite is synchronous.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

HEAD_LIMIT = 64 * 1024


class HoldProxy:
    def __init__(self, upstream_port: int, *, hold_suffixes: tuple[str, ...], hold_s: float):
        self.upstream_port = upstream_port
        self.hold_suffixes = hold_suffixes
        self.hold_s = hold_s
        self.held: list[str] = []  # request ids held
        self.dropped: list[str] = []  # ... whose client (the router) left during the hold
        self.forwarded: list[str] = []  # every request id that reached the engine
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _serve(self, down: socket.socket) -> None:
        up: socket.socket | None = None
        try:
            buffer = b""
            while True:
                request, buffer = _read_request(down, buffer)
                if request is None:
                    return
                rid = _request_id(request)
                if rid.endswith(self.hold_suffixes):
                    self._note(self.held, rid)
                    if _closed_within(down, self.hold_s):
                        self._note(self.dropped, rid)
                        return
                if up is None:
                    up = socket.create_connection(("127.0.0.1", self.upstream_port))
                    threading.Thread(target=_pipe, args=(up, down), daemon=True).start()
                self._note(self.forwarded, rid)
                up.sendall(request)
        except OSError:
            return
        finally:
            for s in (down, up):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()

    def _note(self, where: list[str], rid: str) -> None:
        with self._lock:
            where.append(rid)


def _read_request(sock: socket.socket, buffer: bytes) -> tuple[bytes | None, bytes]:
    """One whole request (head and ``content-length`` body) and what follows it."""
    while b"\r\n\r\n" not in buffer:
        if len(buffer) > HEAD_LIMIT:
            return None, b""
        data = sock.recv(65536)
        if not data:
            return None, b""
        buffer += data
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(rest) < length:
        data = sock.recv(65536)
        if not data:
            return None, b""
        rest += data
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def _request_id(request: bytes) -> str:
    for line in request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-request-id":
            return value.strip().decode("latin-1")
    return ""


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Wait ``seconds``; True as soon as the peer closes the connection."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if not sock.recv(1, socket.MSG_PEEK):
                    return True
            except OSError:
                return True
            return False  # the router never pipelines: more bytes now would be a bug of ours
    return False


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
