"""The ASGI surface (SPEC 3): routing, body limits, admission, and the client sink.

Served by hypercorn's trio worker. Everything here is about HTTP with the client; what a
request does with engines lives in ``Router.handle`` and ``RequestRun``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from typing import Any

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from narwhal.config import ConfigError, ServingConfig
from narwhal.faults import (
    BodyTimeout,
    HeadersTooLarge,
    Maintenance,
    Overloaded,
    Phase,
    RequestFault,
    ShuttingDown,
    TooLarge,
)
from narwhal.router.requests import BadRequest, parse_request
from narwhal.router.service import Router

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# liveness, readiness and scrapes stay open to the platform; everything else needs a key
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
RETRY_AFTER_S = b"1"
# More header fields, or header bytes, than any OpenAI client sends. Hypercorn's h11 buffer
# limit only catches a header block still incomplete past 64 KiB, so a bigger block that
# arrives in two reads gets through; and it has no bound on the number of fields.
MAX_HEADERS = 100
MAX_HEADER_BYTES = 32 * 1024
DISCARD_LIMIT = 64 * 1024  # the most of an unused body read to keep its connection
DISCARD_TIMEOUT_S = 1.0


class Disconnected(Exception):
    """The client went away before its request was read."""


class AsgiSink:
    """Client output for one request; ``committed`` flips when 200 headers go out."""

    __slots__ = ("_send", "committed", "finished", "rid")

    def __init__(self, send: Send, rid: bytes) -> None:
        self._send = send
        self.rid = rid
        self.committed = False
        self.finished = False

    async def commit(self, data: bytes) -> None:
        self.committed = True
        headers = [*_SSE_HEADERS, (b"x-request-id", self.rid)]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def respond_json(self, status: int, body: bytes) -> None:
        self.committed = self.finished = True
        await respond(self._send, status, body, self.rid)


async def respond(send: Send, status: int, body: bytes, rid: bytes | None = None) -> None:
    headers = [_JSON, (b"content-length", b"%d" % len(body))]
    if rid is not None:
        headers.append((b"x-request-id", rid))
    if status in (429, 503):
        headers.append((b"retry-after", RETRY_AFTER_S))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_json(fault: RequestFault) -> bytes:
    return msgspec.json.encode({"error": fault.error_body()})


class RouterApp:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.started = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Startup opens the server-owned background nursery (probes); shutdown ends it."""
        async with trio.open_nursery() as background:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await background.start(self.router.health.run)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    background.cancel_scope.cancel()
                    break
        await self.router.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        too_large = _headers_problem(scope["headers"])
        if too_large is not None:
            await respond(send, too_large.status, error_json(too_large))
            return
        if path not in _OPEN_PATHS and not self.router.api_keys.allows(scope["headers"]):
            if path in _COMPLETION_PATHS:
                self.router.received += 1
                self.router.journal_unadmitted(
                    secrets.token_hex(8), path, "rejected", 401, "missing or invalid API key"
                )
            await _finish_reading(scope, receive)
            await _error(send, 401, "authentication_error", "missing or invalid API key")
            return
        if path in _COMPLETION_PATHS and method == "POST":
            await self._completion(path, scope, receive, send)
            return
        router = self.router
        if (method, path) == ("POST", "/narwhal/lifecycle/readmit"):
            await self._readmit_wave(receive, send)
            return
        await _finish_reading(scope, receive)  # nothing below reads a body
        if path in _COMPLETION_PATHS:
            await _error(send, 405, "method_not_allowed", f"{path} takes POST")
            return
        if (method, path) == ("POST", "/narwhal/reload"):
            try:
                change = router.reload_file()
            except ConfigError as exc:
                error = {
                    "error": {
                        "message": exc.render(),
                        "type": "invalid_fleet_file",
                        "param": None,
                        "code": 400,
                        "problems": exc.problems,
                    }
                }
                await respond(send, 400, msgspec.json.encode(error))
                return
            await respond(send, 200, msgspec.json.encode(change))
            return
        if method != "GET":
            await _error(send, 404, "not_found_error", f"no such endpoint: {method} {path}")
            return
        maintenance = router.health.maintenance
        if path == "/health":
            status = b"maintenance" if maintenance else b"ok"
            await respond(send, 200, b'{"status":"%s"}' % status)
        elif path == "/ready":
            if router.draining:
                await respond(send, 503, b'{"status":"draining"}')
            elif not maintenance and router.fleet.ready(trio.current_time()):
                await respond(send, 200, b'{"status":"ready"}')
            else:
                state = b"maintenance" if maintenance else b"no healthy producer or consumer"
                await respond(send, 503, b'{"status":"%s"}' % state)
        elif path == "/v1/models":
            card = {
                "id": router.config.model,
                "object": "model",
                "created": self.started,
                "owned_by": "narwhal",
            }
            await respond(send, 200, msgspec.json.encode({"object": "list", "data": [card]}))
        elif path == "/metrics":
            router.health.refresh_gauges()
            body = router.metrics.render()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
        elif path == "/narwhal/engines":
            await respond(send, 200, router.engines_view())
        else:
            await _error(send, 404, "not_found_error", f"no such endpoint: {method} {path}")

    async def _completion(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        router = self.router
        router.received += 1
        rid_text = secrets.token_hex(8)
        rid = rid_text.encode()
        serving = router.config.serving
        try:
            raw = await _read_body_within(scope, receive, serving)
            if router.draining:
                raise ShuttingDown(
                    "router shutting down: not taking new requests", phase=Phase.ADMISSION
                )
            if router.health.maintenance:
                raise Maintenance(
                    "router in maintenance (whole-wave restart): an engine was ejected; "
                    "POST /narwhal/lifecycle/readmit once the fleet is back",
                    phase=Phase.ADMISSION,
                )
            if router.admitted >= serving.max_inflight:
                raise Overloaded(
                    f"router is at max_inflight={serving.max_inflight}; retry later",
                    phase=Phase.ADMISSION,
                )
            req = parse_request(raw, endpoint=path, model=router.config.model)
        except Disconnected:
            router.journal_unadmitted(rid_text, path, "cancelled", None, "client left mid-body")
            return
        except RequestFault as fault:
            router.journal_unadmitted(rid_text, path, "rejected", fault.status, fault.message)
            await respond(send, fault.status, error_json(fault), rid)
            return

        async def wait_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        await router.handle(req, rid_text, AsgiSink(send, rid), wait_disconnect)

    async def _readmit_wave(self, receive: Receive, send: Send) -> None:
        """Validate the whole engine set together (whole-wave policy's way back)."""
        health = self.router.health
        try:
            raw = await _read_body({"headers": []}, receive, 64 * 1024)
        except (Disconnected, RequestFault):
            return
        fleet_ids = sorted(e.id for e in self.router.fleet.engines)
        if raw.strip():
            try:
                named = msgspec.json.decode(raw, type=_WaveRequest).engines
            except (msgspec.MsgspecError, RecursionError) as exc:
                await _error(send, 400, "invalid_request_error", f"engines: {exc}")
                return
            if sorted(named) != fleet_ids:
                await _error(
                    send,
                    400,
                    "invalid_request_error",
                    f"engines: a wave is the whole engine set {fleet_ids}, got {sorted(named)}",
                )
                return
        outcomes = await health.readmit_wave()
        body = {"maintenance": health.maintenance, "engines": outcomes}
        await respond(send, 409 if health.maintenance else 200, msgspec.json.encode(body))


class _WaveRequest(msgspec.Struct):
    engines: list[str]


async def _error(
    send: Send, status: int, kind: str, message: str, rid: bytes | None = None
) -> None:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    await respond(send, status, msgspec.json.encode(body), rid)


def _headers_problem(headers: list[tuple[bytes, bytes]]) -> HeadersTooLarge | None:
    if len(headers) > MAX_HEADERS:
        message = f"request has {len(headers)} header fields; at most {MAX_HEADERS}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        message = f"request headers hold {size} bytes; at most {MAX_HEADER_BYTES}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    return None


async def _finish_reading(scope: Scope, receive: Receive) -> None:
    """Read (and drop) a small body we answer without using, so the client's kept-alive
    connection can carry its next request: hypercorn closes a connection whose request was
    not read to its end when the answer is, and our writes do not wait for its read loop
    to catch up. A bigger or slower body is left unread (hypercorn then closes)."""
    with trio.move_on_after(DISCARD_TIMEOUT_S), suppress(Disconnected, RequestFault):
        await _read_body(scope, receive, DISCARD_LIMIT)


async def _read_body_within(scope: Scope, receive: Receive, serving: ServingConfig) -> bytes:
    """The body, or 408 when it trickles in slower than ``client_body_timeout_s``."""
    with trio.move_on_after(serving.client_body_timeout_s):
        return await _read_body(scope, receive, serving.max_request_bytes)
    raise BodyTimeout(
        f"request body not received within client_body_timeout_s="
        f"{serving.client_body_timeout_s:g}s",
        phase=Phase.ADMISSION,
    )


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """At most ``limit`` bytes plus one received chunk are read before a 413."""
    names = [name for name, _ in scope["headers"]]
    if b"transfer-encoding" in names and b"content-length" in names:
        # RFC 9112 6.3: a request smuggling shape; refuse it rather than pick a framing
        raise BadRequest(
            "transfer-encoding: not allowed together with content-length", "transfer-encoding"
        )
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise BadRequest("content-length: not a number", "content-length")
            if int(value) > limit:
                raise TooLarge(
                    f"body of {int(value)} bytes exceeds max_request_bytes={limit}",
                    phase=Phase.ADMISSION,
                )
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"body exceeds max_request_bytes={limit}", phase=Phase.ADMISSION)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
