"""The differential table in ``make test``, on the fake engine: every request shape of
``e2e.vllm.capture_shapes.SHAPES`` sent (a) to the consumer as an ordinary local request and
(b) through the router over the fake KV handoff, streamed and not (a stream folded by the
router's ``Assembler`` through ``StreamRelay``), compared field by field as
``e2e/vllm/test_differential.py`` compares them on real vLLM. The consumer (role decode)
serves a request without ``kv_transfer_params`` as vLLM's kv_consumer does: it computes
the prompt itself. ``pytest -s`` prints the table.

The table proves something only if the fake answers as vLLM 0.32 does: the second half
checks that for every shape the fake's answer, streamed and not, has the structure of what
real vLLM answered (``tests/captures/shapes/``): the same keys in the same order at every
level, the same JSON types, values aside.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpcore
import msgspec
import pytest
import trio

from e2e.vllm.capture_shapes import SHAPES
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, Harness, finish
from tests.support.paths import CAPTURES
from tests.support.shapes import diff_answers, fold, unexplained

SHAPE_CAPTURES = CAPTURES / "shapes"

# (shape, field) -> why the routed answer differs from the local one: kept as small as
# e2e/vllm/test_differential.py's, and for the same reason
KNOWN: dict[tuple[str, str], str] = {
    ("chat_named_tool", "choices[].message.content"): "as vLLM 0.32: a local non-streaming "
    "request gets the model's raw <tool_call> text, the stream (which the router "
    "assembles) gets tool_calls deltas",
    ("chat_named_tool", "choices[].message.tool_calls"): "the same",
    ("chat_required_tool", "choices[].message.content"): "the same as chat_named_tool",
    ("chat_required_tool", "choices[].message.tool_calls"): "the same as chat_named_tool",
}
STREAM_KNOWN: dict[tuple[str, str], str] = {}
ROWS: list[str] = []


def _body(name: str, *, stream: bool) -> tuple[str, dict[str, Any]]:
    endpoint, shape = SHAPES[name]
    body = {"model": MODEL, "temperature": 0, **shape}
    if stream:  # as capture_shapes.py streamed them: usage asked for, the shape's options kept
        body = {**body, "stream": True}
        body.setdefault("stream_options", {"include_usage": True})
    else:
        body.pop("stream_options", None)  # asked of streams only
    return endpoint, body


async def _post(http: httpcore.AsyncConnectionPool, url: str, body: Any) -> tuple[int, bytes]:
    resp = await http.request(
        "POST",
        url,
        headers=[("content-type", "application/json")],
        content=msgspec.json.encode(body),
    )
    return resp.status, resp.content


async def answer(h: Harness, base: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = await _post(h.http, f"{base}/v1/{endpoint}", body)
    data: dict[str, Any] = msgspec.json.decode(raw)
    assert status == 200 or "error" in data, raw[:300]
    return data


async def streamed(h: Harness, base: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed answer folded by the router's Assembler (itself checked against vLLM's
    non-streaming answers by tests/unit/stream/test_shape_captures.py), or the error."""
    _, raw = await _post(h.http, f"{base}/v1/{endpoint}", body)
    return fold(raw, chat=endpoint.startswith("chat"), model=MODEL)


@pytest.mark.parametrize("name", list(SHAPES))
async def test_the_routed_answer_is_the_local_answer(pd: Harness, name: str) -> None:
    endpoint, body = _body(name, stream=False)
    local = await answer(pd, pd.engines["d0"].url, endpoint, body)
    routed = await answer(pd, pd.url, endpoint, body)
    assert unexplained(ROWS, name, name, diff_answers(local, routed), KNOWN) == []
    await finish(pd)


@pytest.mark.parametrize("name", list(SHAPES))
async def test_the_routed_stream_is_the_local_stream(pd: Harness, name: str) -> None:
    endpoint, body = _body(name, stream=True)
    local = await streamed(pd, pd.engines["d0"].url, endpoint, body)
    routed = await streamed(pd, pd.url, endpoint, body)
    rows = diff_answers(local, routed)
    assert unexplained(ROWS, name, f"{name} (stream)", rows, STREAM_KNOWN) == []
    await finish(pd)


@pytest.fixture(scope="module", autouse=True)
def _report_the_table(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the module's comparisons, the table of what was compared (a report, not a
    test: it asserts nothing and shows whatever ran, in any order or selection)."""
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and ROWS:
        reporter.write_line("\n| shape | fields compared | equal | differs (why) |")
        reporter.write_line("|---|---|---|---|")
        for row in ROWS:
            reporter.write_line(row)


# ---- the fake answers as vLLM 0.32 does: structure against the captures ----------------------

# objects keyed by values (a token's text, a token id): their keys are not structure
MAPS = frozenset({"choices[].logprobs.top_logprobs[]", "choices[].prompt_logprobs[]"})


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)]


def facts(value: Any, path: str = "") -> set[tuple[str, str]]:
    """A JSON value's structure as (path, what is there) pairs: an object's keys in order,
    an array, or a scalar's JSON type. An array's elements share one path."""
    if isinstance(value, dict):
        if path in MAPS:
            out = {(path, "map")}
            for item in value.values():
                out |= facts(item, path + ".*")
            return out
        out = {(path, "keys " + ",".join(value))}
        for key, item in value.items():
            out |= facts(item, f"{path}.{key}" if path else key)
        return out
    if isinstance(value, list):
        out = {(path, "array")}
        for item in value:
            out |= facts(item, path + "[]")
        return out
    return {(path, _kind(value))}


def stream_facts(raw: bytes) -> set[tuple[str, str]]:
    """Every chunk's structure (an error answer's when the stream was refused)."""
    if not raw.startswith(b"data:"):
        return facts(msgspec.json.decode(raw))
    out: set[tuple[str, str]] = set()
    for event in SSEParser().feed(raw):
        if event != b"[DONE]":
            out |= facts(msgspec.json.decode(event))
    return out


# (shape, streamed) -> {path: why the fake's structure differs there}: where the fake's
# values, not its shapes, take another branch than the dummy model's did
STRUCTURE_KNOWN: dict[tuple[str, bool], dict[str, str]] = {
    ("chat_stop", False): {
        "choices[].stop_reason": "vLLM's dummy model never wrote a stop string (null); the "
        "fake's first word holds one (the string)",
    },
    ("chat_stop", True): {
        "choices[].stop_reason": "the same",
        "choices[]": "the fake's one token finished it: no chunk without a stop_reason before",
    },
    ("completion_stop", True): {
        "choices[].finish_reason": "vLLM's dummy model wrote the stop string in its first "
        "token, so its one chunk finished; the fake's comes in its fourth (null before it)",
        "choices[].stop_reason": "the same",
    },
}


def _capture_request(name: str) -> tuple[str, dict[str, Any]]:
    request = msgspec.json.decode((SHAPE_CAPTURES / f"{name}.request.json").read_bytes())
    endpoint: str = request["endpoint"]
    body: dict[str, Any] = request["body"]
    return endpoint, body


@pytest.mark.parametrize("name", list(SHAPES))
async def test_the_fake_answers_with_vllms_structure(nursery: trio.Nursery, name: str) -> None:
    """The bodies capture_shapes.py sent, sent to a fake engine playing kv_both as the
    captured engine did: each answer's structure is the capture's, streamed and not."""
    engine = FakeEngine(FakeEngineConfig(model="tiny", role="both"))
    url = await nursery.start(engine.serve)
    endpoint, body = _capture_request(name)
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    stream = {**body, "stream": True}
    stream.setdefault("stream_options", {"include_usage": True})
    wrong: dict[str, Any] = {}
    async with httpcore.AsyncConnectionPool() as http:
        for streamed_too, sent, suffix in ((False, plain, "json"), (True, stream, "sse")):
            _, raw = await _post(http, f"{url}/v1/{endpoint}", {**sent, "stream": streamed_too})
            ours = stream_facts(raw)
            real = stream_facts((SHAPE_CAPTURES / f"{name}.{suffix}").read_bytes())
            known = STRUCTURE_KNOWN.get((name, streamed_too), {})
            paths = {p for p, _ in ours ^ real}
            assert set(known) <= paths, f"{name}.{suffix}: a stale exception"
            differ = sorted(paths - set(known))
            if differ:
                wrong[suffix] = {
                    "paths": differ,
                    "vllm only": sorted(f for f in real - ours if f[0] in differ),
                    "fake only": sorted(f for f in ours - real if f[0] in differ),
                }
    assert wrong == {}
    engine.stop()
