"""EngineClient: the two data legs over pooled keep-alive httpcore connections (SPEC 7).

Timeouts are the caller's cancel scopes; the only timeout httpcore applies itself is the
connect timeout. A per-engine ``trio.CapacityLimiter`` sized like the pool sits in front of
it, so no request ever waits inside httpcore's pool, where cancellation under contention
can leak connection slots (encode/httpcore#1093).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Self

import httpcore
import msgspec
import trio

from narwhal.engines.connector import NixlConnector, PrefillResult
from narwhal.faults import (
    ConnectTimeout,
    EngineStatusError,
    EngineUnreachable,
    Phase,
    StreamBroken,
)

MAX_PREFILL_RESPONSE_BYTES = 8 * 1024 * 1024
MAX_ERROR_BODY_BYTES = 64 * 1024
DRAIN_TIMEOUT_S = 1.0
_SOCKET_OPTIONS = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
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
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body[:200].decode("utf-8", "replace").strip()
        return (text or f"engine answered HTTP {status}"), None
    if parsed.error is not None and isinstance(parsed.error.message, str):
        kind = parsed.error.type if isinstance(parsed.error.type, str) else None
        return parsed.error.message, kind
    for candidate in (parsed.detail, parsed.message):
        if isinstance(candidate, str):
            return candidate, None
    return f"engine answered HTTP {status}", None


class _Engine:
    """One engine's pool, its capacity limiter and its precomputed headers."""

    def __init__(self, base_url: str, client: EngineClient) -> None:
        self.base_url = base_url.rstrip("/")
        self.limiter = trio.CapacityLimiter(client.max_connections)
        self.pool = httpcore.AsyncConnectionPool(
            max_connections=client.max_connections,
            max_keepalive_connections=client.max_connections,
            keepalive_expiry=client.keepalive_expiry_s,
            socket_options=_SOCKET_OPTIONS,
            network_backend=client.network_backend,
        )
        headers = [(b"content-type", b"application/json"), (b"accept", b"*/*")]
        if client.api_key:
            headers.append((b"authorization", b"Bearer " + client.api_key.encode()))
        self.headers = headers


class EngineClient:
    """Talks to engines; one pool per engine base URL, created on first use."""

    def __init__(
        self,
        *,
        connector: NixlConnector | None = None,
        max_connections: int = 512,
        connect_timeout_s: float = 5.0,
        keepalive_expiry_s: float = 60.0,
        api_key: str | None = None,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.connector = connector or NixlConnector()
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_expiry_s = keepalive_expiry_s
        self.api_key = api_key
        self.network_backend = network_backend
        self._engines: dict[str, _Engine] = {}
        self._extensions = {"timeout": {"connect": connect_timeout_s}}

    def _engine(self, url: str) -> _Engine:
        engine = self._engines.get(url)
        if engine is None:
            engine = self._engines[url] = _Engine(url, self)
        return engine

    def _headers(self, engine: _Engine, request_id: str | None) -> list[tuple[bytes, bytes]]:
        if request_id is None:
            return engine.headers
        return [*engine.headers, (b"x-request-id", request_id.encode())]

    async def prefill(
        self, url: str, endpoint: str, body: dict[str, Any], *, request_id: str = ""
    ) -> PrefillResult:
        """Run the one-token prefill leg; return the validated descriptor."""
        engine = self._engine(url)
        payload = _encode(self.connector.prefill_body(body))
        async with engine.limiter:
            with _translate(Phase.PREFILL, url):
                async with engine.pool.stream(
                    "POST",
                    engine.base_url + endpoint,
                    headers=self._headers(engine, request_id or None),
                    content=payload,
                    extensions=self._extensions,
                ) as response:
                    data = await _read_bounded(response, MAX_PREFILL_RESPONSE_BYTES)
        if response.status != 200:
            message, kind = error_message(data, response.status)
            raise EngineStatusError(response.status, message, phase=Phase.PREFILL, kind=kind)
        return self.connector.extract(
            data, producer_url=url, endpoint=endpoint, request_id=request_id
        )

    def decode(
        self,
        url: str,
        endpoint: str,
        body: dict[str, Any],
        result: PrefillResult | None,
        *,
        request_id: str = "",
    ) -> DecodeStream:
        """The decode leg's stream of raw transport chunks.

        With ``result`` None, or produced on this same engine, every ``kv_transfer_params``
        is stripped (same-worker decode). Use as ``async with client.decode(...) as s:``;
        plain ``async for`` also works and closes the stream when it ends.
        """
        same_worker = result is None or result.producer_url.rstrip("/") == url.rstrip("/")
        decode_body = self.connector.decode_body(
            body, None if same_worker else result, endpoint=endpoint
        )
        engine = self._engine(url)
        return DecodeStream(
            engine,
            engine.base_url + endpoint,
            _encode(decode_body),
            self._headers(engine, request_id or None),
            self._extensions,
        )

    async def get(self, url: str, path: str) -> tuple[int, bytes]:
        """A small GET (health, version, models), bounded by the caller's scope."""
        engine = self._engine(url)
        async with engine.limiter:
            with _translate(Phase.ADMISSION, url):
                async with engine.pool.stream(
                    "GET",
                    engine.base_url + path,
                    headers=engine.headers,
                    extensions=self._extensions,
                ) as response:
                    return response.status, await _read_bounded(
                        response, MAX_PREFILL_RESPONSE_BYTES
                    )

    def limiter(self, url: str) -> trio.CapacityLimiter:
        """The engine's capacity limiter (its pool's size): no free token, no room."""
        return self._engine(url).limiter

    def connections(self) -> dict[str, tuple[int, int]]:
        """Per engine: (open connections, connections serving a request)."""
        out = {}
        for url, engine in self._engines.items():
            conns = engine.pool.connections
            out[url] = (len(conns), sum(1 for c in conns if not c.is_idle()))
        return out

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            for engine in self._engines.values():
                await engine.pool.aclose()


class DecodeStream:
    """An open decode response; iterating yields the raw bytes of each transport read."""

    def __init__(
        self,
        engine: _Engine,
        url: str,
        payload: bytes,
        headers: list[tuple[bytes, bytes]],
        extensions: dict[str, Any],
    ) -> None:
        self._engine = engine
        self._url = url
        self._payload = payload
        self._headers = headers
        self._extensions = extensions
        self._cm: Any = None
        self._chunks: AsyncIterator[bytes] | None = None
        self._holding = False

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
        await self._engine.limiter.acquire_on_behalf_of(self)
        self._holding = True
        try:
            with _translate(Phase.DECODE, self._engine.base_url):
                self._cm = self._engine.pool.stream(
                    "POST",
                    self._url,
                    headers=self._headers,
                    content=self._payload,
                    extensions=self._extensions,
                )
                response = await self._cm.__aenter__()
                if response.status != 200:
                    data = await _read_bounded(response, MAX_ERROR_BODY_BYTES, truncate=True)
                    message, kind = error_message(data, response.status)
                    raise EngineStatusError(response.status, message, phase=Phase.DECODE, kind=kind)
                self._chunks = response.aiter_stream()
        except BaseException:
            await self.aclose()
            raise

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        if self._chunks is None:
            if self._holding:
                raise StopAsyncIteration
            await self._open()
        assert self._chunks is not None
        try:
            with _translate(Phase.DECODE, self._engine.base_url, "stream ended before [DONE]: "):
                return await self._chunks.__anext__()
        except BaseException:
            await self.aclose()
            raise

    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Read what follows ``[DONE]`` (the end of the chunked body), so the connection
        goes back to the pool instead of being closed; give up after ``timeout_s``."""
        if self._chunks is None:
            return
        with trio.move_on_after(timeout_s):
            size = 0
            async for part in self:
                size += len(part)
                if size > MAX_ERROR_BODY_BYTES:
                    break
        await self.aclose()

    async def aclose(self) -> None:
        cm, self._cm, self._chunks = self._cm, None, None
        try:
            if cm is not None:
                # httpcore shields its own close path; an unfinished response closes
                # the connection instead of returning it to the pool.
                with _translate(Phase.DECODE, self._engine.base_url):
                    await cm.__aexit__(None, None, None)
        finally:
            if self._holding:
                self._holding = False
                self._engine.limiter.release_on_behalf_of(self)


async def _read_bounded(
    response: httpcore.Response, limit: int, *, truncate: bool = False
) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_stream():
        parts.append(part)
        size += len(part)
        if size > limit:
            if truncate:
                break
            raise StreamBroken(f"engine response larger than {limit} bytes", phase=Phase.PREFILL)
    return b"".join(parts)


@contextmanager
def _translate(phase: Phase, url: str, broken: str = "") -> Iterator[None]:
    """Translate httpcore's exceptions into engine faults at the boundary; ``broken``
    prefixes the message of a connection that broke (mid-body: the stream ended early)."""
    try:
        yield
    except httpcore.ConnectTimeout:
        raise ConnectTimeout(f"connect to engine {url} timed out", phase=phase) from None
    except httpcore.ConnectError as exc:
        raise EngineUnreachable(f"cannot connect to engine {url}: {exc}", phase=phase) from None
    except (httpcore.ReadError, httpcore.WriteError, httpcore.RemoteProtocolError) as exc:
        detail = str(exc) or type(exc).__name__
        raise StreamBroken(
            f"{broken}connection to engine {url} broke: {detail}", phase=phase
        ) from None
    except httpcore.TimeoutException as exc:
        raise ConnectTimeout(f"engine {url} timed out: {exc}", phase=phase) from None
    except httpcore.ProtocolError as exc:
        raise StreamBroken(f"engine {url} broke HTTP: {exc}", phase=phase) from None
