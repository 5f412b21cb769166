"""Stream resume (contract 6.4), pure: what may continue, and the request that continues it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.faults import (
    DeadlineExpired,
    InStreamError,
    Phase,
    RequestFault,
    SilenceTimeout,
    StreamBroken,
)
from narwhal.core.resume import (
    SAMPLING,
    after,
    context_of,
    continuation,
    refusal,
    within_context,
)
from narwhal.core.retry import RetryBudget

ids = st.lists(st.integers(min_value=0, max_value=2**20), max_size=50)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool calls"),
        ({"tool_choice": "required"}, "tool calls"),
        ({"response_format": {"type": "json_object"}}, "guided decoding"),
        ({"structured_outputs": {"regex": "a+"}}, "guided decoding"),
        ({"guided_json": {}}, "guided decoding"),
        ({"logprobs": 2}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ],
)
def test_what_keeps_the_terminal_event(extra: dict[str, object], why: str) -> None:
    assert refusal({"model": "m", **extra}, chat=True) == why


def test_an_echo_is_refused_and_a_plain_stream_is_not() -> None:
    assert refusal({"prompt": "x", "echo": True}, chat=False) == "echo"
    assert refusal({"prompt": "x", "tool_choice": "none", "logprobs": None}, chat=False) is None


@given(
    ids,
    ids,
    st.integers(min_value=1, max_value=200),
    st.integers(min_value=0, max_value=200),
    st.booleans(),
)
def test_a_continuation_asks_for_exactly_what_is_left(
    prompt: list[int], sent: list[int], asked: int, min_tokens: int, chat: bool
) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens" if chat else "max_tokens": asked,
        "min_tokens": min_tokens,
        "temperature": 0,
        "stop": ["\n"],
        "stream_options": {"include_usage": True},
    }
    if asked <= len(sent):
        with pytest.raises(ValueError, match="output limit reached"):
            continuation(body, chat=chat, prompt_ids=prompt, sent_ids=sent)
        return
    out = continuation(body, chat=chat, prompt_ids=prompt, sent_ids=sent)
    assert out["prompt"] == prompt + sent
    assert out["max_tokens"] + len(sent) == asked
    assert out.get("min_tokens", 0) == max(0, min_tokens - len(sent))
    assert out["stream"] is True
    assert out["return_token_ids"] is True
    kept = set(out) - {"model", "prompt", "max_tokens", "min_tokens", "stream"}
    assert kept - {"return_token_ids", "stream_options"} <= set(SAMPLING)
    assert out["stream_options"] == {"include_usage": True}  # as the client asked
    assert (out["temperature"], out["stop"]) == (0, ["\n"])


def _after(fault: RequestFault, **kw: Any) -> str | None:
    args: dict[str, Any] = {
        "resumes": 0,
        "allowed": 1,
        "remaining_s": 10.0,
        "needed_s": 1.0,
        "budget": RetryBudget(3.0, 0.1),
    }
    return after(fault, **{**args, **kw})


def test_when_a_failed_stream_continues() -> None:
    broken = StreamBroken("stream ended before [DONE]", phase=Phase.STREAM)
    assert _after(broken) is None
    assert _after(SilenceTimeout("quiet", phase=Phase.STREAM)) is None
    assert _after(InStreamError(503, "oom", "engine_error", phase=Phase.DECODE)) is None
    # the client's own error is not the engine's to mend
    assert _after(InStreamError(400, "bad", "invalid", phase=Phase.DECODE)) == (
        "not an engine fault"
    )
    assert _after(DeadlineExpired(5.0, phase=Phase.STREAM)) == "not an engine fault"
    assert _after(broken, resumes=1) == "resumes spent"
    assert _after(broken, remaining_s=0.9) == "deadline"  # less than its first token took
    empty = RetryBudget(3.0, 0.1)
    for _ in range(3):
        assert empty.spend()
    assert _after(broken, budget=empty) == "budget"


LIMIT = {"max_tokens": 64}


def test_stop_strings_longer_than_a_character_are_refused() -> None:
    assert refusal({"stop": ["ab"]}, chat=True) == "stop strings"
    assert refusal({"stop": "ab"}, chat=False) == "stop strings"
    assert refusal({"stop": ["a", "\n"], "stop_token_ids": [7], **LIMIT}, chat=True) is None


def test_what_constrains_nothing_is_not_refused() -> None:
    assert refusal({"response_format": {"type": "text"}, **LIMIT}, chat=True) is None
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert refusal({"tools": tools, "tool_choice": "none", **LIMIT}, chat=True) is None
    assert refusal({"tools": tools}, chat=True) == "tool calls"  # "auto" by default


def test_a_chat_without_an_output_limit_is_bounded_by_the_context_end() -> None:
    """Its limit was the context's end: vLLM reads a continuation's null as 16 and refuses
    a prompt and limit past its max_model_len, so the continuation's is exactly that."""
    body = continuation({"messages": []}, chat=True, prompt_ids=[1, 2], sent_ids=[3])
    within_context(body, 10)
    assert body["max_tokens"] == 7  # 10 less the prompt's 2 and the 1 sent
    with pytest.raises(ValueError, match="output limit reached"):
        within_context(continuation({}, chat=True, prompt_ids=[1], sent_ids=[2]), 2)
    with pytest.raises(ValueError, match="context length unknown"):
        within_context(continuation({}, chat=True, prompt_ids=[1], sent_ids=[2]), None)


def test_a_limit_is_cut_to_what_the_context_leaves() -> None:
    """vLLM clamped the client's limit at the context's end; the continuation's prompt is
    longer, and its limit is cut likewise (some vLLM versions refuse one past it)."""
    body = continuation({"prompt": "x"}, chat=False, prompt_ids=[1] * 12, sent_ids=[2] * 5)
    within_context(body, 20)
    assert body["max_tokens"] == 3  # 16 - 5 asked, 20 - 17 left
    body = continuation({"prompt": "x", "max_tokens": 9}, chat=False, prompt_ids=[1], sent_ids=[2])
    within_context(body, None)  # unknown: the limit as it is
    assert body["max_tokens"] == 8


def test_the_context_length_is_read_from_the_models_list() -> None:
    models = (
        b'{"object":"list","data":[{"id":"a","max_model_len":9},{"id":"m","max_model_len":512}]}'
    )
    assert context_of(models, "m") == 512
    assert context_of(models, "x") is None  # two others: which is unknown
    assert context_of(b'{"data":[{"id":"alias","max_model_len":64}]}', "m") == 64
    assert context_of(b'{"data":[{"id":"m"}]}', "m") is None
    assert context_of(b"garbage", "m") is None


def test_a_continuation_keeps_the_limit_the_engine_applied() -> None:
    completion = continuation({"prompt": "x"}, chat=False, prompt_ids=[1], sent_ids=[2, 3])
    assert completion["max_tokens"] == 14  # vLLM's default of 16, less the two sent
    chat = continuation({"messages": []}, chat=True, prompt_ids=[1], sent_ids=[2, 3])
    assert "max_tokens" not in chat  # the context's end: the shell asks the engine
