"""SSE framing, sans IO, on the shapes vLLM really sends."""

from __future__ import annotations

import pytest

from narwhal.stream.sse import SSEError, SSEParser, frame
from tests.support.paths import CAPTURES


def test_a_real_vllm_stream() -> None:
    raw = (CAPTURES / "single_stream_usage.txt").read_bytes()
    events = SSEParser().feed(raw)
    assert len(events) == 7
    assert events[0].startswith(b'{"id":"cmpl-8979ac1399d681ed"')
    assert events[-1] == b"[DONE]"


def test_crlf_comments_multiline_and_other_fields() -> None:
    raw = b": keep-alive\r\n\r\nevent: x\r\nid: 3\r\ndata: a\r\ndata:b\r\n\r\nretry: 5\n\n"
    assert SSEParser().feed(raw) == [b"a\nb"]


def test_an_unfinished_event_is_held_until_its_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"a"') == []
    assert parser.pending
    assert parser.feed(b": 1}\n") == []
    assert parser.feed(b"\n") == [b'{"a": 1}']
    assert not parser.pending


def test_an_oversized_event_is_our_error() -> None:
    parser = SSEParser(max_event_bytes=16)
    with pytest.raises(SSEError):
        parser.feed(b"data: " + b"x" * 17 + b"\n")
    with pytest.raises(SSEError):
        SSEParser(max_event_bytes=16).feed(b"y" * 17)


def test_frame() -> None:
    assert frame(b"[DONE]") == b"data: [DONE]\n\n"
    assert SSEParser().feed(frame(b"{}") + frame(b"[DONE]")) == [b"{}", b"[DONE]"]
