"""Non-streaming assembly (contract 3, "Completeness"): any generated sequence of chat deltas
(content, reasoning, refusal, tool-call fragments split at arbitrary points, logprobs) and
of completion chunks (text, logprobs), folded by the Assembler through the StreamRelay,
gives the message a reference fold of the whole answer gives."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import examples
from narwhal.stream.assemble import Assembler
from narwhal.stream.rules import Finish, StreamRelay

EXAMPLES = examples(200)
text = st.text(alphabet='ab é{}":,', max_size=6)


@st.composite
def chat_answer(draw: st.DrawFn) -> dict[str, Any]:
    """A whole answer: what the fold must give back."""
    calls = draw(
        st.lists(st.tuples(st.sampled_from(["get_weather", "lookup"]), text, text), max_size=3)
    )
    return {
        "content": draw(text),
        "reasoning": draw(text),
        "refusal": draw(st.one_of(st.none(), text)),
        "calls": [
            {"id": f"call_{i}", "name": name, "arguments": a + b}
            for i, (name, a, b) in enumerate(calls)
        ],
        "logprobs": draw(
            st.lists(st.fixed_dictionaries({"token": text, "logprob": st.floats(-5, 0)}))
        ),
        "finish": draw(st.sampled_from(["stop", "length", "tool_calls"])),
    }


def pieces(draw: st.DrawFn, value: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(value)), max_size=3)))
    bounds = [0, *cuts, len(value)]
    return [value[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def chat_stream(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An answer and the deltas a vLLM stream carries it in, split at arbitrary points."""
    answer = draw(chat_answer())
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"reasoning_content": p} for p in pieces(draw, answer["reasoning"]) if p]
    deltas += [{"content": p} for p in pieces(draw, answer["content"]) if p]
    if answer["refusal"] is not None:
        deltas += [{"refusal": p} for p in pieces(draw, answer["refusal"])]
    for i, call in enumerate(answer["calls"]):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": ""},
                    }
                ]
            }
        )
        for part in pieces(draw, call["arguments"]):
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": part}}]})
    chunks = []
    logprobs = list(answer["logprobs"])
    for n, delta in enumerate(deltas):
        take = draw(st.integers(0, len(logprobs))) if n < len(deltas) - 1 else len(logprobs)
        lp, logprobs = logprobs[:take], logprobs[take:]
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": {"content": lp} if lp else None,
            "finish_reason": None,
        }
        chunks.append(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "created": 7,
                "model": "m",
                "choices": [choice],
            }
        )
    chunks.append(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": ""},
                    "logprobs": None,
                    "finish_reason": answer["finish"],
                    "stop_reason": None,
                }
            ],
        }
    )
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    chunks.append(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m",
            "choices": [],
            "usage": usage,
            "system_fingerprint": "fp",
        }
    )
    return answer, chunks


def fold(chunks: list[dict[str, Any]], *, chat: bool, cut: int) -> dict[str, Any]:
    data = b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks)
    data += b"data: [DONE]\n\n"
    relay = StreamRelay(Assembler(chat=chat, model="m"))
    action = None
    for piece in (data[:cut], data[cut:]):
        action = relay.feed(piece)
        if isinstance(action, Finish):
            break
    assert isinstance(action, Finish)
    result: dict[str, Any] = msgspec.json.decode(action.data)
    return result


@settings(max_examples=EXAMPLES, deadline=None)
@given(chat_stream(), st.integers(0, 10_000))
def test_chat_deltas_fold_into_the_whole_message(
    stream: tuple[dict[str, Any], list[dict[str, Any]]], cut: int
) -> None:
    answer, chunks = stream
    body = fold(chunks, chat=True, cut=cut)
    [choice] = body["choices"]
    message = choice["message"]
    assert message["content"] == answer["content"]  # the opening delta carries content ""
    assert message.get("reasoning_content", "") == answer["reasoning"]
    assert message["refusal"] == answer["refusal"]
    assert message.get("tool_calls", []) == [  # vLLM leaves the key out when there are none
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in answer["calls"]
    ]
    want_logprobs = {"content": answer["logprobs"]} if answer["logprobs"] else None
    assert choice["logprobs"] == want_logprobs
    assert choice["finish_reason"] == answer["finish"]
    assert body["usage"]["total_tokens"] == 8
    assert body["system_fingerprint"] == "fp"  # a field the router does not know passes


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(st.tuples(text, st.floats(-5, 0)), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(0, 10_000),
)
def test_completion_logprobs_concatenate_with_offsets_continued(
    tokens: list[tuple[str, float]], per_chunk: int, cut: int
) -> None:
    chunks, offset = [], 0
    for start in range(0, len(tokens), per_chunk):
        group = tokens[start : start + per_chunk]
        offsets = []
        for token, _ in group:
            offsets.append(offset)
            offset += len(token)
        logprobs = {
            "tokens": [t for t, _ in group],
            "token_logprobs": [lp for _, lp in group],
            "top_logprobs": [{t: lp} for t, lp in group],
            "text_offset": offsets,  # vLLM streams offsets counted from the text's start
        }
        choice = {
            "index": 0,
            "text": "".join(t for t, _ in group),
            "logprobs": logprobs,
            "finish_reason": None,
            "prompt_token_ids": None,
        }
        chunks.append(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 7,
                "model": "m",
                "choices": [choice],
            }
        )
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    body = fold(chunks, chat=False, cut=cut)
    [choice] = body["choices"]
    assert choice["text"] == "".join(t for t, _ in tokens)
    assert choice["logprobs"]["tokens"] == [t for t, _ in tokens]
    assert choice["logprobs"]["token_logprobs"] == [lp for _, lp in tokens]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t, _ in tokens[:i]) for i in range(len(tokens))]
    assert choice["finish_reason"] == "length"
    assert "prompt_token_ids" in choice  # passes through
