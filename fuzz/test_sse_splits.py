"""Property tests for the SSE parser, the h11 way: any split gives the same events, and
arbitrary bytes give our error or events, never another exception."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import examples, split
from narwhal.stream.sse import SSEError, SSEParser

payloads = st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))
line_ends = st.sampled_from([b"\n", b"\r\n"])


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A stream of events with comments and other fields mixed in, and its payloads."""
    out, expected = b"", []
    for _ in range(draw(st.integers(0, 8))):
        end = draw(line_ends)
        if draw(st.booleans()):
            out += b":" + draw(payloads) + end
        lines = draw(st.lists(payloads, min_size=1, max_size=3))
        for line in lines:
            out += b"data: " + line + end
        out += draw(line_ends)
        expected.append(b"\n".join(lines))
    return out, expected


@settings(max_examples=examples(300))
@given(streams(), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_byte_split_gives_the_same_events(
    stream: tuple[bytes, list[bytes]], cuts: list[int]
) -> None:
    data, expected = stream
    parser = SSEParser()
    got: list[bytes] = []
    for piece in split(data, cuts):
        got += parser.feed(piece)
    assert got == expected
    assert not parser.pending


@settings(max_examples=examples(300))
@given(st.lists(st.binary(max_size=300), max_size=10))
def test_arbitrary_bytes_give_events_or_our_error(pieces: list[bytes]) -> None:
    parser = SSEParser(max_event_bytes=512)
    try:
        for piece in pieces:
            for event in parser.feed(piece):
                assert isinstance(event, bytes)
    except SSEError:
        pass
