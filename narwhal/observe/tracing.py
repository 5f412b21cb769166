"""OpenTelemetry tracing: one server span per client request, off by default.

Tracing is on when the standard OpenTelemetry environment asks for an exporter:
``OTEL_TRACES_EXPORTER`` set to anything but ``none``, or ``OTEL_EXPORTER_OTLP_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set (``OTEL_TRACES_EXPORTER=none`` wins and
keeps it off). Spans go through a ``BatchSpanProcessor`` to the OTLP/HTTP exporter, which
reads the rest of the ``OTEL_EXPORTER_OTLP_*`` variables itself; the service name is
``OTEL_SERVICE_NAME`` (default ``narwhal``).

When off, ``ENABLED`` is False and the request path checks it once per request
(``Router.handle``): no span object is made, and the router is no participant in the
trace: a client's W3C ``traceparent`` (well formed) and its ``tracestate`` go to every
engine leg unchanged (``incoming``), so vLLM's spans still join the client's trace.

Span objects are passed explicitly (``RunRecord.span``, the attempt's span) rather than
through OpenTelemetry's implicit context: a request's work runs in trio tasks of its own,
and an explicit parent cannot be lost between them. Each engine leg carries the W3C
``traceparent`` (and ``tracestate``) of its leg span, so vLLM's spans
(``--otlp-traces-endpoint``) join the client's trace.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from narwhal.core.faults import RequestFault

Headers = tuple[tuple[bytes, bytes], ...]
NO_HEADERS: Headers = ()

ENABLED = False  # the one flag the request path checks
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
_propagator = TraceContextTextMapPropagator()
# W3C trace context, level 1: version, trace id, parent id, flags, in lower-case hex; a
# later version may append fields after a dash (version 00 may not); ff is never valid
_TRACEPARENT = re.compile(
    rb"(?!ff)([0-9a-f]{2})-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?"
)


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (the rule in the module's docstring)."""
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter:
        return True
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup(env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on when the environment asks for it (once, at startup); whether it is."""
    env = os.environ if env is None else env
    if ENABLED or not wanted(env):
        return ENABLED
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _install(BatchSpanProcessor(OTLPSpanExporter()), env)
    return True


def install(processor: SpanProcessor) -> TracerProvider:
    """Turn tracing on with ``processor`` (tests: a SimpleSpanProcessor over an
    InMemorySpanExporter); ``shutdown`` turns it off again."""
    return _install(processor, os.environ)


def _install(processor: SpanProcessor, env: Mapping[str, str]) -> TracerProvider:
    global ENABLED, _tracer, _provider
    name = env.get("OTEL_SERVICE_NAME") or "narwhal"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("narwhal")
    ENABLED = True
    return provider


def shutdown() -> None:
    """Flush what is pending and turn tracing off."""
    global ENABLED, _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    ENABLED = False
    if provider is not None:
        provider.shutdown()


def _carrier(headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    return {
        k.decode("latin-1").lower(): v.decode("latin-1")
        for k, v in headers
        if k.lower() in (b"traceparent", b"tracestate")
    }


def server_span(
    name: str, headers: Iterable[tuple[bytes, bytes]], attributes: dict[str, Any]
) -> Span:
    """The request's span, continuing an incoming W3C ``traceparent`` when there is one."""
    assert _tracer is not None
    parent = _propagator.extract(_carrier(headers))
    return _tracer.start_span(name, parent, SpanKind.SERVER, attributes)


def child_span(
    parent: Span, name: str, attributes: dict[str, Any], kind: SpanKind = SpanKind.INTERNAL
) -> Span:
    assert _tracer is not None
    return _tracer.start_span(name, trace.set_span_in_context(parent), kind, attributes)


def incoming(headers: Iterable[tuple[bytes, bytes]]) -> Headers:
    """The client's ``traceparent`` and ``tracestate``, unchanged, for the engine legs of a
    request the router does not trace; none when ``traceparent`` is absent, repeated or not
    of the W3C shape (a vendor that cannot parse it must not pass on ``tracestate``)."""
    parents: list[bytes] = []
    states: list[bytes] = []
    for name, value in headers:
        if name == b"traceparent":  # the ASGI server gives lower-case names
            parents.append(value)
        elif name == b"tracestate":
            states.append(value)
    if len(parents) != 1 or not _valid_parent(parents[0]):
        return NO_HEADERS
    if not states:
        return ((b"traceparent", parents[0]),)
    # several tracestate fields are one list, joined as RFC 9110 combines a field's lines
    return ((b"traceparent", parents[0]), (b"tracestate", b",".join(states)))


def _valid_parent(value: bytes) -> bool:
    match = _TRACEPARENT.fullmatch(value)
    return match is not None and not (match.group(1) == b"00" and match.group(2) is not None)


def headers(span: Span | None) -> Headers:
    """The ``traceparent`` (and ``tracestate``) an engine leg carries for ``span``."""
    if span is None:
        return NO_HEADERS
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span))
    return tuple((k.encode(), v.encode()) for k, v in carrier.items())


def trace_id(span: Span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def end(span: Span | None, outcome: str, message: str | None = None, **attrs: Any) -> None:
    """End ``span`` with its outcome (an error status when it failed); None is a no-op."""
    if span is None:
        return
    span.set_attribute("narwhal.outcome", outcome)
    for key, value in attrs.items():
        if value is not None:
            span.set_attribute(f"narwhal.{key}", value)
    if message is not None:
        span.set_attribute("narwhal.error", message)
    if outcome in ("failed", "expired", "error"):
        span.set_status(Status(StatusCode.ERROR, message))
    span.end()


class Ending:
    """Ends ``span`` (None: tracing off, nothing to do) when its block exits: ``completed``;
    ``failed`` with the message of the fault it raised, or of the one it handled and told
    (``fail``); ``error`` for a bug of ours; ``cancelled`` for anything else (a
    cancellation, a client gone). ``attrs``: what is known only at the end. A class, not a
    generator: one is held across each decode leg (bench/held_stream_objects.py)."""

    __slots__ = ("attrs", "message", "span")

    def __init__(
        self, span: Span | None, attrs: Callable[[], dict[str, Any]] | None = None
    ) -> None:
        self.span = span
        self.attrs = attrs
        self.message: str | None = None

    def fail(self, message: str) -> None:
        self.message = message

    def __enter__(self) -> Ending:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.span is None:
            return
        if exc is None:
            outcome = "completed" if self.message is None else "failed"
        elif isinstance(exc, RequestFault):
            outcome, self.message = "failed", exc.message
        else:
            outcome = "error" if isinstance(exc, Exception) else "cancelled"
        attrs = self.attrs() if self.attrs is not None else {}
        end(self.span, outcome, self.message, **attrs)
