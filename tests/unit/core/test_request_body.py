"""The client's body as it came: the engine legs' bodies splice its raw fields, so they say
what a decoded and re-encoded body would, and every value the router does not change
reaches the engines byte for byte."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.connector import NixlConnector, PrefillResult
from narwhal.core.faults import BadRequest
from narwhal.core.requests import parse_request

MODEL = "m"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
DESCRIPTOR = b'{"remote_engine_id":"e1","remote_block_ids":[[1,2]],"opaque":{"x":[1,2.5]}}'
connector = NixlConnector()

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
extra_fields = st.dictionaries(st.text(min_size=1).map(lambda k: "x_" + k), json_values)
known_fields = st.fixed_dictionaries(
    {},
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(1, 100),
        "temperature": st.floats(0, 2),
        "seed": st.integers(-(2**31), 2**31),
        "logprobs": st.integers(0, 5),
        "echo": st.booleans(),
        "kv_transfer_params": json_values,
    },
)


def _result(endpoint: str) -> PrefillResult:
    return PrefillResult("http://p", endpoint, "r-a1", connector.name, msgspec.Raw(DESCRIPTOR))


def _legs(body: Any, endpoint: str) -> tuple[Any, Any]:
    """Both legs' bodies as the engines read them."""
    prefill = msgspec.json.encode(connector.prefill_body(body))
    decode = msgspec.json.encode(connector.decode_body(body, _result(endpoint), endpoint=endpoint))
    return msgspec.json.decode(prefill), msgspec.json.decode(decode)


@given(known=known_fields, extra=extra_fields, chat=st.booleans())
def test_spliced_legs_say_what_decoded_legs_would(
    known: dict[str, Any], extra: dict[str, Any], chat: bool
) -> None:
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    )
    if chat:  # chat refuses an echo, and its logprobs are a flag
        known.pop("echo", None)
        known.pop("logprobs", None)
    client = {"model": MODEL, **prompt, **known, **extra}
    endpoint = CHAT if chat else COMPLETIONS
    req = parse_request(msgspec.json.encode(client), endpoint=endpoint, model=MODEL)
    decoded = {k: v for k, v in client.items() if k != "kv_transfer_params"}
    assert req.body == decoded
    assert _legs(req.body, endpoint) == _legs(decoded, endpoint)


def test_values_the_router_does_not_change_reach_both_legs_byte_for_byte() -> None:
    raw = (
        b'{"model":"m","prompt":"caf\\u00e9 \\ud83d\\ude00","stop":["\\n"],"x_big":1E2,'
        b'"x_precise":0.30000000000000004000,"x_nested":{ "a" : [1, 2] },"max_tokens":4}'
    )
    req = parse_request(raw, endpoint=COMPLETIONS, model=MODEL)
    prefill = msgspec.json.encode(connector.prefill_body(req.body))
    decode = msgspec.json.encode(
        connector.decode_body(req.body, _result(COMPLETIONS), endpoint=COMPLETIONS)
    )
    for as_sent in (
        b'"prompt":"caf\\u00e9 \\ud83d\\ude00"',
        b'"stop":["\\n"]',
        b'"x_big":1E2',
        b'"x_precise":0.30000000000000004000',
        b'"x_nested":{ "a" : [1, 2] }',
    ):
        assert as_sent in prefill
        assert as_sent in decode
    assert b'"kv_transfer_params":' + DESCRIPTOR in decode  # the producer's, as it came
    assert b'"max_tokens":1' in prefill
    assert b'"max_tokens":4' in decode
    assert req.body["prompt"] == "café \U0001f600"


def test_a_changed_body_is_a_new_body() -> None:
    req = parse_request(
        b'{"model":"m","prompt":"p","seed":3,"n":2}', endpoint=COMPLETIONS, model=MODEL
    )
    changed = req.body.replace(return_token_ids=True, seed=4)
    assert changed == {"model": "m", "prompt": "p", "seed": 4, "n": 2, "return_token_ids": True}
    assert req.body == {"model": "m", "prompt": "p", "seed": 3, "n": 2}
    assert req.body.without("n", "seed") == {"model": "m", "prompt": "p"}
    assert changed.raw["seed"] == msgspec.Raw(b"4")  # a changed field is spliced too
    assert req.body.get("absent", "default") == "default"
    assert "absent" not in req.body


@pytest.mark.parametrize(
    ("raw", "kind"),
    [(b"[" * 100_000 + b"]" * 100_000, "list"), (b' "s"', "str"), (b"1.5", "float"), (b"7", "int")],
)
def test_a_body_that_is_not_an_object_is_named_by_its_type(raw: bytes, kind: str) -> None:
    with pytest.raises(BadRequest, match=f"body: must be a JSON object, got {kind}"):
        parse_request(raw, endpoint=COMPLETIONS, model=MODEL)


def test_a_field_nested_too_deeply_is_refused_not_crashed() -> None:
    deep = b'{"model":"m","prompt":"p","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadRequest, match="body: "):
        parse_request(deep, endpoint=COMPLETIONS, model=MODEL)


@pytest.mark.parametrize(
    "field",
    [
        b'"prompt":"\xff"',
        b'"x_user":"\xfe\xff"',  # a field only spliced, never decoded
        b'"stream_options":{"\xff":true}',
        b'"stop":["\xed\xa0\x80"]',  # a surrogate, UTF-8 encoded
    ],
)
def test_a_body_that_is_not_utf8_is_refused_whole(field: bytes) -> None:
    raw = b'{"model":"m","prompt":"p","stream":true,' + field + b"}"
    with pytest.raises(BadRequest, match=r"body: not valid JSON \(invalid UTF-8 at byte"):
        parse_request(raw, endpoint=COMPLETIONS, model=MODEL)


def test_what_the_router_reads_is_decoded_with_the_body() -> None:
    """A field nested deep enough to pass at the parser's stack depth, read later from a
    deeper one: what the router reads was decoded already; any other field read there is
    a client error, never a crash."""
    nested = b"[" * 800 + b"]" * 800
    raw = b'{"model":"m","prompt":"p","tools":' + nested + b',"x_other":' + nested + b"}"
    req = parse_request(raw, endpoint=COMPLETIONS, model=MODEL)

    def deeper(depth: int, key: str) -> Any:
        return deeper(depth - 1, key) if depth else req.body[key]

    assert deeper(500, "tools") == msgspec.json.decode(nested)
    with pytest.raises(BadRequest, match="x_other: JSON nested too deeply"):
        deeper(500, "x_other")
