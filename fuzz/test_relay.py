"""``StreamRelay`` against the stream model of ``fuzz/test_stream_models.py`` (contract 6),
without clocks: any generated decode stream, cut into reads at any points, gives the
client the same bytes and the same verdict, and the actions keep their order (nothing
before the first token, one FirstOutput, then Sends, then a Finish or a Fault)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import examples, split
from fuzz.streams import Event, events
from narwhal.stream.assemble import Assembler
from narwhal.stream.rules import HOLD, Fault, Finish, FirstOutput, Send, StreamRelay
from narwhal.stream.sse import DONE_FRAME, SSEParser

EXAMPLES = examples(300)
streams = st.tuples(
    st.lists(events, max_size=10),
    st.lists(st.integers(0, 2000), max_size=12),  # read boundaries
)


def model(evs: list[Event]) -> tuple[list[bytes], tuple[int, str] | None]:
    """The SSE payloads a streaming client gets, and the fault (status, message start) that
    ends the stream (None: it finished with ``[DONE]``)."""
    payloads: list[bytes] = []
    tokens = 0
    for event in evs:
        frame = event.frame()
        if event.kind == "token":
            tokens += 1
            payloads.append(frame[len(b"data: ") : -2])
        elif event.kind == "usage":
            payloads.append(frame[len(b"data: ") : -2])
        elif event.kind == "done":
            if not tokens:
                return [], (502, "stream ended with [DONE] before any token arrived")
            return [*payloads, b"[DONE]"], None
        elif event.kind == "error":
            code = event.code if type(event.code) is int and 400 <= event.code <= 599 else 500
            return (payloads if tokens else []), (code, event.text)
        elif event.kind == "garbage":
            return (payloads if tokens else []), (502, "engine sent a malformed stream chunk")
    return (payloads if tokens else []), (502, "stream ended before [DONE]")


def run(
    relay: StreamRelay, evs: list[Event], cuts: list[int]
) -> tuple[list[Any], tuple[int, str] | None]:
    data = b"".join(e.frame() for e in evs)
    actions: list[Any] = []
    for piece in split(data, cuts):
        action = relay.feed(piece)
        actions.append(action)
        if isinstance(action, Fault | Finish):
            return actions, None
    actions.append(relay.end_of_stream())
    return actions, None


@settings(max_examples=EXAMPLES, deadline=None)
@given(streams)
def test_a_streaming_client_gets_what_the_model_says_however_the_reads_fall(
    stream: tuple[list[Event], list[int]],
) -> None:
    evs, cuts = stream
    relay = StreamRelay()
    actions, _ = run(relay, evs, cuts)
    sent = b""
    first_given = False
    verdict: tuple[int, str] | None = None
    for action in actions:
        if isinstance(action, Fault):
            if action.flush is not None:
                assert relay.tokens > 0
                action = action.flush
            else:
                action = None
            verdict = (actions[-1].fault.status, actions[-1].fault.message)
        if action is None or action is HOLD:
            continue
        if isinstance(action, FirstOutput):
            assert not first_given  # one first output, before any other output
            first_given = True
        elif isinstance(action, Send):
            assert first_given
        elif isinstance(action, Finish):
            assert action.data.endswith(DONE_FRAME)
        sent += action.data
    want_payloads, want_fault = model(evs)
    assert SSEParser().feed(sent) == want_payloads
    if want_fault is None:
        assert isinstance(actions[-1], Finish)
    else:
        assert verdict is not None
        assert verdict[0] == want_fault[0]
        assert verdict[1].startswith(want_fault[1])


@settings(max_examples=EXAMPLES, deadline=None)
@given(streams)
def test_a_non_streaming_client_gets_the_whole_answer_or_the_fault(
    stream: tuple[list[Event], list[int]],
) -> None:
    evs, cuts = stream
    relay = StreamRelay(Assembler(chat=False, model="m"))
    actions, _ = run(relay, evs, cuts)
    assert all(isinstance(a, type(HOLD)) for a in actions[:-1])  # nothing before the end
    want_payloads, want_fault = model(evs)
    last = actions[-1]
    if want_fault is None:
        assert isinstance(last, Finish)
        text = msgspec.json.decode(last.data)["choices"][0]["text"]
        tokens = [msgspec.json.decode(p) for p in want_payloads[:-1]]
        assert text == "".join(c["choices"][0]["text"] for c in tokens if c["choices"])
    else:
        assert isinstance(last, Fault)
        assert last.flush is None
        assert (last.fault.status, last.fault.message[: len(want_fault[1])]) == want_fault


def test_metadata_alone_never_commits() -> None:
    relay = StreamRelay()
    usage = Event("usage").frame()
    assert relay.feed(usage + b": keep-alive\n\n") is HOLD
    first = relay.feed(Event("token", "a").frame())
    assert isinstance(first, FirstOutput)
    assert first.data == usage + Event("token", "a").frame()  # held metadata goes out with it
