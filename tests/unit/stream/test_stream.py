"""What counts as generated output in a decode stream (contract 6), on real vLLM chunks."""

from __future__ import annotations

import pytest

from narwhal.core.faults import InStreamError, StreamBroken
from narwhal.stream.events import Kind, kind_of, parse_payload
from narwhal.stream.sse import SSEParser
from tests.support.paths import CAPTURES


def _kinds(capture: str) -> list[Kind]:
    raw = (CAPTURES / capture).read_bytes()
    body = raw.split(b"\r\n\r\n", 1)[-1] if raw.startswith(b"HTTP/") else raw
    return [kind_of(parse_payload(p)) for p in SSEParser().feed(body)]


def test_chat_role_delta_and_usage_are_metadata() -> None:
    assert _kinds("single_chat_stream.txt") == [
        Kind.METADATA,
        Kind.TOKEN,
        Kind.TOKEN,
        Kind.TOKEN,
        Kind.METADATA,
        Kind.DONE,
    ]


def test_completion_tokens_and_usage() -> None:
    assert _kinds("single_stream_usage.txt") == [Kind.TOKEN] * 5 + [Kind.METADATA, Kind.DONE]


def test_an_empty_completion_that_stopped_is_output() -> None:
    chunk = parse_payload(b'{"choices":[{"index":0,"text":"","finish_reason":"stop"}]}')
    assert kind_of(chunk) is Kind.TOKEN


@pytest.mark.parametrize(
    "payload",
    [
        b'{"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}',
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}',
    ],
)
def test_reasoning_and_tool_calls_are_output(payload: bytes) -> None:
    assert kind_of(parse_payload(payload)) is Kind.TOKEN


def test_vllm_in_stream_error_keeps_its_status_and_message() -> None:
    raw = (CAPTURES / "edge_deadport.txt").read_bytes().split(b"\n", 1)[1]
    first = SSEParser().feed(raw)[0]
    with pytest.raises(InStreamError) as info:
        parse_payload(first)
    assert info.value.status == 500
    assert info.value.message == "Internal server error"
    assert info.value.kind == "InternalServerError"


@pytest.mark.parametrize(
    ("code", "status"), [(503, 503), (429, 429), (None, 500), ("oops", 500), (200, 500), (700, 500)]
)
def test_in_stream_error_status(code: object, status: int) -> None:
    import msgspec

    payload = msgspec.json.encode({"error": {"message": "m", "type": "t", "code": code}})
    with pytest.raises(InStreamError) as info:
        parse_payload(payload)
    assert info.value.status == status


@pytest.mark.parametrize("payload", [b"not json", b'{"choices": 5}', b"[1,2]", b'"str"'])
def test_garbage_is_a_broken_stream(payload: bytes) -> None:
    with pytest.raises(StreamBroken, match="malformed stream chunk"):
        parse_payload(payload)


def test_a_deeply_nested_chunk_is_a_broken_stream_not_a_crash() -> None:
    payload = b'{"choices": [{"text": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}"
    with pytest.raises(StreamBroken, match="malformed stream chunk"):
        parse_payload(payload)
