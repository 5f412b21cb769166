"""Every way a request can fail, in one hierarchy: the mapping table of contract sections 3 and 6.

Each fault carries the phase it happened in, the HTTP status the client sees, whether a
fresh attempt may be made for it, and its breaker class (which later issues feed to the
per-engine breaker). Every error answer the router gives is one of these, rendered by the
fault itself (``error_json``). The transport's libraries' errors become engine faults at
one boundary (the table of ``narwhal.engines.boundary``), so nothing above it sees
transport, trio or h11 types; a clock that ran out becomes its fault through
``narwhal.core.clocks.ran_out``.

Client-visible messages name engines by id, never by URL (contract 3): a fault keeps its full
``message`` (with the engine's address) for logs and the journal, and ``error_body()``,
which every client answer and terminal stream event is built from, names the engine by id.
"""

from __future__ import annotations

import re
from enum import StrEnum
from functools import lru_cache
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import msgspec

from narwhal.core.config import ConfigError

_encode = msgspec.json.Encoder().encode


class Phase(StrEnum):
    ADMISSION = "admission"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DECODE = "decode"
    STREAM = "stream"  # after the first token


class BreakerClass(StrEnum):
    NONE = "none"  # never counts against an engine (client errors, disconnects, deadline)
    UNREACHABLE = "unreachable"  # connect failures: health checks may readmit
    STREAM = "stream"  # answered, but no good stream: only an inference probe readmits
    DESCRIPTOR = "descriptor"  # a producer handed out an unusable descriptor


class RequestFault(Exception):
    """A failure the client is told about; ``status`` is the HTTP status it maps to."""

    status: int = 500
    kind: str = "internal_error"
    transient: bool = False
    breaker: BreakerClass = BreakerClass.NONE

    def __init__(
        self,
        message: str,
        *,
        phase: Phase,
        engine_id: str | None = None,
        engine_url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message  # the full text, engine address included: logs and journal
        self.phase = phase
        self.engine_id = engine_id
        self.engine_url = engine_url  # the base URL of the engine at fault, when one is

    def at(self, engine_id: str, engine_url: str) -> Self:
        """This fault as one of engine ``engine_id``: a new fault of the same kind and
        message, built with the engine (the leg's shell knows which engine the transport or
        the rules were reading; the fault itself is never changed once raised)."""
        fault = type(self).__new__(type(self))
        fault.__dict__.update(self.__dict__)
        fault.args = self.args
        fault.engine_id = engine_id
        fault.engine_url = self.engine_url or engine_url
        return fault

    def client_message(self) -> str:
        """``message`` as a client may read it: the engine named by id, never by address."""
        if not self.engine_url:
            return self.message
        return name_engine(self.message, self.engine_url, self.engine_id)

    param: str | None = None  # the request field at fault, when one is

    def details(self) -> dict[str, object]:
        """Fields the error object carries after the four of every error (none here)."""
        return {}

    def error_body(self) -> dict[str, object]:
        """The one error object: ``{"message", "type", "param", "code"}``, then ``details``."""
        return {
            "message": self.client_message(),
            "type": self.kind,
            "param": self.param,
            "code": self.status,
            **self.details(),
        }

    def error_json(self) -> bytes:
        """The JSON answer before the commit point, or the terminal event's payload:
        ``{"error": error_body}``."""
        return _encode({"error": self.error_body()})

    def answer(self) -> tuple[int, bytes]:
        """The whole answer to a request refused or failed before its commit point:
        (status, JSON body)."""
        return self.status, self.error_json()


def name_engine(message: str, url: str, engine_id: str | None) -> str:
    """Replace every spelling of ``url``'s address in ``message`` (the URL with or without
    its scheme, ``host:port`` as trio writes it, the ``('host', port)`` of socket errors,
    the bare host) with ``engine <id>``, or plain ``engine`` when the id is unknown.
    "engine <address>" becomes "engine <id>", never "engine engine <id>"."""
    label = f"engine {engine_id}" if engine_id else "engine"
    return _address_pattern(url).sub(lambda _: label, message)  # an id is never a template


@lru_cache(maxsize=1024)
def _address_pattern(url: str) -> re.Pattern[str]:
    base = url.strip().rstrip("/")
    forms = {base}
    try:
        parts = urlsplit(base)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # not a URL we can take apart: replace it as written
        port = None
    if port is not None and parts.hostname:
        host = parts.hostname
        bracketed = f"[{host}]" if ":" in host else host
        forms |= {parts.netloc, f"{bracketed}:{port}", f"('{host}', {port})", host, bracketed}
    forms.discard("")
    if not forms:
        return re.compile(r"(?!)")  # matches nothing
    alternatives = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    # an optional "engine " and scheme before, a lone "/" after; never part of a longer
    # name or number, nor the same host with another port
    return re.compile(
        rf"(?:\bengine )?(?:\b[a-z][a-z0-9+.-]*://)?(?<![\w.-])(?:{alternatives})"
        rf"(?:/(?!\w))?(?![\w-]|\.\w|:\d)",
        re.IGNORECASE,
    )


class EngineFault(RequestFault):
    """An engine misbehaved: 502 unless the fault is timeout-shaped."""

    status = 502
    kind = "bad_gateway"
    transient = True
    breaker = BreakerClass.STREAM


class EngineTimeout(EngineFault):
    status = 504
    kind = "gateway_timeout"


class EngineUnreachable(EngineFault):
    breaker = BreakerClass.UNREACHABLE


class ConnectTimeout(EngineTimeout):
    breaker = BreakerClass.UNREACHABLE


class PrefillTimeout(EngineTimeout):
    pass


class FirstTokenTimeout(EngineTimeout):
    pass


class SilenceTimeout(EngineTimeout):
    pass


class DescriptorInvalid(EngineFault):
    breaker = BreakerClass.DESCRIPTOR


class StreamBroken(EngineFault):
    """Garbage, a close before ``[DONE]``, or ``[DONE]`` before any token."""


class EngineStatusError(EngineFault):
    """The engine answered with an error status, or sent an error object in its stream.

    4xx other than 408/429 are the client's fault: passed through with the engine's own
    status and message, never retried and never counted against the engine.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        phase: Phase,
        engine_id: str | None = None,
        engine_url: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message, phase=phase, engine_id=engine_id, engine_url=engine_url)
        client_error = 400 <= status < 500 and status not in (408, 429)
        if status in (408, 504):
            self.status, self.kind = 504, "gateway_timeout"
        elif client_error:
            self.status, self.kind = status, kind or "invalid_request_error"
        else:
            self.status, self.kind = 502, "bad_gateway"
        self.transient = not client_error
        self.breaker = BreakerClass.NONE if client_error else BreakerClass.STREAM


class InStreamError(EngineFault):
    """An error object inside an HTTP 200 stream: propagates with its own status (contract 6)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        phase: Phase,
        engine_id: str | None = None,
        engine_url: str | None = None,
    ) -> None:
        super().__init__(message, phase=phase, engine_id=engine_id, engine_url=engine_url)
        self.status = status
        self.kind = kind
        client_error = 400 <= status < 500 and status not in (408, 429)
        self.transient = not client_error
        self.breaker = BreakerClass.STREAM if status >= 500 else BreakerClass.NONE


class DeadlineExpired(RequestFault):
    status = 504
    kind = "gateway_timeout"

    def __init__(self, timeout_s: float, *, phase: Phase) -> None:
        super().__init__(f"request deadline expired after {timeout_s:g}s", phase=phase)


class HandoffExpired(RequestFault):
    status = 504
    kind = "gateway_timeout"
    transient = True


class TooLarge(RequestFault):
    """A body over ``serving.max_request_bytes``."""

    status = 413
    kind = "request_too_large"


class BodyTimeout(RequestFault):
    """The body did not arrive within ``serving.client_body_timeout_s`` of its headers."""

    status = 408
    kind = "request_timeout"


class HeadersTooLarge(RequestFault):
    """More request header fields, or header bytes, than the router reads."""

    status = 431
    kind = "request_header_fields_too_large"


class Overloaded(RequestFault):
    """``serving.max_inflight`` reached (429 with Retry-After)."""

    status = 429
    kind = "rate_limit_exceeded"


class NotDispatched(RequestFault):
    """The admission queue let the request go without sending it on (contract 4.5): the queue
    was full, it was displaced, or no capacity came in time (429 with Retry-After). It
    never started, so it is rejected, never failed."""

    status = 429
    kind = "rate_limit_exceeded"


class QueueDrained(NotDispatched):
    """SIGTERM while it was queued: 503, so a load balancer may send it elsewhere."""

    status = 503
    kind = "service_unavailable"


class Maintenance(RequestFault):
    """Whole-wave maintenance after an ejection (503 with Retry-After)."""

    status = 503
    kind = "service_unavailable"


class InternalError(RequestFault):
    """A bug in the router: reported as 500, never blamed on an engine."""


class ShuttingDown(RequestFault):
    """The router is draining: new requests are refused, stragglers ended."""

    status = 503
    kind = "service_unavailable"


class BodyCut(ShuttingDown):
    """The drain ended while a request's body was still arriving: answered and closed."""


class NoCapacity(RequestFault):
    """No placeable producer or consumer (503 with Retry-After)."""

    status = 503
    kind = "service_unavailable"


class BadRequest(RequestFault):
    """The client's request is malformed or out of range: 400 naming the field."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, phase=Phase.ADMISSION)
        self.param = param


class ModelNotServed(RequestFault):
    status = 404
    kind = "not_found_error"

    @classmethod
    def named(cls, model: str) -> ModelNotServed:
        """The 404 for a name no engine serves; a name longer than any served one (a
        client's mistake or an attack) is shown cut, so the answer stays small."""
        shown = model if len(model) <= 256 else model[:256] + "..."
        return cls(f"model '{shown}' is not served here", phase=Phase.ADMISSION)


class Unauthorized(RequestFault):
    """No API key, or one the router does not know, on an endpoint that needs one."""

    status = 401
    kind = "authentication_error"

    def __init__(self) -> None:
        super().__init__("missing or invalid API key", phase=Phase.ADMISSION)


class Forbidden(RequestFault):
    """An admin endpoint asked without the admin rule's leave (``message`` says which)."""

    status = 403
    kind = "permission_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, phase=Phase.ADMISSION)


class NoSuchEndpoint(RequestFault):
    status = 404
    kind = "not_found_error"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"no such endpoint: {method} {path}", phase=Phase.ADMISSION)


class MethodNotAllowed(RequestFault):
    """An endpoint that takes POST asked with another method."""

    status = 405
    kind = "method_not_allowed"

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} takes POST", phase=Phase.ADMISSION)


class FramingError(RequestFault):
    """The front door could not frame the request (RFC 9112): answered, then the
    connection closes. 400, or the status the parser named (413: a chunk announced past
    the body limit), with the type the app gives the same status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, phase=Phase.ADMISSION)
        self.status = status
        self.kind = "request_too_large" if status == 413 else "invalid_request_error"


class InvalidFleetFile(RequestFault):
    """A reload whose fleet file does not load: nothing changed; each problem is listed."""

    status = 400
    kind = "invalid_fleet_file"

    def __init__(self, error: ConfigError) -> None:
        super().__init__(error.render(), phase=Phase.ADMISSION)
        self.problems = error.problems

    def details(self) -> dict[str, object]:
        return {"problems": self.problems}


class ReloadIncomplete(RequestFault):
    """A fleet file that loaded, but not everywhere: the workers may differ."""

    kind = "reload_incomplete"


class ReloadUnanswered(ReloadIncomplete):
    """The parent process did not answer a worker's reload in time."""

    status = 504

    def __init__(self) -> None:
        message = "reload: the parent process did not answer; the workers may differ"
        super().__init__(message, phase=Phase.ADMISSION)


class ReloadNotApplied(ReloadIncomplete):
    """Some workers could not apply the file; ``workers`` holds every worker's answer."""

    status = 409

    def __init__(self, failed: list[int], workers: list[dict[str, Any]]) -> None:
        message = f"reload did not apply on worker(s) {failed}; the workers may differ"
        super().__init__(message, phase=Phase.ADMISSION)
        self.workers = workers

    def details(self) -> dict[str, object]:
        return {"workers": self.workers}


class AtEngine:
    """A leg's faults are its engine's: whatever fault is raised inside is raised again as
    ``fault.at(engine_id, engine_url)`` (httpcore's ``map_exceptions`` is the model). A
    class, not a generator: one is held across each decode leg."""

    __slots__ = ("engine_id", "engine_url")

    def __init__(self, engine_id: str, engine_url: str) -> None:
        self.engine_id = engine_id
        self.engine_url = engine_url

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, RequestFault):
            raise exc.at(self.engine_id, self.engine_url) from exc.__cause__
