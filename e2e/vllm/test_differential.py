"""Nothing the client asked for is lost: every request shape of ``capture_shapes.SHAPES``
sent (a) to the consumer as an ordinary local request and (b) through the router over the
real NIXL handoff, at temperature 0 (or seeded), compared field by field after leaving out
ids, timestamps and fingerprints. Runs first in the session (file order), before the
consumer is killed. Prints the table; asserts the fields contract 3 names, except the
differences listed with their reason."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.shapes import diff_answers, fold, unexplained

from .capture_shapes import SHAPES
from .conftest import MODEL, Fleet, http

pytestmark = pytest.mark.vllm

# (shape, field) -> why the routed answer differs from the local one
KNOWN: dict[tuple[str, str], str] = {
    ("chat_named_tool", "choices[].message.content"): "vLLM streams the forced call as "
    "tool_calls deltas but answers a local non-streaming request with the raw <tool_call> "
    "text (the dummy model's JSON is cut by max_tokens): the router assembles the stream",
    ("chat_named_tool", "choices[].message.tool_calls"): "the same",
    ("chat_required_tool", "choices[].message.content"): "the same as chat_named_tool",
    ("chat_required_tool", "choices[].message.tool_calls"): "the same as chat_named_tool",
    ("completion_n2", "choices[].text"): "may differ: n runs as n requests with seeds seed+j, "
    "not vLLM's one request",
    ("completion_n2", "choices[].token_ids"): "the same",
    ("completion_n2", "usage"): "the same samples, other lengths",
    ("chat_n2", "choices[].message.content"): "the same as completion_n2",
    ("chat_n2", "usage"): "the same as completion_n2",
    ("completion_seed", "choices[].text"): "may differ: a seeded sample on the consumer after "
    "a remote prefill need not repeat the local one",
    ("completion_seed", "usage"): "the same",
}
ROWS: list[str] = []


def answer(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = http("POST", f"{url}/v1/{endpoint}", {**body, "stream": False})
    data: dict[str, Any] = json.loads(raw)
    assert status == 200 or "error" in data, raw[:300]
    return data


def streamed(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer, folded by the router's Assembler (itself checked against vLLM's
    non-streaming answers by tests/unit/stream/test_shape_captures.py), or the error."""
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    _, raw = http("POST", f"{url}/v1/{endpoint}", stream)
    return fold(raw, chat=endpoint.startswith("chat"), model=MODEL)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_routed_answer_is_the_local_answer(fleet: Fleet, name: str) -> None:
    endpoint, shape = SHAPES[name]
    body = {"model": MODEL, "temperature": 0, **shape}
    body.pop("stream_options", None)  # asked of streams only
    local = answer(fleet.consumer.url, endpoint, body)
    routed = answer(fleet.router_url, endpoint, body)
    assert unexplained(ROWS, name, name, diff_answers(local, routed), KNOWN) == []


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_routed_stream_is_the_local_stream(fleet: Fleet, name: str) -> None:
    """The same shapes streamed: the router relays the consumer's chunks (fan-out merges
    several), so the folded streams must agree too."""
    endpoint, shape = SHAPES[name]
    body = {"model": MODEL, "temperature": 0, **shape}
    local = streamed(fleet.consumer.url, endpoint, body)
    routed = streamed(fleet.router_url, endpoint, body)
    rows = diff_answers(local, routed)
    assert unexplained(ROWS, name, f"{name} (stream)", rows, STREAM_KNOWN) == []


# (shape, field) -> why a routed stream differs from the local one
STREAM_KNOWN: dict[tuple[str, str], str] = {
    ("completion_n2", "choices[].text"): "may differ, as in the non-streamed table",
    ("completion_n2", "choices[].token_ids"): "the same",
    ("completion_n2", "usage"): "the same",
    ("chat_n2", "choices[].message.content"): "the same",
    ("chat_n2", "usage"): "the same",
    ("completion_seed", "choices[].text"): "may differ, as in the non-streamed table",
    ("completion_seed", "usage"): "the same",
}


def test_print_the_table() -> None:
    print("\n| shape | fields compared | equal | differs (why) |\n|---|---|---|---|")
    print("\n".join(ROWS))
