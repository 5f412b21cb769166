"""The ASGI surface (SPEC 3): routing, body limits, admission, and the client sink.

Served by hypercorn's trio worker. Everything here is about HTTP with the client; what a
request does with engines lives in ``Router.handle`` and ``RequestRun``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from functools import partial
from typing import Any, Protocol

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from narwhal.core.config import ConfigError, ServingConfig
from narwhal.core.faults import (
    BadRequest,
    BodyCut,
    BodyTimeout,
    HeadersTooLarge,
    Phase,
    RequestFault,
    TooLarge,
    error_json,
)
from narwhal.core.requests import parse_request
from narwhal.frontdoor.connection import FRAMING_ERROR, FRAMING_STATUS, REQUEST_ID, request_id
from narwhal.frontdoor.direct import DIRECT_BODY, ON_DISCONNECT, DirectBody
from narwhal.router.journal import Caller
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
# vLLM's own endpoints that benchmark clients and tool parsers call: passed through to one
# placeable engine (``Router.pass_through``), with a request id and a journal line each
_PASS_THROUGH_PATHS = ("/tokenize", "/detokenize")
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
# Lingering close (nginx's lingering_time / lingering_timeout): after an early answer with
# `connection: close`, the rest of the body is read and dropped, so the client's pending
# writes do not turn into a reset that destroys the answer before it is read.
LINGER_TIME_S = 10.0
LINGER_READ_TIMEOUT_S = 2.0
LINGER_MAX_BYTES = 64 * 1024 * 1024
_LOOPBACK = ("127.", "::1", "::ffff:127.")


class Disconnected(Exception):
    """The client went away before its request was read."""


class AsgiSink:
    """Client output for one request (where the response stands is the request's lifecycle).

    Under the front door (``DirectBody``, from the scope's extensions), the head goes out
    with the first chunk and the last chunk with the end, in one write each, and ``direct``
    is the write without the ASGI layers that the token path uses."""

    __slots__ = ("_direct", "_send", "rid")

    def __init__(self, send: Send, rid: bytes, direct: DirectBody | None = None) -> None:
        self._send = send
        self.rid = rid
        self._direct = direct

    async def commit(self, data: bytes) -> None:
        headers = [*_SSE_HEADERS, (b"x-request-id", self.rid)]
        await self._corked(
            {"type": "http.response.start", "status": 200, "headers": headers},
            {"type": "http.response.body", "body": data, "more_body": True},
        )

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    @property
    def direct(self) -> DirectBody | None:
        """The write to the connection without waiting (``narwhal.router.token_path``)."""
        return self._direct

    async def end(self, data: bytes = b"") -> None:
        await self._corked({"type": "http.response.body", "body": data, "more_body": False})

    async def cut(self, data: bytes, *, abandon: bool = False) -> None:
        """``data`` (the terminal event), then the body is cut: the response is never
        ended, so the connection closes without the chunked body's last chunk (SPEC 6) and
        a client that ignores error events still sees a failed transfer. ``abandon`` (the
        deadline or the drain gave up): the client is not waited for; what it has not taken
        is dropped with a reset (invariant 10)."""
        direct = self._direct
        if direct is None:
            await self.send(data)  # another server: the app's return without an end cuts it
            return
        done = direct.write_nowait(data) if abandon else None
        if done is False:  # the client is behind: nothing more is written to it
            direct.give_up()
            return
        if done is None:  # the ASGI path (bounded by the request's caller)
            await self.send(data)
        direct.cut(abandon=abandon)

    async def respond_json(self, status: int, body: bytes) -> None:
        headers = _json_headers(status, body, self.rid)
        await self._corked(
            {"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body},
        )

    def delivered(self) -> bool:
        """False once a write to the connection broke (the client reset or closed it): what
        was written since did not reach the client whole. The server swallows such a
        failure, so only the connection can tell. Off hypercorn's HTTP/1.1 stream a broken
        write raises instead, and this is True."""
        direct = self._direct
        return direct is None or direct.delivered()

    async def _corked(self, *messages: Message) -> None:
        """The messages through the ASGI send, their writes in one: the connection only
        collects the bytes until ``uncork``. The end's path has one checkpoint (hypercorn
        tells the app's receive of the disconnect) after the last bytes are collected: an
        exception there still sends them, as it would have uncorked."""
        direct = self._direct
        if direct is None:
            for message in messages:
                await self._send(message)
            return
        direct.cork()
        try:
            for message in messages:
                await self._send(message)
        except BaseException:
            direct.uncork_nowait()
            raise
        await direct.uncork()


def _json_headers(
    status: int,
    body: bytes,
    rid: bytes | None,
    extra: tuple[tuple[bytes, bytes], ...] = (),
    content_type: bytes = _JSON[1],
) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body)), *extra]
    if rid is not None:
        headers.append((b"x-request-id", rid))
    if status in (429, 503):
        headers.append((b"retry-after", RETRY_AFTER_S))
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


async def respond(
    send: Send, status: int, body: bytes, rid: bytes | None = None, content_type: bytes = _JSON[1]
) -> None:
    headers = _json_headers(status, body, rid, content_type=content_type)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def respond_and_close(
    receive: Receive,
    send: Send,
    status: int,
    body: bytes,
    rid: bytes | None = None,
    *,
    linger: bool = True,
    content_type: bytes = _JSON[1],
) -> None:
    """Answer with ``connection: close`` while the body may still be arriving, then linger.

    The whole answer goes out at once; the end of the response, which makes hypercorn close
    the connection, waits until the client's body is read and dropped (bounded by
    ``LINGER_*``). Closing with unread bytes in the socket would send a reset, and a client
    still writing its body then loses the answer unread (httpx's async client, aiohttp).
    After a framing error h11 never parses a byte of this connection as a new request.
    A body that trickles in too slowly (408) is not waited for again: ``linger=False``.
    """
    headers = _json_headers(status, body, rid, ((b"connection", b"close"),), content_type)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": linger})
    if linger:
        await _linger(receive)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _linger(receive: Receive) -> None:
    dropped = 0
    with trio.move_on_after(LINGER_TIME_S):
        while dropped <= LINGER_MAX_BYTES:
            with trio.move_on_after(LINGER_READ_TIMEOUT_S) as idle:
                message = await receive()
            if idle.cancelled_caught or message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


class WorkerGroup(Protocol):
    """This process is worker ``index`` of ``count`` (``serve --workers N``): what it knows
    of the others (``narwhal.workers.ParentLink``)."""

    index: int
    count: int

    async def reload_everywhere(self) -> tuple[int, bytes]:
        """``POST /narwhal/reload`` applied on every worker: (status, JSON body)."""
        ...


class RouterApp:
    def __init__(self, router: Router, workers: WorkerGroup | None = None) -> None:
        self.router = router
        self.workers = workers
        self.started = int(time.time())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await _refuse_websocket(receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    def max_request_bytes(self) -> int:
        """The body limit of the fleet file in force (a reload may change it); the
        connection refuses a chunk announced larger at once (``narwhal.frontdoor.connection``)."""
        return self.router.config.serving.max_request_bytes

    def connection_failed(self) -> None:
        """A client connection failed inside the server and was closed (its error boundary,
        ``narwhal.frontdoor.connection``, calls this)."""
        self.router.metrics.connection_errors.inc()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Startup opens the server-owned background nursery (probes); shutdown ends it."""
        router = self.router
        services = (
            router.health.run,  # the first round of checks before the server starts
            router.discovery.run,  # [[discover]] names
            router.client.sweep_forever,
            router.reclaimer.run,
            router.scraper.run,  # engines' /metrics
            router.reactor.run,  # parked streams
        )
        async with trio.open_nursery() as background:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await background.start(router.background.run, services)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    background.cancel_scope.cancel()
                    break
        await self.router.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method, headers = scope["path"], scope["method"], scope["headers"]
        completion = path in _COMPLETION_PATHS
        passed = path in _PASS_THROUGH_PATHS
        # the id may be given already: by the server, answering a body it cannot frame
        rid = scope.setdefault(REQUEST_ID, request_id(scope)) if completion or passed else None
        problem = _headers_problem(headers) or _framing_problem(headers)
        if problem is not None:
            self._journal_refusal(rid, path, problem.status, problem.message, scope)
            await respond_and_close(receive, send, problem.status, problem.error_json(), rid)
            return
        if path.startswith("/narwhal/"):
            refusal = self._admin_refusal(scope)
            if refusal is not None:
                body = error_json(403, refusal, "permission_error")
                await _answer_unread(scope, receive, send, 403, body)
                return
        elif path not in _OPEN_PATHS and not self.router.api_keys.allows(headers):
            message = "missing or invalid API key"
            self._journal_refusal(rid, path, 401, message, scope)
            body = error_json(401, message, "authentication_error")
            await _answer_unread(scope, receive, send, 401, body, rid)
            return
        if completion and method == "POST":
            assert rid is not None
            await self._completion(path, scope, receive, send, rid)
            return
        if passed and method == "POST":
            assert rid is not None
            await self._pass_through(path, scope, receive, send, rid)
            return
        if (method, path) == ("POST", "/narwhal/lifecycle/readmit"):
            await self._readmit_wave(receive, send)
            return
        complete = await _finish_reading(scope, receive)  # nothing below reads a body
        if method == "POST" and path.startswith("/narwhal/") and not complete:
            # an admin action happens for a whole request only, not for one still arriving
            message = "an admin request's body must be empty or small, and complete"
            body = error_json(413, message, "request_too_large")
            await _answer_read(receive, send, 413, body, rid, complete)
            return
        if (method, path) == ("POST", "/narwhal/reload") and self.workers is not None:
            status, body = await self.workers.reload_everywhere()  # every worker has answered
            await _answer_read(receive, send, status, body, rid, complete)
            return
        status, body, content_type = self._answer(method, path)
        await _answer_read(receive, send, status, body, rid, complete, content_type)

    def _answer(self, method: str, path: str) -> tuple[int, bytes, bytes]:
        """Every endpoint that reads no body: (status, body, content type)."""
        router = self.router
        if path in _COMPLETION_PATHS or path in _PASS_THROUGH_PATHS:
            return 405, error_json(405, f"{path} takes POST", "method_not_allowed"), _JSON[1]
        if (method, path) == ("POST", "/narwhal/reload"):
            try:
                change = router.reload_file()
            except ConfigError as exc:
                body = error_json(400, exc.render(), "invalid_fleet_file", problems=exc.problems)
                return 400, body, _JSON[1]
            return 200, msgspec.json.encode(change), _JSON[1]
        if method not in ("GET", "HEAD"):  # HEAD: hypercorn sends the head of the GET answer
            return 404, _not_found(method, path), _JSON[1]
        maintenance = router.health.maintenance
        if path == "/health":
            status = b"maintenance" if maintenance else b"ok"
            return 200, b'{"status":"%s"}' % status, _JSON[1]
        if path == "/ready":
            if router.draining:
                return 503, b'{"status":"draining"}', _JSON[1]
            if not maintenance and router.fleet.ready(trio.current_time()):
                return 200, b'{"status":"ready"}', _JSON[1]
            state = b"maintenance" if maintenance else b"no healthy producer or consumer"
            return 503, b'{"status":"%s"}' % state, _JSON[1]
        if path == "/v1/models":
            card = {
                "id": router.config.model,
                "object": "model",
                "created": self.started,
                "owned_by": "narwhal",
            }
            return 200, msgspec.json.encode({"object": "list", "data": [card]}), _JSON[1]
        if path == "/metrics":
            router.health.refresh_gauges()
            return 200, router.metrics.render(), CONTENT_TYPE_LATEST.encode()
        if path == "/narwhal/engines":
            return 200, self._engines_view(), _JSON[1]
        return 404, _not_found(method, path), _JSON[1]

    def _engines_view(self) -> bytes:
        """The engines as this process sees them, and which process that is: each worker
        of ``--workers N`` keeps its own breakers and in-flight counts."""
        group = self.workers
        worker = {
            "index": group.index if group else 0,
            "of": group.count if group else 1,
            "pid": os.getpid(),
        }
        return msgspec.json.encode(
            {"worker": worker, **msgspec.json.decode(self.router.engines_view())}
        )

    def _admin_refusal(self, scope: Scope) -> str | None:
        """SPEC 3: admin keys alone open ``/narwhal/*``; without them, loopback peers only."""
        admin = self.router.admin_keys
        if admin.required:
            if admin.allows(scope["headers"]):
                return None
            return "admin endpoint: needs an admin key (serving.admin_keys_env)"
        client = scope.get("client")
        if client and str(client[0]).startswith(_LOOPBACK):
            return None
        return "admin endpoint: loopback only when serving.admin_keys_env is not set"

    def _journal_refusal(
        self, rid: bytes | None, path: str, status: int, message: str, scope: Scope
    ) -> None:
        """A completion request (it has an id) refused before admission is journaled."""
        if rid is not None:
            self.router.admission.received += 1
            caller = self._caller(scope)
            self.router.journal_unadmitted(rid.decode(), path, "rejected", status, message, caller)

    def _caller(self, scope: Scope) -> Caller:
        """Who sent the request, for its journal line (the key by a hash only)."""
        peer = scope.get("client")
        client = f"{peer[0]}:{peer[1]}" if peer else None
        return Caller(client=client, key=self.router.api_keys.key_id(scope["headers"]))

    async def _admit(
        self, path: str, scope: Scope, receive: Receive, send: Send, rid: bytes
    ) -> bytes | None:
        """A request to a completion or tokenizer endpoint, counted, read and admitted: its
        body; None when it was refused (answered and journaled) or its client left."""
        self.router.admission.received += 1
        try:
            return await self._admitted_body(scope, receive)
        except Disconnected:
            self._left_mid_body(scope, rid.decode(), path, self._caller(scope))
        except RequestFault as fault:
            await self._refuse(fault, scope, receive, send, rid, path, self._caller(scope))
        return None

    async def _admitted_body(self, scope: Scope, receive: Receive) -> bytes:
        """The body of a request to admit: read within the limits, then refused (a
        RequestFault) while draining, in maintenance or at ``max_inflight``."""
        router = self.router
        serving = router.config.serving
        with router.drain_bound() as drain:  # a trickling body does not outlive the drain
            raw = await _read_body_within(scope, receive, serving)
        if drain.cancelled_caught:
            raise BodyCut(
                "router shutting down: the request body was still arriving when the "
                "graceful timeout ended",
                phase=Phase.ADMISSION,
            )
        router.admission.check(
            serving, draining=router.draining, maintenance=router.health.maintenance
        )
        return raw

    def _left_mid_body(self, scope: Scope, rid: str, path: str, caller: Caller) -> None:
        if not _journal_framing(self.router, scope, rid, path, caller):
            left = "client left mid-body"
            self.router.journal_unadmitted(rid, path, "cancelled", None, left, caller)

    async def _refuse(
        self,
        fault: RequestFault,
        scope: Scope,
        receive: Receive,
        send: Send,
        rid: bytes,
        path: str,
        caller: Caller,
    ) -> None:
        """Journal and answer a request refused before admission."""
        rid_text = rid.decode()
        if _journal_framing(self.router, scope, rid_text, path, caller):
            return  # the server's answer went first (a body can break both ways at once)
        self.router.journal_unadmitted(
            rid_text, path, "rejected", fault.status, fault.message, caller
        )
        if isinstance(fault, TooLarge | BodyTimeout | BodyCut):  # the body is arriving
            slow = isinstance(fault, BodyTimeout | BodyCut)
            body = fault.error_json()
            await respond_and_close(receive, send, fault.status, body, rid, linger=not slow)
        else:
            await respond(send, fault.status, fault.error_json(), rid)

    async def _completion(
        self, path: str, scope: Scope, receive: Receive, send: Send, rid: bytes
    ) -> None:
        router = self.router
        serving = router.config.serving
        admitted = await self._admit(path, scope, receive, send, rid)
        if admitted is None:
            return
        try:
            req = parse_request(
                admitted, endpoint=path, model=router.config.model, max_fanout=serving.max_fanout
            )
        except RequestFault as fault:
            await self._refuse(fault, scope, receive, send, rid, path, self._caller(scope))
            return
        rid_text, caller = rid.decode(), self._caller(scope)
        extensions = scope.get("extensions") or {}  # the server's features (ASGI's channel)
        await router.handle(
            req,
            rid_text,
            AsgiSink(send, rid, extensions.get(DIRECT_BODY)),
            partial(_wait_disconnect, receive),
            caller,
            scope["headers"],
            extensions.get(ON_DISCONNECT),
        )

    async def _pass_through(
        self, path: str, scope: Scope, receive: Receive, send: Send, rid: bytes
    ) -> None:
        """``POST /tokenize`` and ``/detokenize``: admitted like a completion (key, body
        limit, ``max_inflight``), then the body goes unchanged to one engine."""
        router = self.router
        raw = await self._admit(path, scope, receive, send, rid)
        if raw is None:
            return
        answer = await router.pass_through(
            path,
            raw,
            rid.decode(),
            self._caller(scope),
            scope["headers"],
            partial(_wait_disconnect, receive),
        )
        if answer is not None:  # None: the client left
            await respond(send, answer[0], answer[1], rid)

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


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _refuse_websocket(receive: Receive, send: Send) -> None:
    """A WebSocket upgrade gets a plain 400 (hypercorn's ``websocket.http.response``)."""
    await receive()  # websocket.connect
    body = error_json(400, "websocket: not served here; the API is plain HTTP")
    headers = _json_headers(400, body, None, ((b"connection", b"close"),))
    await send({"type": "websocket.http.response.start", "status": 400, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


async def _answer_unread(
    scope: Scope, receive: Receive, send: Send, status: int, body: bytes, rid: bytes | None = None
) -> None:
    """An answer that uses no body: a small one is read first so the connection is kept."""
    complete = await _finish_reading(scope, receive)
    await _answer_read(receive, send, status, body, rid, complete)


async def _answer_read(
    receive: Receive,
    send: Send,
    status: int,
    body: bytes,
    rid: bytes | None,
    complete: bool,
    content_type: bytes = _JSON[1],
) -> None:
    """Keep the connection when the body was read to its end, else close it, lingering."""
    if complete:
        await respond(send, status, body, rid, content_type)
    else:
        await respond_and_close(receive, send, status, body, rid, content_type=content_type)


def _not_found(method: str, path: str) -> bytes:
    return error_json(404, f"no such endpoint: {method} {path}", "not_found_error")


class _WaveRequest(msgspec.Struct):
    engines: list[str]


async def _error(
    send: Send, status: int, kind: str, message: str, rid: bytes | None = None
) -> None:
    await respond(send, status, error_json(status, message, kind), rid)


def _headers_problem(headers: list[tuple[bytes, bytes]]) -> HeadersTooLarge | None:
    if len(headers) > MAX_HEADERS:
        message = f"request has {len(headers)} header fields; at most {MAX_HEADERS}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    size = sum(len(name) + len(value) for name, value in headers)
    if size > MAX_HEADER_BYTES:
        message = f"request headers hold {size} bytes; at most {MAX_HEADER_BYTES}"
        return HeadersTooLarge(message, phase=Phase.ADMISSION)
    return None


async def _finish_reading(scope: Scope, receive: Receive) -> bool:
    """Read (and drop) a small body we answer without using, so the client's kept-alive
    connection can carry its next request: hypercorn closes a connection whose request was
    not read to its end when the answer is, and our writes do not wait for its read loop
    to catch up. False when a bigger or slower body is still arriving (the answer then
    closes the connection, lingering)."""
    with trio.move_on_after(DISCARD_TIMEOUT_S), suppress(Disconnected, RequestFault):
        await _read_body(scope, receive, DISCARD_LIMIT)
        return True
    return False


def _framing_problem(headers: list[tuple[bytes, bytes]]) -> BadRequest | None:
    """RFC 9112 6.1: a request with both lengths is a smuggling shape; refuse it rather than
    pick a framing, and close the connection (``respond_and_close``)."""
    names = {name for name, _ in headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        return BadRequest(
            "transfer-encoding: not allowed together with content-length", "transfer-encoding"
        )
    return None


def _journal_framing(
    router: Router, scope: Scope, rid: str, path: str, caller: Caller | None
) -> bool:
    """When the server answered the request's body itself (malformed: 400; a chunk
    announced past the limit: 413) and closed, journal that answer; False: it did not."""
    framing = scope.get(FRAMING_ERROR)
    if not framing:
        return False
    status = scope.get(FRAMING_STATUS, 400)
    router.journal_unadmitted(rid, path, "rejected", status, framing, caller)
    return True


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
