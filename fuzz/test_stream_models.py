"""Hypothesis stream models: generated decode streams, played by a fake engine on
the in-memory network under trio's MockClock, and what the client sees through the router
checked against a small reference model of docs/contract.md section 6.

A stream is: a header delay, then events (token, metadata chunk, comment, error object,
garbage, ``[DONE]``), each after a delay and written in arbitrary byte splits, then an
ending (clean end of body, connection closed, or silence). The model says, for a streaming
and a non-streaming client: the status, the tokens, and the terminal event or error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz import examples, split
from fuzz.streams import Event, events
from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL
from tests.support.memory_fleet import RecordingSink, memory_fleet

FIRST_TOKEN_S = 2.55  # off the 0.1 s grid of the delays: no ties with a deadline
SILENCE_S = 1.05
EXAMPLES = examples(100)

# ---- the generated stream ------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    header_delay: float
    events: list[tuple[float, Event, list[int]]]  # (delay before, event, byte cut points)
    ending: str  # end | close | hang

    def script(self) -> list[tuple[str, Any]]:
        steps: list[tuple[str, Any]] = [("sleep", self.header_delay), ("headers", None)]
        for delay, event, cuts in self.events:
            steps.append(("sleep", delay))
            steps += [("write", piece) for piece in split(event.frame(), cuts) if piece]
        steps.append((self.ending, None))
        return steps


delays = st.sampled_from([0.0, 0.0, 0.0, 0.3, 0.9, 1.7, 3.1])
streams = st.builds(
    Stream,
    st.sampled_from([0.0, 0.3, 3.1]),
    st.lists(
        st.tuples(delays, events, st.lists(st.integers(0, 400), max_size=3)),
        max_size=8,
    ),
    st.sampled_from(["end", "close", "hang"]),
)

# ---- the reference model (contract 6) ----------------------------------------------------------


@dataclass
class Seen:
    """What a client sees: committed 200 or not, status, tokens, how it ended."""

    status: int
    tokens: list[str]
    ending: str  # "done" or "error"
    message: str = ""


def expected(stream: Stream) -> Seen:
    t = stream.header_delay
    tokens: list[str] = []
    if t > FIRST_TOKEN_S:
        return _fail(tokens, 504, "no first token within")
    last = t
    for delay, event, _ in stream.events:
        t += delay
        if tokens and t - last > SILENCE_S:
            return _fail(tokens, 504, "engine went silent between tokens")
        if not tokens and t > FIRST_TOKEN_S:  # metadata does not stop the first-token clock
            return _fail(tokens, 504, "no first token within")
        last = t
        if event.kind == "token":
            tokens.append(event.text)
        elif event.kind == "done":
            if not tokens:
                return _fail(tokens, 502, "stream ended with [DONE] before any token arrived")
            return Seen(200, tokens, "done")
        elif event.kind == "error":
            code = event.code if type(event.code) is int and 400 <= event.code <= 599 else 500
            return _fail(tokens, code, event.text)
        elif event.kind == "garbage":
            return _fail(tokens, 502, "engine sent a malformed stream chunk")
    if stream.ending == "hang":
        if tokens:
            return _fail(tokens, 504, "engine went silent between tokens")
        return _fail(tokens, 504, "no first token within")
    if stream.ending == "close" and not tokens:
        return _fail(tokens, 502, "")  # the engine's connection broke: any 502 message
    return _fail(tokens, 502, "stream ended before [DONE]")


def _fail(tokens: list[str], status: int, message: str) -> Seen:
    return Seen(status, tokens, "error", message)


# ---- running it through the router ------------------------------------------------------------


async def _through_router(stream: Stream, streaming: bool) -> RecordingSink:
    async with trio.open_nursery() as nursery:
        fleet = await memory_fleet(
            nursery,
            serving=ServingConfig(request_timeout_s=100.0),
            engine=EngineConfig(
                first_token_timeout_s=FIRST_TOKEN_S, decode_read_timeout_s=SILENCE_S
            ),
        )
        fleet.consumer.faults.push(Fault(kind="script", value=stream.script()))
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 8, "stream": streaming}
        with trio.fail_after(200):  # virtual seconds: a hang here is a router bug
            sink = await fleet.request(body)
        nursery.cancel_scope.cancel()
    return sink


def seen(sink: RecordingSink, streaming: bool) -> Seen:
    kinds = [what for _, what, _ in sink.events]
    if "json" in kinds:
        status, body = sink.events[kinds.index("json")][2]
        if status != 200:
            return Seen(status, [], "error", body["error"]["message"])
        return Seen(200, list(body["choices"][0]["text"]), "done")
    assert streaming, kinds
    data = b"".join(d for _, what, d in sink.events if what in ("commit", "send", "end", "cut"))
    payloads = SSEParser().feed(data)
    tokens = []
    for payload in payloads[:-1]:
        for choice in msgspec.json.decode(payload)["choices"]:
            tokens.append(choice["text"])
    if payloads[-1] == b"[DONE]":
        return Seen(200, tokens, "done")
    error = msgspec.json.decode(payloads[-1])["error"]
    assert kinds[-1] == "cut", kinds  # the terminal event, then the body is cut (contract 6)
    return Seen(200, tokens, "error", error["message"])


def check(stream: Stream, streaming: bool) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    sink = trio.run(_through_router, stream, streaming, clock=clock)
    got, want = seen(sink, streaming), expected(stream)
    if streaming and want.tokens:  # committed at the first token: a terminal event after it
        assert got.status == 200
        assert got.tokens == want.tokens
        assert got.ending == want.ending
        assert got.message.startswith(want.message)
        if want.ending == "error":
            data = b"".join(
                d for _, what, d in sink.events if what in ("commit", "send", "end", "cut")
            )
            code = msgspec.json.decode(SSEParser().feed(data)[-1])["error"]["code"]
            assert code == want.status
        return
    if not streaming and want.ending == "done":
        assert (got.status, "".join(got.tokens)) == (200, "".join(want.tokens))
        return
    assert (got.status, got.ending) == (want.status, want.ending)
    assert got.message.startswith(want.message), (got.message, want.message)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_a_streaming_client_sees_what_the_model_says(stream: Stream) -> None:
    check(stream, streaming=True)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams)
def test_a_non_streaming_client_sees_what_the_model_says(stream: Stream) -> None:
    check(stream, streaming=False)
