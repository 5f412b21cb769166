"""Sans-IO meaning of a decode stream (contract 6): which SSE payloads are generated output.

A payload is decoded into a narrow struct (only the fields the router acts on) and
classified. A generated token is a choice with text, delta content, reasoning or tool
calls, or a finish reason (an empty completion that stopped at once is still output).
Role-only deltas, usage chunks and anything else are metadata: they keep a stream alive
but do not satisfy the first-token budget.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import msgspec

from narwhal.core.faults import InStreamError, Phase, StreamBroken
from narwhal.stream.payloads import Chunk, ErrorObject
from narwhal.stream.sse import DONE


class Kind(IntEnum):
    METADATA = 0
    TOKEN = 1
    DONE = 2


_decode_chunk = msgspec.json.Decoder(Chunk).decode


def parse_payload(payload: bytes) -> Chunk | None:
    """The chunk a ``data:`` payload carries; None for ``[DONE]``.

    Raises InStreamError for an error object and StreamBroken for garbage.
    """
    if payload == DONE:
        return None
    try:
        chunk = _decode_chunk(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise StreamBroken(
            f"engine sent a malformed stream chunk: {exc}", phase=Phase.DECODE
        ) from None
    if chunk.error is not None:
        raise in_stream_error(chunk.error)
    return chunk


def in_stream_error(err: ErrorObject) -> InStreamError:
    code = err.code
    status = code if type(code) is int and 400 <= code <= 599 else 500
    message = err.message if isinstance(err.message, str) else "engine reported an error"
    kind = err.type if isinstance(err.type, str) and err.type else "engine_error"
    return InStreamError(status, message, kind, phase=Phase.DECODE)


def kind_of(chunk: Chunk | None) -> Kind:
    """A chunk's kind: generated output, metadata, or (None) the end."""
    if chunk is None:
        return Kind.DONE
    for choice in chunk.choices:
        if choice.is_output():
            return Kind.TOKEN
    return Kind.METADATA


def completion_tokens(usage: dict[str, Any], field: str = "completion_tokens") -> int | None:
    """A usage object's ``completion_tokens`` (or another count; None: absent or not a
    count)."""
    count = usage.get(field)
    return count if type(count) is int and count >= 0 else None
