"""Stream resume (SPEC 6.4), pure: what may continue, and the request that continues it."""

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
from narwhal.core.resume import SAMPLING, after, continuation, refusal
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
        with pytest.raises(ValueError, match="nothing to resume"):
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
