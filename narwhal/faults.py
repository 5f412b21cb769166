"""Every way a request can fail, in one hierarchy: the mapping table of SPEC sections 3 and 6.

Each fault carries the phase it happened in, the HTTP status the client sees, whether a
fresh attempt may be made for it, and its breaker class (which later issues feed to the
per-engine breaker). Engine and transport errors are translated into these at the
boundary (``narwhal.engines.client``), so nothing above it sees transport or h11 types.
"""

from __future__ import annotations

from enum import StrEnum


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

    def __init__(self, message: str, *, phase: Phase, engine_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.phase = phase
        self.engine_id = engine_id

    def error_body(self) -> dict[str, object]:
        return {"message": self.message, "type": self.kind, "param": None, "code": self.status}


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
        kind: str | None = None,
    ) -> None:
        super().__init__(message, phase=phase, engine_id=engine_id)
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
    """An error object inside an HTTP 200 stream: propagates with its own status (SPEC 6)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        phase: Phase,
        engine_id: str | None = None,
    ) -> None:
        super().__init__(message, phase=phase, engine_id=engine_id)
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


class NoCapacity(RequestFault):
    """No placeable producer or consumer (503 with Retry-After)."""

    status = 503
    kind = "service_unavailable"
