"""The router's ASGI app (contract 3): routing, auth and the admin rule, admission, and the
endpoints' answers. The sink, early answers and lingering close, and body reading are the
front door's (``narwhal.frontdoor.answers``); what a request does with engines lives in
``Router.handle`` and ``RequestRun``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any, Protocol

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from narwhal.core.config import ConfigError
from narwhal.core.faults import (
    BadRequest,
    BodyCut,
    BodyTimeout,
    Forbidden,
    InvalidFleetFile,
    MethodNotAllowed,
    NoSuchEndpoint,
    Phase,
    RequestFault,
    TooLarge,
    Unauthorized,
)
from narwhal.core.flow_class import classify
from narwhal.core.requests import parse_request
from narwhal.frontdoor.answers import (
    JSON_TYPE,
    AsgiSink,
    Disconnected,
    Receive,
    Scope,
    Send,
    answer_read,
    answer_unread,
    body_too_slow,
    finish_reading,
    framing_problem,
    headers_problem,
    read_body,
    refuse_websocket,
    respond,
    respond_and_close,
)
from narwhal.frontdoor.direct import DIRECT_BODY, ON_DISCONNECT
from narwhal.frontdoor.http11 import FRAMING_ERROR, FRAMING_STATUS, REQUEST_ID, request_id
from narwhal.router.journal import Caller
from narwhal.router.service import Router

_COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# vLLM's own endpoints that benchmark clients and tool parsers call: passed through to one
# placeable engine (``narwhal.router.pass_through``), with a request id and a journal line each
_PASS_THROUGH_PATHS = ("/tokenize", "/detokenize")
# liveness, readiness and scrapes stay open to the platform; everything else needs a key
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_LOOPBACK = ("127.", "::1", "::ffff:127.")


class WorkerGroup(Protocol):
    """This process is worker ``index`` of ``count`` (``serve --workers N``): what it knows
    of the others (``narwhal.process.worker_process.ParentLink``)."""

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

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        """The coroutine that serves ``scope``, returned rather than awaited, as every
        dispatch below: the server awaits it, and a held stream's task keeps no frame of
        the routing (bench/results/request-machine)."""
        kind = scope["type"]
        if kind == "http":
            return self._route(scope, receive, send)
        if kind == "websocket":
            return refuse_websocket(receive, send)
        if kind == "lifespan":
            return self._lifespan(receive, send)
        return _nothing()

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
            router.kv_subscriber.run,  # engines' KV events
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

    def _route(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        """The coroutine that answers an HTTP request: its refusal, or its endpoint's."""
        path, method, headers = scope["path"], scope["method"], scope["headers"]
        completion = path in _COMPLETION_PATHS
        passed = path in _PASS_THROUGH_PATHS
        # the id may be given already: by the server, answering a body it cannot frame
        rid = scope.setdefault(REQUEST_ID, request_id(scope)) if completion or passed else None
        problem = headers_problem(headers) or framing_problem(headers)
        if problem is not None:
            self._journal_refusal(rid, path, problem, scope)
            return respond_and_close(receive, send, problem.status, problem.error_json(), rid)
        if path.startswith("/narwhal/"):
            refusal = self._admin_refusal(scope)
            if refusal is not None:
                return answer_unread(scope, receive, send, refusal.status, refusal.error_json())
        elif path not in _OPEN_PATHS and not self.router.api_keys.allows(headers):
            unknown = Unauthorized()
            self._journal_refusal(rid, path, unknown, scope)
            return answer_unread(scope, receive, send, unknown.status, unknown.error_json(), rid)
        if completion and method == "POST":
            assert rid is not None
            return self._completion(path, scope, receive, send, rid)
        if passed and method == "POST":
            assert rid is not None
            return self._pass_through(path, scope, receive, send, rid)
        if (method, path) == ("POST", "/narwhal/lifecycle/readmit"):
            return self._readmit_wave(receive, send)
        return self._bodiless(scope, receive, send, rid)

    async def _bodiless(
        self, scope: Scope, receive: Receive, send: Send, rid: bytes | None
    ) -> None:
        """An endpoint that reads no body: the body is read to its end and dropped."""
        method, path = scope["method"], scope["path"]
        complete = await finish_reading(scope, receive)  # nothing below reads a body
        if method == "POST" and path.startswith("/narwhal/") and not complete:
            # an admin action happens for a whole request only, not for one still arriving
            message = "an admin request's body must be empty or small, and complete"
            too_large = TooLarge(message, phase=Phase.ADMISSION)
            await answer_read(
                receive, send, too_large.status, too_large.error_json(), rid, complete
            )
            return
        if (method, path) == ("POST", "/narwhal/reload") and self.workers is not None:
            status, body = await self.workers.reload_everywhere()  # every worker has answered
            await answer_read(receive, send, status, body, rid, complete)
            return
        status, body, content_type = self._answer(method, path)
        await answer_read(receive, send, status, body, rid, complete, content_type)

    def _answer(self, method: str, path: str) -> tuple[int, bytes, bytes]:
        """Every endpoint that reads no body: (status, body, content type)."""
        router = self.router
        if path in _COMPLETION_PATHS or path in _PASS_THROUGH_PATHS:
            return _as_answer(MethodNotAllowed(path))
        if (method, path) == ("POST", "/narwhal/reload"):
            try:
                change = router.reload_file()
            except ConfigError as exc:
                return _as_answer(InvalidFleetFile(exc))
            return 200, msgspec.json.encode(change), JSON_TYPE
        if method not in ("GET", "HEAD"):  # HEAD: hypercorn sends the head of the GET answer
            return _as_answer(NoSuchEndpoint(method, path))
        maintenance = router.health.maintenance
        if path == "/health":
            status = b"maintenance" if maintenance else b"ok"
            return 200, b'{"status":"%s"}' % status, JSON_TYPE
        if path == "/ready":
            if router.draining:
                return 503, b'{"status":"draining"}', JSON_TYPE
            if not maintenance and router.fleet.ready(trio.current_time()):
                return 200, b'{"status":"ready"}', JSON_TYPE
            state = b"maintenance" if maintenance else b"no healthy producer or consumer"
            return 503, b'{"status":"%s"}' % state, JSON_TYPE
        if path == "/v1/models":
            return 200, msgspec.json.encode(router.models_view(self.started)), JSON_TYPE
        if path == "/metrics":
            router.health.refresh_gauges()
            return 200, router.metrics.render(), CONTENT_TYPE_LATEST.encode()
        if path == "/narwhal/engines":
            return 200, self._engines_view(), JSON_TYPE
        return _as_answer(NoSuchEndpoint(method, path))

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

    def _admin_refusal(self, scope: Scope) -> Forbidden | None:
        """contract 3: admin keys alone open ``/narwhal/*``; without them, loopback peers only."""
        admin = self.router.admin_keys
        if admin.required:
            if admin.allows(scope["headers"]):
                return None
            return Forbidden("admin endpoint: needs an admin key (serving.admin_keys_env)")
        client = scope.get("client")
        if client and str(client[0]).startswith(_LOOPBACK):
            return None
        return Forbidden("admin endpoint: loopback only when serving.admin_keys_env is not set")

    def _journal_refusal(
        self, rid: bytes | None, path: str, fault: RequestFault, scope: Scope
    ) -> None:
        """A completion request (it has an id) refused before admission is journaled."""
        if rid is not None:
            self.router.admission.received += 1
            caller = self._caller(scope)
            self.router.journal_unadmitted(
                rid.decode(), path, "rejected", fault.status, fault.message, caller
            )

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
            return await self._admitted_body(path, scope, receive)
        except Disconnected:
            self._left_mid_body(scope, rid.decode(), path, self._caller(scope))
        except RequestFault as fault:
            await self._refuse(fault, scope, receive, send, rid, path, self._caller(scope))
        return None

    async def _admitted_body(self, path: str, scope: Scope, receive: Receive) -> bytes:
        """The body of a request to admit: read within the limits, then refused (a
        RequestFault) while draining, in maintenance or at ``max_inflight``."""
        router = self.router
        serving = router.config.serving
        # one scope for the body's timeout and the drain: a trickling body outlives neither
        with router.drain_bound(trio.current_time() + serving.client_body_timeout_s) as bound:
            raw = await read_body(scope, receive, serving.max_request_bytes)
        if bound.scope.cancelled_caught:
            if not bound.drained(router.drain_deadline):
                raise body_too_slow(serving)
            raise BodyCut(
                "router shutting down: the request body was still arriving when the "
                "graceful timeout ended",
                phase=Phase.ADMISSION,
            )
        router.admission.check(
            serving,
            draining=router.draining,
            maintenance=router.health.maintenance,
            queues=path not in _PASS_THROUGH_PATHS,
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
                admitted,
                endpoint=path,
                model=router.config.model,
                max_fanout=serving.max_fanout,
                resolve=router.fleet.catalog.resolve,
            )
        except RequestFault as fault:
            await self._refuse(fault, scope, receive, send, rid, path, self._caller(scope))
            return
        rid_text, caller = rid.decode(), self._caller(scope)
        try:
            flow = classify(
                scope["headers"],
                router.config.admission,
                key_id=caller.key,
                key_class=router.api_keys.key_class(scope["headers"]),
            )
        except RequestFault as fault:
            await self._refuse(fault, scope, receive, send, rid, path, caller)
            return
        extensions = scope.get("extensions") or {}  # the server's features (ASGI's channel)
        await router.handle(
            req,
            rid_text,
            AsgiSink(send, rid, extensions.get(DIRECT_BODY)),
            partial(_wait_disconnect, receive),
            caller,
            scope["headers"],
            extensions.get(ON_DISCONNECT),
            flow,
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
        answer = await router.pass_through.answer(
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
            raw = await read_body({"headers": []}, receive, 64 * 1024)
        except (Disconnected, RequestFault):
            return
        fleet_ids = sorted(e.id for e in self.router.fleet.engines)
        if raw.strip():
            try:
                named = msgspec.json.decode(raw, type=_WaveRequest).engines
            except (msgspec.MsgspecError, RecursionError) as exc:
                await _respond_fault(send, BadRequest(f"engines: {exc}"))
                return
            if sorted(named) != fleet_ids:
                wave = f"a wave is the whole engine set {fleet_ids}, got {sorted(named)}"
                await _respond_fault(send, BadRequest(f"engines: {wave}"))
                return
        outcomes = await health.readmit_wave()
        body = {"maintenance": health.maintenance, "engines": outcomes}
        await respond(send, 409 if health.maintenance else 200, msgspec.json.encode(body))


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _as_answer(fault: RequestFault) -> tuple[int, bytes, bytes]:
    """``fault`` as ``_answer`` returns an answer: (status, body, content type)."""
    return *fault.answer(), JSON_TYPE


class _WaveRequest(msgspec.Struct):
    engines: list[str]


async def _respond_fault(send: Send, fault: RequestFault) -> None:
    await respond(send, *fault.answer())


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


async def _nothing() -> None:
    """A scope of a type this app does not serve."""
