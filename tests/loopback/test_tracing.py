"""OpenTelemetry tracing: spans per request, attempt and leg; W3C context to the engines."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import msgspec
import pytest
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from narwhal.observe import tracing
from narwhal.observe.logs import JsonFormatter
from tests.support.fleet import MODEL, finish, start_fleet
from tests.support.wire import open_stream_and_vanish

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        tracing.shutdown()


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ],
)
def test_tracing_is_on_only_when_the_environment_asks(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


async def test_a_request_continues_the_incoming_trace_and_carries_it_to_both_legs(
    nursery: trio.Nursery, spans: InMemorySpanExporter
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    reply = await harness.post("/v1/completions", BODY, {"traceparent": TRACEPARENT})
    assert reply.status == 200
    await harness.router.wait_drained()
    rid = reply.headers["x-request-id"]
    (server,) = _named(spans, "POST /v1/completions")
    (attempt,) = _named(spans, "attempt")
    (prefill,) = _named(spans, "prefill")
    (decode,) = _named(spans, "decode")
    assert server.kind is SpanKind.SERVER
    assert _hex(server.context.trace_id, 32) == TRACE_ID
    assert server.parent is not None
    assert _hex(server.parent.span_id, 16) == PARENT_ID
    assert server.attributes is not None
    assert server.attributes["narwhal.request_id"] == rid
    assert server.attributes["narwhal.outcome"] == "completed"
    assert server.attributes["narwhal.status"] == 200
    assert server.attributes["narwhal.tokens"] == 4
    assert attempt.parent is not None
    assert attempt.parent.span_id == server.context.span_id
    assert attempt.attributes is not None
    assert attempt.attributes["narwhal.attempt"] == 1
    assert attempt.attributes["narwhal.producer"] == "p0"
    assert attempt.attributes["narwhal.consumer"] == "d0"
    for leg, engine in ((prefill, "p0"), (decode, "d0")):
        assert leg.parent is not None
        assert leg.parent.span_id == attempt.context.span_id
        assert leg.kind is SpanKind.CLIENT
        assert leg.attributes is not None
        assert leg.attributes["narwhal.engine"] == engine
        assert leg.attributes["narwhal.outcome"] == "completed"
        # the engine got this leg's span as its parent, in the client's trace
        (entry,) = harness.engines[engine].log
        assert entry["traceparent"] == (f"00-{TRACE_ID}-{_hex(leg.context.span_id, 16)}-01")
    assert decode.attributes is not None
    assert decode.attributes["narwhal.tokens"] == 4
    await finish(harness)


async def test_without_an_incoming_traceparent_a_new_trace_starts(
    nursery: trio.Nursery, spans: InMemorySpanExporter
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 200
    await harness.router.wait_drained()
    (server,) = _named(spans, "POST /v1/completions")
    assert server.parent is None
    trace_id = _hex(server.context.trace_id, 32)
    for engine in ("p0", "d0"):
        (entry,) = harness.engines[engine].log
        assert entry["traceparent"].split("-")[1] == trace_id
    await finish(harness)


async def test_each_retry_is_an_attempt_span_of_its_own(
    nursery: trio.Nursery, spans: InMemorySpanExporter
) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5, retry_backoff_s=0.01, max_attempts=3),
        engine=EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
    )
    harness.engines["d0"].faults.push(Fault(kind="status", status=503, leg="decode"))
    harness.engines["d1"].faults.push(Fault(kind="status", status=503, leg="decode"))
    reply = await harness.post("/v1/completions", BODY, {"traceparent": TRACEPARENT})
    assert reply.status == 200
    await harness.router.wait_drained()
    (server,) = _named(spans, "POST /v1/completions")
    first, second, third = sorted(_named(spans, "attempt"), key=lambda s: s.start_time or 0)
    assert first.attributes is not None
    assert third.attributes is not None
    assert [a.attributes and a.attributes["narwhal.attempt"] for a in (first, second, third)] == [
        1,
        2,
        3,
    ]
    assert first.attributes["narwhal.outcome"] == "failed"
    assert first.attributes["narwhal.retry"] == "retry"
    assert first.attributes["narwhal.error"] == "scripted fault"
    assert first.status.status_code is StatusCode.ERROR
    assert third.attributes["narwhal.outcome"] == "completed"
    assert second.attributes is not None
    assert first.attributes["narwhal.consumer"] != second.attributes["narwhal.consumer"]
    for span in (first, second, third):
        assert span.parent is not None
        assert span.parent.span_id == server.context.span_id
    failed_decode = [
        s for s in _named(spans, "decode") if s.parent and s.parent.span_id == first.context.span_id
    ]
    assert len(failed_decode) == 1
    assert failed_decode[0].attributes is not None
    assert failed_decode[0].attributes["narwhal.outcome"] == "failed"
    assert server.attributes is not None
    assert server.attributes["narwhal.attempts"] == 3
    assert len(_named(spans, "prefill")) == 3
    await finish(harness)


async def test_a_client_disconnect_still_ends_every_span(
    nursery: trio.Nursery, spans: InMemorySpanExporter
) -> None:
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.05}
    )
    body = msgspec.json.encode({**BODY, "max_tokens": 200})
    with trio.fail_after(5):
        await open_stream_and_vanish(harness.url, body)
        await harness.router.wait_drained()
    names = sorted(s.name for s in spans.get_finished_spans())
    assert names == ["POST /v1/completions", "attempt", "decode", "prefill"]
    (server,) = _named(spans, "POST /v1/completions")
    (decode,) = _named(spans, "decode")
    (attempt,) = _named(spans, "attempt")
    for span in (server, decode, attempt):
        assert span.attributes is not None
        assert span.attributes["narwhal.outcome"] == "cancelled"
    await finish(harness, disconnects=1)


async def test_log_lines_of_a_traced_request_carry_its_trace_id(
    nursery: trio.Nursery, spans: InMemorySpanExporter
) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    requests_log = logging.getLogger("narwhal.requests")
    requests_log.addHandler(handler)
    level = requests_log.level
    requests_log.setLevel(logging.INFO)
    try:
        harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
        reply = await harness.post("/v1/completions", BODY, {"traceparent": TRACEPARENT})
        await harness.router.wait_drained()
    finally:
        requests_log.removeHandler(handler)
        requests_log.setLevel(level)
    (line,) = [msgspec.json.decode(raw) for raw in out.getvalue().splitlines()]
    assert line["trace_id"] == TRACE_ID
    assert line["request_id"] == reply.headers["x-request-id"]
    await finish(harness)


async def test_with_tracing_off_no_span_and_the_clients_context_passes_unchanged(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not tracing.ENABLED

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a span was made with tracing off")

    monkeypatch.setattr(tracing, "server_span", refuse)
    monkeypatch.setattr(tracing, "child_span", refuse)
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    reply = await harness.post("/v1/completions", BODY, {"traceparent": TRACEPARENT})
    assert reply.status == 200
    await harness.router.wait_drained()
    for engine in ("p0", "d0"):
        (entry,) = harness.engines[engine].log
        assert entry["traceparent"] == TRACEPARENT  # not a participant: forwarded as it came
    await finish(harness)
