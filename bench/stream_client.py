"""A streaming client that reads what it receives: the first token's time, the gaps
between later chunks, and the generated text (bench/placement.py's newer workloads).

bench/peers.py's ``one_request`` times only the first ``data: {`` of a completion: that is
enough when nothing after the first token is measured. A multi-turn chat needs the reply's
exact text (the next turn sends it back as the assistant's message), and the interference
of local prefills shows only in the gaps between a running decode's chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from narwhal.core.faults import Phase
from narwhal.engines.transport import Pool

DONE = b"data: [DONE]"


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None  # chat
    text: str | None = None  # completions


class _Event(msgspec.Struct):
    """The fields of an SSE event we read; the rest is skipped by the decoder."""

    choices: list[_Choice] = []
    error: Any = None


_decode = msgspec.json.Decoder(_Event).decode


@dataclass
class Outcome:
    """One streamed request as its client saw it."""

    failure: str | None = None  # why it failed; None: a whole stream ending in [DONE]
    ttft: float | None = None  # seconds from sending to the first non-empty token text
    gaps: list[float] = field(default_factory=list)  # seconds between later token reads
    text: str = ""  # the token texts, concatenated (a chat reply: what the next turn sends)


def _texts(event: bytes) -> str:
    """The token text of one ``data: {...}`` event ("" for role, usage and error events)."""
    parsed = _decode(event)
    if parsed.error is not None:
        raise ValueError("error event")
    out = []
    for choice in parsed.choices:
        if choice.delta is not None and choice.delta.content:
            out.append(choice.delta.content)
        elif choice.text:
            out.append(choice.text)
    return "".join(out)


class _Reader:
    """SSE events out of a byte stream split anywhere; the time of each read with text."""

    def __init__(self, start: float, outcome: Outcome) -> None:
        self.start = start
        self.outcome = outcome
        self.buffer = b""
        self.last_read: float | None = None  # the previous read that carried token text
        self.done = False

    def feed(self, batch: bytes, now: float) -> None:
        self.buffer += batch
        *events, self.buffer = self.buffer.split(b"\n\n")
        text = "".join(_texts(e[6:]) for e in events if e.startswith(b"data: {"))
        self.done = self.done or any(e.startswith(DONE) for e in events)
        if not text:
            return
        # chunks that one read brings together are one arrival for the client: a gap is
        # measured between reads, so a router that coalesces tokens shows its longer gaps
        if self.last_read is None:
            self.outcome.ttft = now - self.start
        else:
            self.outcome.gaps.append(now - self.last_read)
        self.last_read = now
        self.outcome.text += text


async def stream_request(pool: Pool, path: bytes, body: bytes) -> Outcome:
    """POST a streamed request to ``path``; the stream as the client received it. Bounded
    by the caller's cancel scope (and the pool's connect timeout)."""
    outcome = Outcome()
    reader = _Reader(time.perf_counter(), outcome)
    async with await pool.request(
        b"POST", path, [(b"content-type", b"application/json")], body, phase=Phase.DECODE
    ) as resp:
        try:
            while (batch := await resp.next_batch()) is not None:
                reader.feed(batch, time.perf_counter())
        except (ValueError, msgspec.DecodeError) as exc:
            outcome.failure = f"bad stream: {exc}"[:60]
            return outcome
        if resp.status != 200:
            outcome.failure = f"HTTP {resp.status}"
        elif not reader.done:
            outcome.failure = "stream ended without [DONE]"
    return outcome
