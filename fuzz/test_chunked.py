"""Properties of the data legs' chunked decoder: any byte split of a valid chunked body
gives the same bytes and the same end; arbitrary bytes give data or our error, never
another exception; data is emitted as it arrives, never held for a whole chunk."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import examples, split
from narwhal.stream.chunked import ChunkedDecoder, ChunkedError


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A chunked encoding (with extensions, hex case and trailers varied) and its data."""
    wire, data = b"", b""
    for chunk in draw(st.lists(st.binary(min_size=1, max_size=300), max_size=6)):
        size = b"%x" % len(chunk) if draw(st.booleans()) else b"%X" % len(chunk)
        ext = draw(st.sampled_from([b"", b";name=value", b" ;x"]))
        wire += size + ext + b"\r\n" + chunk + b"\r\n"
        data += chunk
    trailers = draw(st.sampled_from([b"", b"x-trailer: 1\r\n"]))
    return wire + b"0\r\n" + trailers + b"\r\n", data


@settings(max_examples=examples(300))
@given(bodies(), st.lists(st.integers(0, 5000), max_size=12), st.binary(max_size=8))
def test_any_split_gives_the_same_body(
    body: tuple[bytes, bytes], cuts: list[int], extra: bytes
) -> None:
    wire, data = body
    decoder, out = ChunkedDecoder(), b""
    for piece in split(wire + extra, cuts):
        out += b"".join(decoder.feed(piece))
    assert out == data
    assert decoder.done
    assert decoder.leftover == extra


@settings(max_examples=examples(300))
@given(st.binary(max_size=400), st.lists(st.integers(0, 500), max_size=6))
def test_arbitrary_bytes_give_data_or_our_error(garbage: bytes, cuts: list[int]) -> None:
    decoder = ChunkedDecoder()
    try:
        for piece in split(garbage, cuts):
            decoder.feed(piece)
    except ChunkedError:
        pass


def test_data_is_emitted_as_it_arrives() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"10\r\nabcd") == [b"abcd"]  # 4 of 16 bytes: out at once
    assert decoder.feed(b"efghijklmnop\r\n0\r\n\r\n") == [b"efghijklmnop"]
    assert decoder.done


def test_bad_framing_is_our_error() -> None:
    for wire in (b"zz\r\n", b"0x10\r\n", b"1_0\r\n", b"-1\r\n", b"3\r\nabcXY", b"1" * 5000):
        try:
            ChunkedDecoder().feed(wire)
        except ChunkedError:
            continue
        raise AssertionError(f"{wire[:20]!r} accepted")
