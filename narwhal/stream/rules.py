"""The rules of a decode stream, sans-IO (contract 6): engine bytes in, one action out per read.

``StreamRelay.feed(data)`` takes what one read of the engine's body returned and says what
the client is owed, h11-style: nothing yet (``HOLD``), the first output with the metadata
held before it (``FirstOutput``: a streaming client's response commits with it, the 200
headers first), more output (``Send``), the end
(``Finish``: the last bytes with ``[DONE]``, or the assembled JSON of a non-streaming
client), or a fault (``Fault``, with the output that came before it in the same read, so
the outcome never depends on how the engine's bytes were split). ``end_of_stream()`` is
the engine closing its body before ``[DONE]``.

The rules:
* metadata (role-only deltas, usage, comments) before the first generated token is held
  back and goes out with it; it never commits the response;
* ``[DONE]`` before any token is a broken stream (502), after one it finishes;
* an error object in the stream is a fault with its own status; garbage is a 502;
* the engine closing before ``[DONE]`` is a 502 (``stream ended before [DONE]``).

Token counts are the engine's own: ``generated`` is the ``completion_tokens`` of the usage
chunk (the last before ``[DONE]``, with no choices), which the router always asks the
decode leg for; ``tokens`` counts chunks with output, which drive the rules above (a chunk
may carry several tokens, or one whose text is held back). A streaming client that did not
ask for usage (``strip_usage``) does not get that chunk.

The request path, the readmission probe and ``narwhal check`` all read streams through it;
the trio shells around it only move bytes and own the clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from narwhal.core.faults import Phase, RequestFault, StreamBroken
from narwhal.stream.continuation import Kept
from narwhal.stream.events import Kind, completion_tokens, kind_of, parse_payload
from narwhal.stream.payloads import Chunk
from narwhal.stream.sse import DONE_FRAME, SSEError, SSEParser, frame


# The actions are slotted dataclasses, not msgspec structs: mypyc compiles this module into
# native classes, and a struct defined in a compiled module loses its options and its field
# types (docs/build.md).
@dataclass(slots=True)
class Hold:
    """Nothing for the client yet."""


@dataclass(slots=True)
class FirstOutput:
    """A streaming client's first output, the metadata held before it included: the client
    stream makes it the commit point (the 200 headers, then these bytes). A continuation
    never gives one: its client has output already."""

    data: bytes


@dataclass(slots=True)
class Send:
    data: bytes


@dataclass(slots=True)
class Finish:
    """The end of a good stream: the last bytes (streaming) or the JSON body."""

    data: bytes


@dataclass(slots=True)
class Fault:
    """The stream failed; ``flush`` (a FirstOutput or Send) goes out before the fault is told."""

    fault: RequestFault
    flush: FirstOutput | Send | None = None


HOLD = Hold()
Action = Hold | FirstOutput | Send | Finish | Fault


class Rewrite(Protocol):
    """A chunk as the client gets it (``narwhal.stream.continuation``); None: nothing."""

    def __call__(self, payload: bytes, chunk: Chunk, /) -> bytes | None: ...


class Collector(Protocol):
    """What assembles a non-streaming client's JSON (``narwhal.stream.assemble``)."""

    def add(self, payload: bytes) -> None: ...  # one chunk's raw JSON
    def body(self) -> bytes: ...


REPLY_PIECE = 32  # tokens' texts joined into one string


class Reply:
    """The first choice's generated text, kept for the prefix index. Joined every
    ``REPLY_PIECE`` tokens: a string per token would cost an object (about 50 bytes)
    beside the few bytes of its text, for as long as the stream is open."""

    __slots__ = ("_pieces", "_tail")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._tail = 0  # pieces added since the last join

    def add(self, text: str) -> None:
        pieces = self._pieces
        pieces.append(text)
        self._tail += 1
        if self._tail == REPLY_PIECE:
            pieces[-REPLY_PIECE:] = ["".join(pieces[-REPLY_PIECE:])]
            self._tail = 0

    def text(self) -> str:
        return "".join(self._pieces)


class StreamRelay:
    """One decode stream's rules. ``collector`` None: the client streams (SSE relayed)."""

    __slots__ = (
        "_before",
        "_collector",
        "_held",
        "_parser",
        "_rewrite",
        "_strip_usage",
        "generated",
        "kept",
        "output_started",
        "prompt_tokens",
        "reply",
        "tokens",
    )

    def __init__(
        self,
        collector: Collector | None = None,
        *,
        strip_usage: bool = False,
        keep_reply: bool = False,
        kept: Kept | None = None,
        rewrite: Rewrite | None = None,
        resumed_at: int | None = None,
    ) -> None:
        self._collector = collector
        # stream resume (contract 6.4): the ids and head the stream keeps, and how each chunk
        # is written for the client (its ids put back to null, or a continuation reframed)
        self.kept = kept
        self._rewrite = rewrite
        # the first choice's generated text, kept for the prefix index (a consumer caches
        # what it generated: the next turn of a conversation starts with it)
        self.reply: Reply | None = Reply() if keep_reply else None
        self._strip_usage = strip_usage and collector is None
        self._parser = SSEParser()
        self._held: list[bytes] = []  # framed metadata waiting for the first token
        self.tokens = 0  # chunks with output
        self.generated: int | None = None  # tokens, as the engine's usage counts them
        self._before = 0
        self.prompt_tokens: int | None = None  # and the prompt's (a local leg computed it)
        # the first output was given (a FirstOutput): later output is Send. Not the commit
        # point itself, which is the request's (a JSON answer commits only at the end)
        self.output_started = False
        if resumed_at is not None:
            # a continuation: its client has output already, which counts as its own
            self.tokens = self._before = resumed_at
            self.output_started = True

    def feed(self, data: bytes) -> Action:
        out = self._held
        try:
            for payload in self._payloads(data):
                chunk = parse_payload(payload)
                if chunk is None:
                    if not self.tokens:
                        raise StreamBroken(
                            "stream ended with [DONE] before any token arrived",
                            phase=Phase.DECODE,
                        )
                    return self._finish(out)
                if self.kept is not None:
                    self.kept.observe(chunk)
                if kind_of(chunk) is Kind.TOKEN:
                    self.tokens += 1
                    if self.reply is not None:
                        _keep_text(chunk, self.reply)
                elif chunk.usage is not None and not chunk.choices:  # the usage chunk
                    generated = completion_tokens(chunk.usage)
                    self.generated = None if generated is None else self._before + generated
                    self.prompt_tokens = completion_tokens(chunk.usage, "prompt_tokens")
                    if self._strip_usage:
                        continue
                if self._rewrite is not None:
                    rewritten = self._rewrite(payload, chunk)
                    if rewritten is None:
                        continue
                    payload = rewritten
                if self._collector is not None:
                    self._collector.add(payload)
                else:
                    out.append(frame(payload))
        except RequestFault as fault:
            return Fault(fault, self._output(out) if out and self.tokens else None)
        if not self.tokens:
            return HOLD
        self._held = []
        return self._output(out) if out else HOLD

    def end_of_stream(self) -> Fault:
        """The engine's body ended without ``[DONE]``."""
        phase = Phase.STREAM if self.tokens else Phase.DECODE
        return Fault(StreamBroken("stream ended before [DONE]", phase=phase))

    def _payloads(self, data: bytes) -> list[bytes]:
        try:
            return self._parser.feed(data)
        except SSEError as exc:  # an engine's unframeable bytes are its fault (502)
            raise StreamBroken(
                f"engine sent a malformed stream: {exc}", phase=Phase.DECODE
            ) from None

    def _output(self, out: list[bytes]) -> FirstOutput | Send:
        data = b"".join(out)
        if self.output_started:
            return Send(data)
        self.output_started = True
        return FirstOutput(data)

    def _finish(self, out: list[bytes]) -> Finish:
        if self._collector is not None:
            return Finish(self._collector.body())
        return Finish(b"".join(out) + DONE_FRAME)


def _keep_text(chunk: Chunk, reply: Reply) -> None:
    for choice in chunk.choices:
        if choice.index == 0:
            delta = choice.delta
            text = choice.text if delta is None else delta.content
            if text:
                reply.add(text)
