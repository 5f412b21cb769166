"""EngineClient: the two data legs over pooled keep-alive connections (contract 7).

Timeouts are the caller's cancel scopes; the only timeout applied here is the connect
timeout (the TCP connect and, for an ``https://`` engine, the TLS handshake). The transport
(``narwhal.engines.transport``, h11 on trio) bounds each engine's pool with a capacity
limiter and returns what each socket read brought as one batch, and raises what its
libraries raise as engine faults (the table of ``narwhal.engines.boundary``).
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import msgspec
import trio

from narwhal.core.connector import NixlConnector, PrefillResult
from narwhal.core.faults import EngineStatusError, HandoffExpired, Phase, StreamBroken
from narwhal.engines.engine_connection import IDLE_EXPIRY_S
from narwhal.engines.transport import (
    Connect,
    Pool,
    Response,
    SendTooLate,
    tcp_connect,
    tls_connect,
    tls_context,
)
from narwhal.lowlevel.fast_io import Parkable
from narwhal.observe.tracing import NO_HEADERS, Headers

MAX_PREFILL_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
DRAIN_TIMEOUT_S = 1.0
# what a decode stream's broken reads say first, once its engine answered 200
BROKEN_STREAM = "stream ended before [DONE]: "
_encode = msgspec.json.Encoder().encode


class _ErrorView(msgspec.Struct):
    message: Any = None
    type: Any = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorView | None = None
    detail: Any = None
    message: Any = None


def error_message(body: bytes, status: int) -> tuple[str, str | None]:
    """The message and type of an engine's error body (vLLM, FastAPI or plain text)."""
    try:
        parsed = msgspec.json.decode(body, type=_ErrorBody)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        text = body[:200].decode("utf-8", "replace").strip()
        return (text or f"engine answered HTTP {status}"), None
    if parsed.error is not None and isinstance(parsed.error.message, str):
        kind = parsed.error.type if isinstance(parsed.error.type, str) else None
        return parsed.error.message, kind
    for candidate in (parsed.detail, parsed.message):
        if isinstance(candidate, str):
            return candidate, None
    return f"engine answered HTTP {status}", None


class _EnginePool:
    """The engine client's side of one engine: its connection pool (with the capacity limiter)
    and its precomputed headers."""

    def __init__(self, base_url: str, client: EngineClient) -> None:
        self.base_url = base_url.rstrip("/")
        scheme = urlsplit(self.base_url).scheme
        connect = client.connect  # http: the plain path, nothing added
        if scheme == "https":
            connect = tls_connect(connect, client.tls_context())
        elif scheme != "http":  # the config refuses these: never a silent downgrade
            connect = _refuse_scheme(scheme)
        self.pool = Pool(self.base_url, connect, client.connect_timeout_s, client.max_connections)
        headers = [(b"content-type", b"application/json"), (b"accept", b"*/*")]
        if client.api_key:
            headers.append((b"authorization", b"Bearer " + client.api_key.encode()))
        self.headers = headers

    def headers_for(
        self, request_id: str, trace: Headers = NO_HEADERS
    ) -> list[tuple[bytes, bytes]]:
        """The precomputed headers, the backend request id, and the leg's W3C trace context
        (``traceparent``/``tracestate``: its span's with tracing on, the client's as it came
        with tracing off, none when the client sent none)."""
        if not request_id and not trace:
            return self.headers
        rid = [(b"x-request-id", request_id.encode())] if request_id else []
        return [*self.headers, *rid, *trace]

    async def request(
        self,
        method: bytes,
        path: str,
        body: bytes,
        request_id: str,
        phase: Phase,
        trace: Headers = NO_HEADERS,
        send_by: float = math.inf,
    ) -> Response:
        headers = self.headers_for(request_id, trace)
        target = path.encode()
        try:
            return await self.pool.request(
                method, target, headers, body, phase=phase, send_by=send_by
            )
        except SendTooLate:
            raise HandoffExpired(
                f"KV handoff expired: the descriptor's limit came before its request to engine "
                f"{self.base_url} was sent (no free connection, or a slow connect)",
                phase=Phase.HANDOFF,
                engine_url=self.base_url,
            ) from None


def _refuse_scheme(scheme: str) -> Connect:
    async def refuse(host: str, port: int) -> trio.abc.Stream:
        raise OSError(f"unsupported URL scheme {scheme!r} (http and https only)")

    return refuse


class EngineClient:
    """Talks to engines; one pool per engine base URL, created on first use.

    ``https://`` engines are reached over TLS, verified against ``ca_file`` ("" = the
    system trust store); the context is built once per client: at once from a ``ca_file``
    (one that cannot be loaded fails here, not on a request), else on the first https
    engine (loading the system store takes tens of ms, which an http fleet never pays)."""

    def __init__(
        self,
        *,
        connector: NixlConnector | None = None,
        max_connections: int = 512,
        connect_timeout_s: float = 5.0,
        api_key: str | None = None,
        ca_file: str = "",
        connect: Connect | None = None,
    ) -> None:
        self.connector = connector or NixlConnector()
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.api_key = api_key
        self.ca_file = ca_file
        self._tls: ssl.SSLContext | None = tls_context(ca_file) if ca_file else None
        self.connect: Connect = connect or tcp_connect  # tests pass an in-memory network
        self._engines: dict[str, _EnginePool] = {}

    def tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = tls_context(self.ca_file)
        return self._tls

    def _engine(self, url: str) -> _EnginePool:
        engine = self._engines.get(url)
        if engine is None:
            engine = self._engines[url] = _EnginePool(url, self)
        return engine

    async def prefill(
        self,
        url: str,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        request_id: str = "",
        trace: Headers = NO_HEADERS,
        asks_descriptor: bool = True,
    ) -> PrefillResult:
        """Run the one-token prefill leg; return the validated descriptor
        (``asks_descriptor`` False: none is asked for, its producer decodes too: only the
        prompt side)."""
        payload = _encode(self.connector.prefill_body(body, asks_descriptor=asks_descriptor))
        data = await self._post_whole(url, endpoint, payload, request_id, trace)
        return self.connector.extract(
            data,
            producer_url=url,
            endpoint=endpoint,
            request_id=request_id,
            asks_descriptor=asks_descriptor,
        )

    def decode(
        self,
        url: str,
        endpoint: str,
        body: Mapping[str, Any],
        result: PrefillResult | None,
        *,
        request_id: str = "",
        trace: Headers = NO_HEADERS,
        send_by: float = math.inf,
    ) -> DecodeStream:
        """The decode leg's stream: each item is what one socket read brought.

        With ``result`` None, or produced on this same engine, every ``kv_transfer_params``
        is stripped (same-worker decode). Use as ``async with client.decode(...) as s:``;
        plain ``async for`` also works and closes the stream when it ends. ``send_by``: the
        descriptor's handoff clock (contract 5); once it fires with the request unsent, the
        stream raises ``HandoffExpired`` and the consumer never holds the descriptor.
        """
        same_worker = result is None or result.producer_url.rstrip("/") == url.rstrip("/")
        decode_body = self.connector.decode_body(
            body, None if same_worker else result, endpoint=endpoint
        )
        payload = _encode(decode_body)
        return DecodeStream(self._engine(url), endpoint, payload, request_id, trace, send_by)

    async def pass_through(
        self,
        url: str,
        path: str,
        body: bytes,
        *,
        request_id: str = "",
        trace: Headers = NO_HEADERS,
    ) -> bytes:
        """POST ``body`` unchanged to ``path`` (``/tokenize``, ``/detokenize``); the engine's
        200 answer, else its error as an engine fault. Bounded by the caller's scope."""
        return await self._post_whole(url, path, body, request_id, trace)

    async def _post_whole(
        self, url: str, path: str, payload: bytes, request_id: str, trace: Headers
    ) -> bytes:
        """A prompt-side POST read whole (bounded in size): the engine's 200 body, else its
        error as an engine fault."""
        engine = self._engine(url)
        async with await engine.request(
            b"POST", path, payload, request_id, Phase.PREFILL, trace=trace
        ) as response:
            data = await response.read_all(MAX_PREFILL_RESPONSE_BYTES)
        if response.status != 200:
            message, kind = error_message(data, response.status)
            raise EngineStatusError(
                response.status, message, phase=Phase.PREFILL, engine_url=url, kind=kind
            )
        return data

    async def reclaim(
        self, url: str, result: PrefillResult, *, request_id: str, send_by: float = math.inf
    ) -> int:
        """Send a consumer the reclaim request for an orphaned descriptor (the connector's
        ``reclaim_body``); the consumer's HTTP status. Bounded by the caller's scope, and
        its sending by the descriptor's handoff clock ``send_by`` (``HandoffExpired``)."""
        engine = self._engine(url)
        payload = self.connector.reclaim_body(result)
        async with await engine.request(
            b"POST", "/v1/completions", payload, request_id, Phase.HANDOFF, send_by=send_by
        ) as response:
            await response.read_within(MAX_ERROR_BODY_BYTES)
        return response.status

    async def get(self, url: str, path: str) -> tuple[int, bytes]:
        """A small GET (health, version, models), bounded by the caller's scope."""
        engine = self._engine(url)
        async with await engine.request(b"GET", path, b"", "", Phase.ADMISSION) as response:
            data = await response.read_all(MAX_PREFILL_RESPONSE_BYTES)
        return response.status, data

    async def get_within(self, url: str, path: str, limit: int) -> tuple[int, bytes | None]:
        """``get``, its body None when it is over ``limit`` bytes (the rest is not read)."""
        engine = self._engine(url)
        async with await engine.request(b"GET", path, b"", "", Phase.ADMISSION) as response:
            data = await response.read_within(limit)
        return response.status, data

    def limiter(self, url: str) -> trio.CapacityLimiter:
        """The engine's capacity limiter (its pool's size): no free token, no room."""
        return self._engine(url).pool.limiter

    def connections(self) -> dict[str, tuple[int, int]]:
        """Per engine: (open connections, connections serving a request)."""
        return {
            url: (len(e.pool.idle) + e.pool.active, e.pool.active)
            for url, e in self._engines.items()
        }

    async def sweep_idle(self) -> None:
        for engine in list(self._engines.values()):
            await engine.pool.sweep()

    async def sweep_forever(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Close pooled connections idle past ``IDLE_EXPIRY_S`` even when no request comes
        to find them (a server-owned background task)."""
        task_status.started()
        while True:
            await trio.sleep(IDLE_EXPIRY_S)
            await self.sweep_idle()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for engine in self._engines.values():
                await engine.pool.aclose()


class DecodeStream:
    """An open decode response; iterating yields what each socket read brought."""

    def __init__(
        self,
        engine: _EnginePool,
        endpoint: str,
        payload: bytes,
        request_id: str,
        trace: Headers = NO_HEADERS,
        send_by: float = math.inf,
    ) -> None:
        self._engine = engine
        self._trace = trace
        self._send_by = send_by  # the descriptor's handoff clock (inf: none)
        self._endpoint = endpoint
        self._payload = payload
        self._request_id = request_id
        self._response: Response | None = None
        self._opened = False

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _open(self) -> None:
        self._opened = True
        engine = self._engine
        payload, self._payload = self._payload, b""  # sent once; not held for the stream
        response = await engine.request(
            b"POST",
            self._endpoint,
            payload,
            self._request_id,
            Phase.DECODE,
            trace=self._trace,
            send_by=self._send_by,
        )
        self._response = response
        if response.status == 200:
            response.errors.broken = BROKEN_STREAM
        else:
            try:
                data = await response.read_within(MAX_ERROR_BODY_BYTES) or b""
            finally:
                await self.aclose()
            message, kind = error_message(data, response.status)
            raise EngineStatusError(
                response.status,
                message,
                phase=Phase.DECODE,
                engine_url=engine.base_url,
                kind=kind,
            )

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        batch = await self.read()
        if batch is None:
            raise StopAsyncIteration
        return batch

    async def read(self) -> bytes | None:
        """What the next socket read brought; None at the end of the body (the relay's
        per-token call: ``async for`` adds a layer)."""
        response = self._response
        if response is None:
            if self._opened:
                return None
            await self._open()
            response = self._response
            assert response is not None
        try:
            batch = await response.next_batch()
        except BaseException:
            await self.aclose()  # its fault, or a cancellation, ends the stream
            raise
        if batch is None:
            await self.aclose()
        return batch

    def park_socket(self) -> Parkable | None:
        """The connection a parked relay waits on (``StreamReactor``); None: ``read``
        instead."""
        response = self._response
        return None if response is None else response.park_socket()

    def read_nowait(self) -> bytes | None:
        """``read`` without waiting, in the stream reactor's task: b"" when nothing is
        there yet; None: ``read`` goes on (the end, or anything else that may wait). The
        engine fault raised here is handed to the request's task, which closes the stream."""
        response = self._response
        return None if response is None else response.read_nowait()

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Read what follows ``[DONE]`` (the end of the chunked body), so the connection
        goes back to the pool instead of being closed; give up after ``timeout_s``."""
        response = self._response
        if response is not None:
            if response.body_read():  # the end came with [DONE]: nothing waits, no clock
                await _read_rest(response)
            else:
                with trio.move_on_after(timeout_s):
                    await _read_rest(response)
        await self.aclose()

    async def aclose(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()


async def _read_rest(response: Response) -> None:
    """Read what is left of a stream's body, up to ``MAX_ERROR_BODY_BYTES``."""
    size = 0
    try:
        while (part := await response.next_batch()) is not None and size < MAX_ERROR_BODY_BYTES:
            size += len(part)
    except StreamBroken:
        pass  # after [DONE] the answer is whole: the connection is not reused
