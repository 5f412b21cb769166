"""A stream resumed after a failure, sans-IO: what the client reads is one stream (contract 6.4).

The engine side is vLLM's wire shape with ``return_token_ids``: a chat stream's first chunk
carries the prompt's ids, a completion's first choice does; each token chunk lists its ids.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from narwhal.stream.continuation import Kept, Reframer, without_ids
from narwhal.stream.events import parse_payload
from narwhal.stream.rules import Fault, Finish, FirstOutput, Send, StreamRelay
from narwhal.stream.sse import SSEParser

_encode = msgspec.json.encode
WORDS = [" the", " sea", " ice", " tusk", " deep", " cold", " blue", " north"]
PROMPT_IDS = [5, 6, 7]


def head(chat: bool, rid: str = "cmpl-client") -> dict[str, Any]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": 17, "model": "m"}


def first_stream(chat: bool, ids: list[int], *, finished: bool) -> list[bytes]:
    """The client's original stream, as a consumer sends it with ``return_token_ids``."""
    out = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        out.append(_encode({**head(chat), "choices": [role], "prompt_token_ids": PROMPT_IDS}))
    for n, i in enumerate(ids):
        last = finished and n == len(ids) - 1
        out.append(_encode({**head(chat), "choices": [token_choice(chat, i, n, last)]}))
    return out


def token_choice(chat: bool, i: int, n: int, last: bool) -> dict[str, Any]:
    text = WORDS[i % len(WORDS)]
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
    if chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
        choice["prompt_token_ids"] = PROMPT_IDS if n == 0 else None
    choice["token_ids"] = [i]
    return choice


def continuation_stream(ids: list[int], before: int) -> list[bytes]:
    """A ``/v1/completions`` continuation of ``ids`` (its own head, its own usage)."""
    other = head(False, "cmpl-continuation")
    out = []
    for n, i in enumerate(ids):
        choice = token_choice(False, i, n, n == len(ids) - 1)
        choice["prompt_token_ids"] = [*PROMPT_IDS, *range(before)] if n == 0 else None
        out.append(_encode({**other, "model": "m", "choices": [choice]}))
    usage = {"prompt_tokens": len(PROMPT_IDS) + before, "completion_tokens": len(ids)}
    out.append(_encode({**other, "choices": [], "usage": usage}))
    return out


def sse(payloads: list[bytes], done: bool) -> bytes:
    body = b"".join(b"data: " + p + b"\n\n" for p in payloads)
    return body + (b"data: [DONE]\n\n" if done else b"")


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


def relay_out(relay: StreamRelay, reads: list[bytes]) -> tuple[bytes, bool]:
    """What the client got from these reads, and whether the stream ended."""
    out = b""
    for data in reads:
        match relay.feed(data):
            case FirstOutput(data=d) | Send(data=d):
                out += d
            case Finish(data=d):
                return out + d, True
            case Fault(flush=flush):
                return out + (flush.data if flush is not None else b""), False
    return out, False


def client_text(body: bytes, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    chunks = [msgspec.json.decode(p) for p in SSEParser().feed(body) if p != b"[DONE]"]
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return text, chunks


@given(
    chat=st.booleans(),
    script=st.lists(st.integers(min_value=0, max_value=50), min_size=2, max_size=24),
    failure=st.integers(min_value=1, max_value=23),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
    cuts_after=st.lists(st.integers(min_value=0, max_value=4000), max_size=6),
    usage=st.booleans(),
)
def test_the_client_reads_one_stream_whatever_the_failure_point_and_chunking(
    chat: bool,
    script: list[int],
    failure: int,
    cuts: list[int],
    cuts_after: list[int],
    usage: bool,
) -> None:
    """The client's text is exactly the failed attempt's output followed by what the
    continuation generated after its last relayed token; one usage, counting the prompt
    once and every generated token; every chunk of the client's stream id and model."""
    k = min(failure, len(script) - 1)
    kept = Kept()
    first = StreamRelay(kept=kept, rewrite=without_ids, strip_usage=not usage)
    body, ended = relay_out(
        first, split(sse(first_stream(chat, script[:k], finished=False), False), cuts)
    )
    assert not ended
    assert kept.ids == script[:k]
    assert kept.prompt_ids == PROMPT_IDS
    assert kept.refusal() is None
    frames = Reframer(kept, chat=chat, with_ids=False, prompt_tokens=3, before=k)
    rest = StreamRelay(kept=kept, rewrite=frames, strip_usage=not usage, resumed_at=k)
    more, ended = relay_out(rest, split(sse(continuation_stream(script[k:], k), True), cuts_after))
    assert ended
    text, chunks = client_text(body + more, chat)
    assert text == "".join(WORDS[i % len(WORDS)] for i in script)
    assert {(c["id"], c["model"], c["object"]) for c in chunks} == {
        ("cmpl-client", "m", "chat.completion.chunk" if chat else "text_completion")
    }
    assert all(
        c.get("token_ids") is None and c.get("prompt_token_ids") is None
        for chunk in chunks
        for c in [chunk, *chunk["choices"]]
    )
    usages = [c["usage"] for c in chunks if c.get("usage")]
    expected = {
        "prompt_tokens": 3,
        "completion_tokens": len(script),
        "total_tokens": 3 + len(script),
    }
    assert usages == ([expected] if usage else [])
    assert rest.generated == len(script)
    assert kept.ids == script


def test_a_client_that_asked_for_token_ids_gets_them_across_the_resume() -> None:
    kept = Kept()
    first = StreamRelay(kept=kept)
    body, _ = relay_out(first, [sse(first_stream(True, [1, 2], finished=False), False)])
    frames = Reframer(kept, chat=True, with_ids=True, prompt_tokens=3, before=2)
    rest = StreamRelay(kept=kept, rewrite=frames, resumed_at=2)
    more, _ = relay_out(rest, [sse(continuation_stream([3, 4], 2), True)])
    _, chunks = client_text(body + more, chat=True)
    ids = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids") or []]
    assert ids == [1, 2, 3, 4]
    assert chunks[0]["prompt_token_ids"] == PROMPT_IDS  # as the engine sent it


def test_a_chat_continuation_is_written_as_chat_deltas_with_the_stop_reason() -> None:
    kept = Kept()
    relay_out(StreamRelay(kept=kept), [sse(first_stream(True, [1], finished=False), False)])
    frames = Reframer(kept, chat=True, with_ids=False, prompt_tokens=3, before=1)
    payload = continuation_stream([2], 1)[0]
    chunk = msgspec.json.decode(frames(payload, _chunk(payload)) or b"")
    assert chunk["choices"] == [
        {
            "index": 0,
            "delta": {"content": WORDS[2]},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
        }
    ]


def _chunk(payload: bytes) -> Any:
    return parse_payload(payload)


def test_an_empty_chat_delta_is_not_written() -> None:
    kept = Kept()
    frames = Reframer(kept, chat=True, with_ids=False, prompt_tokens=1, before=1)
    payload = _encode({**head(False), "choices": [{"index": 0, "text": "", "token_ids": [9]}]})
    assert frames(payload, _chunk(payload)) is None


def test_what_cannot_continue() -> None:
    reasoning = Kept()
    chunk = {**head(True), "choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    relay_out(StreamRelay(kept=reasoning), [sse([_encode(chunk)], False)])
    assert reasoning.refusal() == "reasoning sent"
    unreported = Kept()  # an engine that does not report ids: nothing to continue from
    plain = {**head(False), "choices": [{"index": 0, "text": " x"}]}
    relay_out(StreamRelay(kept=unreported), [sse([_encode(plain)], False)])
    assert unreported.refusal() == "token ids not reported"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    st.dictionaries(st.text(max_size=12), JSON, max_size=5),
    # vLLM's lists of ids, or whatever a hostile engine puts there
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5) | JSON,
    st.booleans(),
)
def test_ids_are_put_back_to_null_and_nothing_else_moves(
    other: dict[str, Any], ids: Any, spaced: bool
) -> None:
    """Whatever else a chunk holds (a text that spells the key included), only the id
    lists become null."""
    other = {k: v for k, v in other.items() if k not in ("token_ids", "prompt_token_ids")}
    chunk = {
        **other,
        "choices": [{"text": '"token_ids":[1]', "token_ids": ids}],
        "prompt_token_ids": ids,
    }
    payload = _encode(chunk)
    if spaced:
        payload = json.dumps(chunk, indent=1).encode()
    stripped = msgspec.json.decode(without_ids(payload))
    chunk["choices"][0]["token_ids"] = None
    chunk["prompt_token_ids"] = None
    assert stripped == chunk


def test_what_a_hostile_engine_puts_in_the_ids_does_not_break_the_chunk() -> None:
    for ids in (b"[[1,2],[3]]", b'[1,"a]b",2]', b'{"a":1}'):
        payload = b'{"choices":[{"text":"x","token_ids":' + ids + b'}],"prompt_token_ids":[1]}'
        assert msgspec.json.decode(without_ids(payload)) == {
            "choices": [{"text": "x", "token_ids": None}],
            "prompt_token_ids": None,
        }


def test_ids_held_back_without_their_text_are_not_counted_as_sent() -> None:
    kept = Kept()
    chunks = [
        {
            **head(False),
            "choices": [{"index": 0, "text": " a", "token_ids": [1], "prompt_token_ids": [9]}],
        },
        {**head(False), "choices": [{"index": 0, "text": "", "token_ids": [2, 3]}]},
    ]
    relay_out(StreamRelay(kept=kept), [sse([_encode(c) for c in chunks], False)])
    assert kept.sent() == [1]  # 2 and 3 are generated again
    assert kept.refusal() is None


def test_a_finished_choice_is_not_continued() -> None:
    kept = Kept()
    done = {
        "index": 0,
        "text": " a",
        "token_ids": [1],
        "prompt_token_ids": [9],
        "finish_reason": "stop",
    }
    relay_out(StreamRelay(kept=kept), [sse([_encode({**head(False), "choices": [done]})], False)])
    assert kept.refusal() == "stream finished"
