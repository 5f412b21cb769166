"""What a client reads of a streamed completion with ``return_token_ids``: the prompt's ids
where vLLM sends them, the generated ids and text, the usage, an in-stream error."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from narwhal.fake_engine import answers
from narwhal.stream.sse import SSEParser


@dataclass(slots=True)
class StreamRead:
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)  # every chunk's token_ids, in order
    text: str = ""
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    # every chunk that carried prompt ids: (its choice's index, "top" level or "choice")
    placements: list[tuple[int, str]] = field(default_factory=list)


def read_chunks(chunks: Iterable[bytes]) -> StreamRead:
    """The chunks' JSON (``data:`` payloads, ``[DONE]`` left out) read as one stream."""
    out = StreamRead()
    for raw in chunks:
        chunk = msgspec.json.decode(raw)
        if "error" in chunk:
            out.error = chunk["error"]
            continue
        if chunk.get("usage") is not None and not chunk["choices"]:
            out.usage = chunk["usage"]
        for choice in chunk["choices"]:
            _read_choice(out, chunk, choice)
    return out


def _read_choice(out: StreamRead, chunk: dict[str, Any], choice: dict[str, Any]) -> None:
    for where, holder in (("top", chunk), ("choice", choice)):
        if holder.get("prompt_token_ids") is not None:
            out.prompt_ids = holder["prompt_token_ids"]
            out.placements.append((choice["index"], where))
    out.ids += choice.get("token_ids") or []
    delta = choice.get("delta")
    out.text += (delta.get("content") or "") if delta is not None else choice["text"]


def read_sse(body: bytes) -> StreamRead:
    """A streamed response body, as the wire carries it."""
    return read_chunks(e for e in SSEParser().feed(body) if e != b"[DONE]")


def read_plan(plan: answers.StreamPlan) -> StreamRead:
    """A stream the fake engine plans, as a client would read it whole."""
    frames = [*plan.head, *(f for f in plan.tokens if f is not None)]
    return read_chunks(frames + ([plan.tail] if plan.tail is not None else []))
