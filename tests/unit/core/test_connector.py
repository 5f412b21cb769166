"""The NIXL connector, sans IO: bodies, descriptor rules (contract 4.2), detached parameters."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.connector import NixlConnector, PrefillResult, block_ids_rule, valid_block_ids
from narwhal.core.faults import DescriptorInvalid
from tests.support.paths import CAPTURES

GOOD = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "3c722274-c365-421c-b156-20f5c5fa53c9",
    "remote_request_id": "cmpl-x-0-983ad0e6",
    "remote_host": "127.0.0.1",
    "remote_port": 15600,
    "tp_size": 1,
}
connector = NixlConnector()


def _response(descriptor: Any, *, where: str = "top") -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "length"}
    body: dict[str, Any] = {"id": "cmpl-x", "choices": [choice]}
    if where == "top":
        body["kv_transfer_params"] = descriptor
    else:
        choice["kv_transfer_params"] = descriptor
    return msgspec.json.encode(body)


def _extract(raw: bytes, endpoint: str = "/v1/completions") -> PrefillResult:
    return connector.extract(raw, producer_url="http://p", endpoint=endpoint, request_id="r-a1")


def test_real_vllm_prefill_response_yields_its_descriptor_byte_for_byte() -> None:
    raw = (CAPTURES / "pd_prefill_response.json").read_bytes()
    result = _extract(raw)
    captured = msgspec.json.decode(raw)["kv_transfer_params"]
    assert result.parameters() == captured
    assert bytes(result.descriptor) == msgspec.json.encode(captured)
    decode = msgspec.json.decode(
        msgspec.json.encode(
            connector.decode_body({"prompt": "x"}, result, endpoint="/v1/completions")
        )
    )
    # the decode request vLLM's own client sent, descriptor for descriptor
    expected = msgspec.json.decode((CAPTURES / "pd_decode_request.json").read_bytes())
    assert decode["kv_transfer_params"] == expected["kv_transfer_params"]


def test_real_vllm_chat_prefill_response() -> None:
    capture = (CAPTURES / "edge_chat.txt").read_text().splitlines()
    raw = next(line for line in capture if line.startswith('{"id":"chatcmpl')).encode()
    result = _extract(raw, "/v1/chat/completions")
    assert result.parameters()["remote_request_id"] == "chatcmpl-chat-1-89b67fce"


@pytest.mark.parametrize(
    ("block_ids", "ok"),
    [
        ([1, 2, 3], True),  # flat
        ([[1, 2], [3]], True),  # grouped: one list per KV cache group
        ([[0]], True),  # zero is a valid block id
        ([[1], []], True),  # an empty group beside a full one
        ([0], True),
        ([True, 1], False),  # bool is not an int here
        ([[1, False]], False),
        ([-1], False),
        ([[2, -3]], False),
        ([1.0], False),
        ([[1.5]], False),
        (["1"], False),
        ([["a"]], False),
        ([None], False),
        (None, False),
        ("1,2", False),
        ([], False),
        ([[]], False),
        ([1, [2]], False),  # mixed flat and grouped
        (7, False),
    ],
)
def test_block_id_rules(block_ids: Any, ok: bool) -> None:
    raw = _response({**GOOD, "remote_block_ids": block_ids})
    if ok:
        assert _extract(raw).parameters()["remote_block_ids"] == block_ids
    else:
        with pytest.raises(DescriptorInvalid, match=r"^malformed block ids: remote_block_ids"):
            _extract(raw)


# what a producer's JSON may hold where block ids go: ids, their near misses, groups of them
ids_or_not = st.one_of(
    st.integers(min_value=-2, max_value=3),
    st.integers(min_value=2**62, max_value=2**70),
    st.booleans(),
    st.sampled_from([1.0, -0.0, 2.5, None, "1"]),
)
block_id_lists = st.lists(
    st.one_of(ids_or_not, st.lists(ids_or_not, max_size=4)), min_size=1, max_size=8
) | st.lists(st.lists(st.integers(min_value=0), max_size=4), min_size=1, max_size=8)


@given(block_id_lists)
def test_the_fast_check_of_block_ids_agrees_with_the_rules_one_by_one(ids: list[Any]) -> None:
    assert valid_block_ids(ids) == (block_ids_rule(ids) is None)


def test_absent_block_ids() -> None:
    descriptor = {k: v for k, v in GOOD.items() if k != "remote_block_ids"}
    with pytest.raises(DescriptorInvalid, match="remote_block_ids is absent"):
        _extract(_response(descriptor))


@pytest.mark.parametrize(
    ("engine_id", "message"),
    [
        ("<absent>", "remote_engine_id is absent"),
        ("", "remote_engine_id is empty"),
        (None, "remote_engine_id is null, not a string"),
        (7, "remote_engine_id is int, not a string"),
        (["a"], "remote_engine_id is list, not a string"),
    ],
)
def test_missing_engine_identity(engine_id: Any, message: str) -> None:
    descriptor = dict(GOOD)
    if engine_id == "<absent>":
        del descriptor["remote_engine_id"]
    else:
        descriptor["remote_engine_id"] = engine_id
    with pytest.raises(DescriptorInvalid, match=f"^missing engine identity: {message}"):
        _extract(_response(descriptor))


@pytest.mark.parametrize("descriptor", [None, "<no key>"])
def test_no_descriptor_at_all(descriptor: Any) -> None:
    raw = (
        msgspec.json.encode({"id": "x", "choices": [{"text": "a"}]})
        if descriptor == "<no key>"
        else _response(None)
    )
    with pytest.raises(DescriptorInvalid, match="has no kv_transfer_params"):
        _extract(raw)


def test_descriptor_that_is_not_an_object() -> None:
    with pytest.raises(DescriptorInvalid, match="not a JSON object"):
        _extract(_response(["remote_engine_id"]))


def test_prefill_response_that_is_not_json() -> None:
    with pytest.raises(DescriptorInvalid, match="not an OpenAI completion"):
        _extract(b"<html>oops</html>")


def test_choice_level_descriptor_wins_over_top_level() -> None:
    body = msgspec.json.decode(_response({**GOOD, "remote_engine_id": "choice"}, where="choice"))
    body["kv_transfer_params"] = {**GOOD, "remote_engine_id": "top"}
    result = _extract(msgspec.json.encode(body))
    assert result.parameters()["remote_engine_id"] == "choice"


def test_top_level_used_when_choice_level_is_null() -> None:
    body = msgspec.json.decode(_response(None, where="choice"))
    body["kv_transfer_params"] = GOOD
    assert _extract(msgspec.json.encode(body)).parameters() == GOOD


def test_opaque_fields_pass_through_byte_for_byte() -> None:
    raw = (
        b'{"choices":[{"text":"a"}],"kv_transfer_params":{"remote_engine_id": "e",'
        b' "remote_block_ids": [[1]], "tp_size": 1.50, "x_unknown": {"deep": [null]},'
        b' "remote_host": "h"}}'
    )
    result = _extract(raw)
    body = msgspec.json.encode(
        connector.decode_body({"prompt": "p"}, result, endpoint="/v1/completions")
    )
    assert b'"tp_size": 1.50, "x_unknown": {"deep": [null]}' in body


def test_endpoint_mismatch() -> None:
    result = _extract(_response(GOOD), "/v1/chat/completions")
    with pytest.raises(DescriptorInvalid, match=r"^endpoint mismatch"):
        connector.decode_body({"prompt": "p"}, result, endpoint="/v1/completions")


def test_connector_mismatch() -> None:
    result = msgspec.structs.replace(_extract(_response(GOOD)), connector="LMCacheConnector")
    with pytest.raises(DescriptorInvalid, match=r"^connector mismatch"):
        connector.decode_body({"prompt": "p"}, result, endpoint="/v1/completions")


def test_parameters_are_detached() -> None:
    result = _extract(_response(GOOD))
    first = result.parameters()
    first["remote_block_ids"][0].append(99)
    first["remote_engine_id"] = "changed"
    assert result.parameters() == GOOD
    assert result.parameters() is not result.parameters()
    with pytest.raises(AttributeError):
        result.endpoint = "/other"  # type: ignore[misc]


def test_prefill_body() -> None:
    client_body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "stream": True,
        "temperature": 0.2,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
        "n": 1,
        "best_of": 1,
        "max_completion_tokens": 50,
        "kv_transfer_params": {"remote_engine_id": "forged"},
        "extra": {"a": 1},
    }
    body = connector.prefill_body(client_body)
    assert body == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.2,
        "kv_transfer_params": {"do_remote_decode": True},
        "extra": {"a": 1},
    }
    assert client_body["max_tokens"] == 50  # the client's body is not touched


def test_decode_body_strips_client_params_and_same_worker_sends_none() -> None:
    client_body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 5,
        "stream": False,
        "kv_transfer_params": {"remote_engine_id": "forged"},
    }
    same_worker = connector.decode_body(client_body, None, endpoint="/v1/completions")
    # the decode leg always asks for the engine's usage: token counts are the engine's own
    usage = {"include_usage": True}
    assert same_worker == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 5,
        "stream": True,
        "stream_options": usage,
    }
    result = _extract(_response(GOOD))
    crossed = msgspec.json.decode(
        msgspec.json.encode(connector.decode_body(client_body, result, endpoint="/v1/completions"))
    )
    assert crossed["kv_transfer_params"] == GOOD


def test_the_decode_leg_asks_for_usage_and_keeps_a_clients_own_options() -> None:
    body = {"model": "m", "prompt": "p", "stream": True}
    continuous = {
        **body,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    }
    asked = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    usage = {"include_usage": True}
    assert connector.decode_body(body, None, endpoint="/v1/completions")["stream_options"] == usage
    # options replaced: continuous usage stats never reach a client that did not ask for usage
    decoded = connector.decode_body(continuous, None, endpoint="/v1/completions")
    assert decoded["stream_options"] == usage
    decoded = connector.decode_body(asked, None, endpoint="/v1/completions")
    assert decoded["stream_options"] == asked["stream_options"]


def test_an_echo_without_logprobs_asks_the_producer_for_its_tokens_logprob() -> None:
    prefill = connector.prefill_body({"model": "m", "prompt": "p", "echo": True})
    assert prefill["logprobs"] == 0
    assert "logprobs" not in connector.prefill_body({"model": "m", "prompt": "p"})


def test_a_json_bomb_from_a_producer_is_an_invalid_descriptor() -> None:
    bomb = (
        b'{"choices": [{"text": "a"}], "kv_transfer_params": {"remote_engine_id": "e", '
        b'"remote_block_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    )
    with pytest.raises(DescriptorInvalid):
        _extract(bomb)
