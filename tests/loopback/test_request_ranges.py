"""Out-of-range fields are refused before any engine leg (contract 3 and 4.1).

The prefill leg's body replaces ``max_tokens`` with 1 and drops ``max_completion_tokens``,
``min_tokens``, ``n``, ``best_of`` and ``stream_options``, so a bad value there would pass
the producer and be refused only by the consumer, with the producer's KV blocks pinned for
a decode that never comes. The router refuses them itself, as vLLM would, with a 400 whose
message begins with the field.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.requests import MAX_INT32, BadRequest, ClientRequest, parse_request
from tests.support.fleet import MODEL, finish, start_fleet

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BASE: dict[str, dict[str, Any]] = {
    COMPLETIONS: {"model": MODEL, "prompt": "hello there"},
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]},
}


def _parse(endpoint: str, fields: dict[str, Any]) -> ClientRequest:
    raw = msgspec.json.encode({**BASE[endpoint], **fields})
    return parse_request(raw, endpoint=endpoint, model=MODEL)


BAD: list[tuple[str, str, dict[str, Any]]] = [
    (COMPLETIONS, "max_tokens", {"max_tokens": -1}),
    (COMPLETIONS, "max_tokens", {"max_tokens": 0}),
    (COMPLETIONS, "max_tokens", {"max_tokens": 10**29}),
    (COMPLETIONS, "max_tokens", {"max_tokens": MAX_INT32 + 1}),
    (COMPLETIONS, "max_tokens", {"max_tokens": True}),
    (COMPLETIONS, "max_tokens", {"max_tokens": 5.0}),
    (CHAT, "max_tokens", {"max_tokens": 0}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": -5}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": 0}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": 10**29}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": False}),
    (COMPLETIONS, "min_tokens", {"min_tokens": -1}),
    (COMPLETIONS, "min_tokens", {"min_tokens": 10**29}),
    (COMPLETIONS, "min_tokens", {"max_tokens": 3, "min_tokens": 4}),
    (CHAT, "min_tokens", {"max_completion_tokens": 3, "min_tokens": 4}),
    # vLLM reads max_completion_tokens before max_tokens: that is the limit min_tokens meets
    (CHAT, "min_tokens", {"max_tokens": 100, "max_completion_tokens": 3, "min_tokens": 4}),
    (COMPLETIONS, "n", {"n": 0}),
    (COMPLETIONS, "n", {"n": -3}),
    (COMPLETIONS, "best_of", {"best_of": 0}),
    (COMPLETIONS, "logprobs", {"logprobs": -2}),
    (COMPLETIONS, "logprobs", {"logprobs": True}),
    (CHAT, "logprobs", {"logprobs": 5}),
    (CHAT, "top_logprobs", {"logprobs": True, "top_logprobs": -2}),
    (COMPLETIONS, "temperature", {"temperature": -0.5}),
    (CHAT, "temperature", {"temperature": -1}),
    (COMPLETIONS, "top_p", {"top_p": 0}),
    (COMPLETIONS, "top_p", {"top_p": -0.1}),
    (CHAT, "top_p", {"top_p": 1.5}),
    (COMPLETIONS, "temperature", {"temperature": 2.5}),  # vLLM 0.32: [0, 2]
    (COMPLETIONS, "top_k", {"top_k": -2}),
    (CHAT, "top_k", {"top_k": 1.5}),
    (COMPLETIONS, "min_p", {"min_p": 1.01}),
    (CHAT, "min_p", {"min_p": -0.1}),
    (COMPLETIONS, "presence_penalty", {"presence_penalty": 2.5}),
    (CHAT, "frequency_penalty", {"frequency_penalty": -3}),
    (COMPLETIONS, "repetition_penalty", {"repetition_penalty": 0}),
    (CHAT, "repetition_penalty", {"repetition_penalty": -0.5}),
    (COMPLETIONS, "seed", {"seed": 2**63}),
    (CHAT, "seed", {"seed": -(2**63) - 1}),
    (CHAT, "priority", {"priority": 10**29}),
    (COMPLETIONS, "prompt_logprobs", {"prompt_logprobs": -2}),
    (COMPLETIONS, "stream_interval", {"stream": True, "stream_interval": 0}),
    (CHAT, "truncate_prompt_tokens", {"truncate_prompt_tokens": -2}),
    (COMPLETIONS, "stream_options", {"stream_options": {"include_usage": True}}),
    (CHAT, "stream_options", {"stream": False, "stream_options": {"include_usage": False}}),
]


@pytest.mark.parametrize(("endpoint", "field", "fields"), BAD)
def test_an_out_of_range_field_is_a_400_that_names_it(
    endpoint: str, field: str, fields: dict[str, Any]
) -> None:
    with pytest.raises(BadRequest) as info:
        _parse(endpoint, fields)
    fault = info.value
    assert fault.status == 400
    assert fault.param == field
    body = fault.error_body()
    assert body["param"] == field
    assert str(body["message"]).startswith(f"{field}: "), body


def test_a_number_past_a_double_is_a_400_not_infinity() -> None:
    raw = b'{"model": "%s", "prompt": "x", "repetition_penalty": 1e999}' % MODEL.encode()
    with pytest.raises(BadRequest) as info:
        parse_request(raw, endpoint=COMPLETIONS, model=MODEL)
    assert info.value.status == 400
    assert "out of range" in str(info.value.error_body()["message"])


def test_best_of_and_fan_out_past_the_bound_are_refused_by_name() -> None:
    with pytest.raises(BadRequest) as info:
        _parse(COMPLETIONS, {"best_of": 2})
    assert info.value.param == "best_of"
    with pytest.raises(BadRequest) as info:
        _parse(COMPLETIONS, {"n": 17})  # serving.max_fanout defaults to 16
    assert info.value.param == "n"
    assert _parse(COMPLETIONS, {"n": 16}).fanout == 16


GOOD: list[tuple[str, dict[str, Any]]] = [
    (COMPLETIONS, {"max_tokens": 1}),
    (COMPLETIONS, {"max_tokens": MAX_INT32}),
    (COMPLETIONS, {"max_tokens": None, "min_tokens": None, "n": None, "logprobs": None}),
    (COMPLETIONS, {"max_tokens": 5, "min_tokens": 0}),
    (COMPLETIONS, {"max_tokens": 5, "min_tokens": 5}),
    (COMPLETIONS, {"min_tokens": 7}),  # no limit given: the engine's default applies
    (COMPLETIONS, {"n": 1, "best_of": 1}),
    (COMPLETIONS, {"logprobs": 0}),
    (COMPLETIONS, {"logprobs": 20}),
    (COMPLETIONS, {"temperature": 0}),
    (COMPLETIONS, {"temperature": 2, "top_p": 1}),
    (COMPLETIONS, {"logprobs": -1}),  # the whole vocabulary, as vLLM reads it
    (CHAT, {"logprobs": True, "top_logprobs": -1}),
    (COMPLETIONS, {"top_k": -1, "min_p": 0, "presence_penalty": -2, "frequency_penalty": 2}),
    (CHAT, {"top_k": 0, "min_p": 1, "repetition_penalty": 1e300, "seed": 2**63 - 1}),
    (CHAT, {"seed": -(2**63), "priority": -5, "prompt_logprobs": -1}),
    (COMPLETIONS, {"stream": True, "stream_interval": 1, "truncate_prompt_tokens": -1}),
    (COMPLETIONS, {"top_p": 0.001}),
    (COMPLETIONS, {"stream": True, "stream_options": {"include_usage": True}}),
    (COMPLETIONS, {"stream_options": None}),
    (COMPLETIONS, {"stream": False, "stream_options": {}}),  # vLLM tests it for truth
    (CHAT, {"max_completion_tokens": MAX_INT32, "max_tokens": 1, "min_tokens": 2}),
    (CHAT, {"max_tokens": 9, "min_tokens": 9}),
    (CHAT, {"logprobs": True, "top_logprobs": 0}),
    (CHAT, {"logprobs": True, "top_logprobs": 20}),
    (CHAT, {"logprobs": False, "top_logprobs": None}),
]


@pytest.mark.parametrize(("endpoint", "fields"), GOOD)
def test_values_in_range_are_accepted_and_passed_on_unchanged(
    endpoint: str, fields: dict[str, Any]
) -> None:
    req = _parse(endpoint, fields)
    assert req.body == {**BASE[endpoint], **fields}


def test_unknown_fields_still_pass_through() -> None:
    extra = {
        "repetition_penalty": 1.1,
        "custom": {"nested": [1, None, True]},
        "top_k": -1,
        "length_penalty": 10**29,  # no range of ours: beam search only, never sampled
        "logit_bias": {"50256": -100},
    }
    for endpoint in (COMPLETIONS, CHAT):
        req = _parse(endpoint, {"max_tokens": 4, **extra})
        assert req.body == {**BASE[endpoint], "max_tokens": 4, **extra}


# ---- the property: parsed means in range, refused means a 400 naming the field --------------

INT_FIELDS = {  # field: (least, greatest)
    "max_tokens": (1, MAX_INT32),
    "max_completion_tokens": (1, MAX_INT32),
    "min_tokens": (0, MAX_INT32),
    "n": (1, 1),
    "best_of": (1, 1),
    "top_logprobs": (-1, MAX_INT32),
    "top_k": (-1, MAX_INT32),
    "seed": (-(2**63), 2**63 - 1),
}
FIELDS = [*INT_FIELDS, "logprobs", "temperature", "top_p", "stream", "stream_options"]
EDGES = [-(2**70), -1, 0, 1, 2, 20, 21, MAX_INT32, MAX_INT32 + 1, 2**64, 10**29]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from(EDGES)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3)
    ),
    max_leaves=4,
)
stream_options = st.none() | st.fixed_dictionaries(
    {}, optional={"include_usage": st.none() | st.booleans() | json_values}
)
bodies = st.dictionaries(
    st.sampled_from(FIELDS), json_values | stream_options, max_size=len(FIELDS)
)


def _in_range(endpoint: str, body: dict[str, Any]) -> None:
    """What a parsed body must hold: every field the engines would refuse is in range."""
    chat = endpoint == CHAT
    for name, (least, greatest) in INT_FIELDS.items():
        value = body.get(name)
        if name in ("max_completion_tokens", "top_logprobs") and not chat:
            continue  # not fields of the completions API: passed through untouched
        assert value is None or (type(value) is int and least <= value <= greatest), name
    logprobs = body.get("logprobs")
    if chat:
        assert logprobs is None or type(logprobs) is bool
    else:
        assert logprobs is None or (type(logprobs) is int and -1 <= logprobs <= MAX_INT32)
    temperature = body.get("temperature")
    assert temperature is None or (type(temperature) in (int, float) and 0 <= temperature <= 2)
    top_p = body.get("top_p")
    assert top_p is None or (type(top_p) in (int, float) and 0 < top_p <= 1)
    limit = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and limit is not None:
        assert min_tokens <= limit
    if body.get("stream_options"):
        assert body.get("stream") is True


@settings(max_examples=400, deadline=None)
@given(fields=bodies, chat=st.booleans())
def test_any_json_for_these_fields_parses_in_range_or_is_a_400(
    fields: dict[str, Any], chat: bool
) -> None:
    endpoint = CHAT if chat else COMPLETIONS
    refused: BadRequest | None = None
    try:
        req = _parse(endpoint, fields)
    except BadRequest as fault:  # anything else fails the test: never a 500
        refused = fault
    if refused is None:
        _in_range(endpoint, req.body)
        return
    assert refused.status == 400
    assert refused.param is not None
    message = refused.error_body()["message"]
    assert isinstance(message, str)
    split = refused.param in ("n", "best_of") and "cannot be split" in message
    assert split or message.startswith(f"{refused.param}: "), message
    assert refused.param.split(".")[0] in FIELDS, refused.param


# ---- over loopback: a refused request never reaches an engine -----------------------------

REFUSED: list[tuple[str, str, dict[str, Any]]] = [
    (COMPLETIONS, "max_tokens", {"max_tokens": -1}),
    (COMPLETIONS, "max_tokens", {"max_tokens": 0}),
    (COMPLETIONS, "max_tokens", {"max_tokens": 10**29}),
    (COMPLETIONS, "max_tokens", {"max_tokens": -1, "stream": True}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": -5}),
    (CHAT, "max_completion_tokens", {"max_completion_tokens": -5, "stream": True}),
    (CHAT, "min_tokens", {"max_tokens": 4, "min_tokens": 8}),
    (COMPLETIONS, "min_tokens", {"min_tokens": -1}),
    (COMPLETIONS, "n", {"n": 0}),
    (COMPLETIONS, "best_of", {"best_of": 0}),
    (COMPLETIONS, "top_p", {"top_p": 0}),
    (COMPLETIONS, "stream_options", {"stream_options": {"include_usage": True}}),
]


async def test_out_of_range_requests_never_reach_an_engine(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    for endpoint, field, fields in REFUSED:
        reply = await harness.post(endpoint, {**BASE[endpoint], **fields})
        assert reply.status == 400, (fields, reply.body)
        error = reply.json()["error"]
        assert error["code"] == 400
        assert error["param"] == field
        assert error["message"].startswith(f"{field}: "), error
        assert "x-request-id" in reply.headers
    for engine in harness.engines.values():
        assert list(engine.log) == [], "no engine leg for a refused request"
        assert engine.counters["completions"] == engine.counters["chat"] == 0
    # and the same fleet still serves a request in range
    ok = await harness.post(COMPLETIONS, {**BASE[COMPLETIONS], "max_tokens": 3})
    assert ok.status == 200, ok.body
    assert len(harness.engines["p0"].log) == len(harness.engines["d0"].log) == 1
    await finish(harness)


NOT_SERVED: list[tuple[str, str, dict[str, Any]]] = [
    (COMPLETIONS, "prompt", {"prompt": []}),
    (COMPLETIONS, "prompt", {"prompt": ["one", 2]}),
    (CHAT, "echo", {"echo": True}),
    (COMPLETIONS, "prompt_logprobs", {"prompt_logprobs": 1, "stream": True}),
    (CHAT, "prompt_logprobs", {"prompt_logprobs": 0, "stream": True}),
]


@pytest.mark.parametrize(("endpoint", "field", "fields"), NOT_SERVED)
def test_what_is_not_served_is_a_400_never_a_silent_drop(
    endpoint: str, field: str, fields: dict[str, Any]
) -> None:
    """contract 3: echo and prompt logprobs would be lost with the prefill output: until they
    are served, the client is told; a prompt list must be prompts or token ids."""
    with pytest.raises(BadRequest) as caught:
        _parse(endpoint, fields)
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "prompt", ["text", ["one prompt"], [1, 2, 3], [[1, 2, 3]]], ids=["str", "1str", "ids", "1ids"]
)
def test_one_prompt_in_any_shape_is_served(prompt: Any) -> None:
    assert _parse(COMPLETIONS, {"prompt": prompt, "echo": False}).body["prompt"] == prompt


def test_n_with_greedy_sampling_is_refused_as_vllm_refuses_it() -> None:
    """vLLM 0.32: "n must be 1 when using greedy sampling" (tests/captures/shapes)."""
    with pytest.raises(BadRequest) as caught:
        _parse(COMPLETIONS, {"n": 2, "temperature": 0})
    assert caught.value.param == "n"
    assert _parse(COMPLETIONS, {"n": 2, "temperature": 0.5}).fanout == 2
