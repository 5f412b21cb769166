"""``POST /tokenize`` and ``POST /detokenize``: vLLM's, passed through to a placeable engine.

As a stranger's benchmark client calls them (vLLM's ``benchmark_serving`` aligns its
prompts with ``/tokenize``): over loopback to the router, answers held against what one
engine gives on its own; auth, limits, request id, journal and engine faults as for any
request.
"""

from __future__ import annotations

from typing import Any

import httpcore
import msgspec
import pytest
import trio

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, start_fleet

TOKENIZE = {"model": MODEL, "prompt": "The quick brown fox jumps"}
DETOKENIZE = {"model": MODEL, "tokens": [1, 2, 3]}


async def _alone(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with httpcore.AsyncConnectionPool() as http:
        reply = await http.request("POST", url + path, content=msgspec.json.encode(body))
        return reply.status, msgspec.json.decode(reply.content)


async def _fleet(nursery: trio.Nursery, **sections: Any) -> Harness:
    return await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, **sections)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", TOKENIZE),
        ("/tokenize", {**TOKENIZE, "return_token_strs": True}),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}),
        ("/detokenize", DETOKENIZE),
    ],
)
async def test_answered_as_the_engine_answers_with_a_request_id_and_a_journal_line(
    nursery: trio.Nursery, path: str, body: dict[str, Any]
) -> None:
    harness = await _fleet(nursery)
    reply = await harness.post(path, body, {"x-request-id": "bench-1"})
    assert reply.status == 200
    assert reply.headers["x-request-id"] == "bench-1"
    assert reply.json() == (await _alone(harness.engines["p0"].url, path, body))[1]
    if path == "/tokenize":
        assert set(reply.json()) == {"count", "max_model_len", "tokens", "token_strs"}
    else:
        assert set(reply.json()) == {"prompt"}
    await harness.router.wait_drained()
    (line,) = harness.router.journal.lines
    assert (line.request_id, line.endpoint, line.outcome, line.status) == (
        "bench-1",
        path,
        "completed",
        200,
    )
    seen = [e["request_id"] for engine in harness.engines.values() for e in engine.log]
    assert seen[0] == f"bench-1-a1-{path.strip('/')}"
    await finish(harness)


async def test_engine_client_errors_pass_through(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery)
    # a name no engine serves is the router's own 404, as for a completion: no engine asked
    reply = await harness.post("/tokenize", {**TOKENIZE, "model": "other"})
    assert reply.status == 404
    assert reply.json()["error"]["message"] == "model 'other' is not served here"
    assert not [e for engine in harness.engines.values() for e in engine.log]
    reply = await harness.post("/detokenize", {"model": MODEL, "tokens": ["x"]})
    assert reply.status == 400
    assert "body.tokens" in reply.json()["error"]["message"]
    await harness.router.wait_drained()
    assert [(x.outcome, x.status) for x in harness.router.journal.lines] == [
        ("failed", 404),
        ("failed", 400),
    ]
    await finish(harness)


async def test_an_engine_fault_is_a_502_and_a_silent_engine_a_504(nursery: trio.Nursery) -> None:
    serving = ServingConfig(graceful_timeout_s=0.5, prefill_timeout_s=0.3)
    harness = await start_fleet(nursery, {"p0": "prefill"}, serving=serving)
    engine = harness.engines["p0"]
    engine.faults.push(Fault(kind="status", leg="tokenize", status=500, message="boom"))
    reply = await harness.post("/tokenize", TOKENIZE)
    assert reply.status == 502
    assert reply.json()["error"]["message"] == "boom"
    engine.faults.push(Fault(kind="hang", leg="tokenize"))
    with trio.fail_after(5):
        reply = await harness.post("/detokenize", DETOKENIZE)
    assert reply.status == 504
    assert reply.json()["error"]["message"] == "/detokenize on engine p0 took longer than 0.3s"
    await harness.router.wait_drained()
    assert [(x.outcome, x.status) for x in harness.router.journal.lines] == [
        ("failed", 502),
        ("failed", 504),
    ]
    await finish(harness)


async def test_the_usual_limits_hold(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_TOKENIZE_KEYS", "secret")
    serving = ServingConfig(
        graceful_timeout_s=0.5,
        api_keys_env="NARWHAL_TEST_TOKENIZE_KEYS",
        max_request_bytes=1024,
        max_inflight=1,
    )
    harness = await _fleet(nursery, serving=serving)
    key = {"authorization": "Bearer secret"}
    reply = await harness.post("/tokenize", TOKENIZE)
    assert reply.status == 401
    reply = await harness.post("/tokenize", {**TOKENIZE, "prompt": "x " * 1000}, key)
    assert reply.status == 413
    # one request in flight (a tokenize the engine holds): the next is refused with 429
    harness.engines["p0"].faults.push(Fault(kind="hang", leg="tokenize"))
    held = trio.CancelScope()

    async def hold() -> None:
        with held:
            await harness.post("/tokenize", TOKENIZE, key)

    nursery.start_soon(hold)
    with trio.fail_after(5):
        await harness.engines["p0"].wait_logged(1)
    assert harness.router.admission.admitted == 1
    reply = await harness.post("/detokenize", DETOKENIZE, key)
    assert reply.status == 429
    assert reply.headers["retry-after"] == "1"
    held.cancel()  # the client leaves: the held leg is cancelled at once
    with trio.fail_after(5):
        await harness.router.wait_drained()
    reply = await harness.post("/tokenize", TOKENIZE, key)
    assert reply.status == 200
    await harness.router.wait_drained()
    assert [(x.outcome, x.status) for x in harness.router.journal.lines] == [
        ("rejected", 401),
        ("rejected", 413),
        ("rejected", 429),
        ("cancelled", None),
        ("completed", 200),
    ]
    await finish(harness, disconnects=0)


async def test_get_is_405(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery)
    reply = await harness.get("/tokenize")
    assert reply.status == 405
    await finish(harness)
