"""The engine boundary: one table from the errors of the libraries the transport calls (the
socket layer, trio, h11, the chunked decoder) to the engine faults of
``narwhal.core.faults``, and ``EngineErrors``, which applies it around those calls.
httpcore's ``map_exceptions`` (``_exceptions.py``, used in ``_backends/trio.py``) is the
model: what leaves ``narwhal.engines`` is an engine fault or a bug, so nothing above it
catches a library's error (docs/architecture.md, "Faults at one boundary").

A fault's message names the engine by its URL, for logs and the journal, and keeps the
library's own words; the client reads the engine's id instead (``client_message``).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import TracebackType
from typing import Final

import h11
import trio

from narwhal.core.faults import (
    ConnectTimeout,
    EngineFault,
    EngineUnreachable,
    Phase,
    StreamBroken,
)
from narwhal.stream.chunked import ChunkedError


class Step(StrEnum):
    """Where the transport called its libraries."""

    CONNECT = "connect"  # the TCP connect and, for an https engine, the TLS handshake
    EXCHANGE = "exchange"  # writing the request, reading its response


class EngineClosed(Exception):
    """h11's ``ConnectionClosed`` event where a response, or more of one, was due."""

    def __init__(self) -> None:
        super().__init__("connection closed by engine")


class BodyTooLarge(Exception):
    """An engine's body longer than its reader's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"engine response larger than {limit} bytes")


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def tls_problem(exc: BaseException) -> str:
    """What a failed TLS handshake (trio's ``BrokenResourceError``) was caused by."""
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {cause.verify_message}"
    return describe(cause or exc)


@dataclass(frozen=True, slots=True)
class Rule:
    """What one library error becomes: ``fault``, with ``message`` formatted from the
    engine's ``url``, the reader's ``broken`` prefix and the error's ``detail``."""

    fault: type[EngineFault]
    message: str
    detail: Callable[[BaseException], str] = describe
    # the connection was found gone: one a pool reused may have been closed by the engine
    # while idle, so a request that fails so before any response gets one fresh connection
    gone: bool = False


_UNREACHABLE = "cannot connect to engine {url}: {detail}"
_NO_TLS = "cannot connect to engine {url}: TLS handshake failed: {detail}"
_BROKE = "{broken}connection to engine {url} broke: {detail}"
_BROKE_HTTP = "{broken}connection to engine {url} broke: engine broke HTTP: {detail}"
_BROKE_CONNECTION = "{broken}connection to engine {url} broke: connection broke: {detail}"

# Per step, the library errors in the order they are matched (a subclass before its base),
# and the fault each becomes (contract 6: a connect failure is the engine's unreachability,
# 504 when the connect timed out; anything after it, a broken stream, 502).
TABLE: Final[Mapping[Step, tuple[tuple[type[BaseException], Rule], ...]]] = {
    Step.CONNECT: (
        (trio.TooSlowError, Rule(ConnectTimeout, "connect to engine {url} timed out")),
        # the TLS handshake (an untrusted or mismatched certificate, a peer without TLS)
        (trio.BrokenResourceError, Rule(EngineUnreachable, _NO_TLS, tls_problem)),
        (OSError, Rule(EngineUnreachable, _UNREACHABLE)),  # refused, unresolvable, no route
    ),
    Step.EXCHANGE: (
        (h11.RemoteProtocolError, Rule(StreamBroken, _BROKE_HTTP)),
        (ChunkedError, Rule(StreamBroken, _BROKE_HTTP)),
        (EngineClosed, Rule(StreamBroken, _BROKE, gone=True)),
        (BodyTooLarge, Rule(StreamBroken, _BROKE)),
        (trio.BrokenResourceError, Rule(StreamBroken, _BROKE_CONNECTION, gone=True)),
        (trio.ClosedResourceError, Rule(StreamBroken, _BROKE_CONNECTION, gone=True)),
        (OSError, Rule(StreamBroken, _BROKE_CONNECTION, gone=True)),  # reset, broken pipe
    ),
}


class EngineErrors:
    """The table applied to one engine exchange's library calls: an error ``step``'s rows
    name, raised inside, leaves as its fault (raised ``from None``: the library's words
    are in the message); anything else passes unchanged. Held by its Response, not made
    per call."""

    __slots__ = ("broken", "gone", "phase", "step", "url")

    def __init__(self, step: Step, url: str, phase: Phase) -> None:
        self.step = step
        self.url = url
        self.phase = phase
        self.broken = ""  # the reader's prefix: a decode stream's "stream ended before..."
        self.gone = False  # the last fault raised was of a connection found gone

    def fault(self, exc: BaseException) -> EngineFault | None:
        """``exc``'s engine fault; None when the table does not name it."""
        for kind, rule in TABLE[self.step]:
            if isinstance(exc, kind):
                self.gone = rule.gone
                detail = rule.detail(exc)
                message = rule.message.format(url=self.url, broken=self.broken, detail=detail)
                return rule.fault(message, phase=self.phase, engine_url=self.url)
        return None

    def raise_fault(self, exc: BaseException) -> None:
        """Raise ``exc``'s fault when the table names it; else return, for the caller to
        raise ``exc`` itself. The per-token reads call it from an ``except`` (a ``try``
        costs nothing until it raises; a ``with`` costs two calls on every read)."""
        fault = self.fault(exc)
        if fault is not None:
            raise fault from None

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.raise_fault(exc)
