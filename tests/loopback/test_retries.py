"""Retries (contract 6.1) over loopback: only before output, fresh ids, other engines, budgeted."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.core.faults import EngineStatusError, FirstTokenTimeout, Phase
from narwhal.core.retry import RetryBudget, retry_decision
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, post_raw, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "stream": True}


async def _fleet(nursery: trio.Nursery, roles: dict[str, str], **serving: Any) -> Harness:
    settings = {"graceful_timeout_s": 0.5, "retry_backoff_s": 0.01, **serving}
    return await start_fleet(
        nursery,
        roles,
        serving=ServingConfig(**settings),
        engine=EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
    )


def _ids(harness: Harness, engine: str) -> list[str]:
    return [entry["request_id"] for entry in harness.engines[engine].log]


async def _journal(harness: Harness) -> Any:
    await harness.router.wait_drained()
    return harness.router.journal.lines[-1]


async def test_a_failed_producer_is_retried_elsewhere_with_fresh_ids(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery, {"p0": "prefill", "p1": "prefill", "d0": "decode"}, max_attempts=2
    )
    harness.engines["p0"].faults.push(Fault(kind="status", status=503))
    harness.engines["p1"].faults.push(Fault(kind="status", status=503))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 502  # both producers failed once: two attempts, no third
    rid = reply.headers["x-request-id"]
    assert sorted(_ids(harness, "p0") + _ids(harness, "p1")) == [
        f"{rid}-a1-prefill",
        f"{rid}-a2-prefill",
    ]
    line = await _journal(harness)
    assert [a.retry for a in line.attempts] == ["retry", "attempts"]
    assert line.attempts[0].producer != line.attempts[1].producer
    # with the faults used up, the next request succeeds on the first attempt
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 200
    await finish(harness)


async def test_a_failed_consumer_is_avoided_and_the_retry_succeeds(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"}, max_attempts=3
    )
    for consumer in ("d0", "d1"):
        harness.engines[consumer].faults.push(Fault(kind="status", status=503))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 200
    assert reply.events()[-1] == b"[DONE]"
    rid = reply.headers["x-request-id"]
    line = await _journal(harness)
    first, second, third = line.attempts
    assert first.consumer != second.consumer  # others existed: the failed one was avoided
    assert third.consumer in ("d0", "d1")  # every consumer failed once: any may serve
    assert [a.retry for a in line.attempts] == ["retry", "retry", None]
    await harness.router.reclaimer.wait_idle()
    decode_ids = sorted(_ids(harness, "d0") + _ids(harness, "d1"))
    # the two refused handoffs are orphans: each is read once by a reclaim leg, so the
    # producer frees its blocks now instead of at the end of its lease
    assert decode_ids == [
        f"{rid}-a1-decode",
        f"{rid}-a1-reclaim",
        f"{rid}-a2-decode",
        f"{rid}-a2-reclaim",
        f"{rid}-a3-decode",
    ]
    assert _ids(harness, "p0") == [f"{rid}-a{n}-prefill" for n in (1, 2, 3)]  # a new handoff each
    await finish(harness)


@pytest.mark.parametrize("stream", [True, False])
async def test_no_retry_after_output(nursery: trio.Nursery, stream: bool) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode"}, max_attempts=3)
    harness.engines["d0"].faults.push(Fault(kind="tokens_then_close", tokens=2))
    body = {**BODY, "stream": stream}
    reply = await (post_raw if stream else Harness.post)(harness, "/v1/completions", body)
    if stream:
        assert reply.status == 200
        assert b'"error"' in reply.events()[-1]
    else:
        assert reply.status == 502
    assert len(harness.engines["d0"].log) == 1
    line = await _journal(harness)
    assert [a.retry for a in line.attempts] == ["after_output"]
    await finish(harness)


async def test_one_attempt_by_default(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    harness.engines["d0"].faults.push(Fault(kind="hang", leg="decode"))
    harness.engines["d1"].faults.push(Fault(kind="hang", leg="decode"))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 504
    assert len(harness.engines["d0"].log) + len(harness.engines["d1"].log) == 1
    assert (await _journal(harness)).attempts[0].retry == "attempts"
    await finish(harness)


async def test_client_errors_are_never_retried(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode"}, max_attempts=3)
    harness.engines["p0"].faults.push(Fault(kind="status", status=400, message="bad prompt"))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "bad prompt"
    assert len(harness.engines["p0"].log) == 1
    assert (await _journal(harness)).attempts[0].retry == "not_transient"
    await finish(harness)


async def test_the_budget_bounds_retries_router_wide(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        max_attempts=3,
        retry_budget=1.0,
        retry_replenish=0.0,
    )
    harness.engines["p0"].faults.push(*[Fault(kind="status", status=503)] * 3)
    assert (await harness.post("/v1/completions", BODY)).status == 502
    assert [a.retry for a in (await _journal(harness)).attempts] == ["retry", "budget"]
    assert (await harness.post("/v1/completions", BODY)).status == 502
    assert [a.retry for a in (await _journal(harness)).attempts] == ["budget"]
    assert len(harness.engines["p0"].log) == 3
    await finish(harness)


def test_decide_rules_in_order() -> None:
    rng = random.Random(7)
    fault = FirstTokenTimeout("no first token within 1s", phase=Phase.DECODE)
    client_error = EngineStatusError(422, "bad", phase=Phase.PREFILL)
    budget = RetryBudget(cap=2.0, replenish=0.5)
    common: dict[str, Any] = {"backoff_base_s": 0.1, "budget": budget, "rng": rng}

    def run(f: Any = fault, **kw: Any) -> str:
        args = {"attempt": 1, "max_attempts": 3, "output_seen": False, "remaining_s": 10.0}
        return retry_decision(f, **{**args, **common, **kw}).reason

    assert run(client_error) == "not_transient"
    assert run(output_seen=True) == "after_output"
    assert run(attempt=3) == "attempts"
    assert run(remaining_s=0.0) == "deadline"
    assert run() == "retry"
    assert run() == "retry"
    assert run() == "budget"  # two credits spent
    budget.earn()
    budget.earn()
    assert run() == "retry"
    decision = retry_decision(
        fault,
        attempt=2,
        max_attempts=3,
        output_seen=False,
        remaining_s=10.0,
        backoff_base_s=0.1,
        budget=RetryBudget(1.0, 0.0),
        rng=rng,
    )
    assert 0.0 <= decision.delay_s <= 0.2  # full jitter over base * 2^(attempt-1)
