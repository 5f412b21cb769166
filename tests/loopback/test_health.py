"""Engine health over loopback: ejection on evidence, probes, readmission, whole wave, check."""

from __future__ import annotations

from typing import Any

import trio

from narwhal.core.breaker import BreakerState
from narwhal.core.config import EngineConfig, EngineContract, RecoveryConfig, ServingConfig
from narwhal.core.faults import BreakerClass
from narwhal.fake_engine.faults import Fault
from narwhal.process.check import check_fleet
from tests.support.fleet import MODEL, Harness, finish, post_raw, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}
FAST = {
    "serving": ServingConfig(graceful_timeout_s=0.5, request_timeout_s=5.0),
    "engine": EngineConfig(first_token_timeout_s=0.5, decode_read_timeout_s=0.5),
}


async def _fleet(
    nursery: trio.Nursery, roles: dict[str, str], *, readmit_s: float = 60.0, **extra: Any
) -> Harness:
    recovery = extra.pop("recovery", RecoveryConfig(eject_after=2, readmit_interval_s=readmit_s))
    return await start_fleet(nursery, roles, recovery=recovery, **{**FAST, **extra})


def _served(harness: Harness, engine: str) -> list[str]:
    return [e["request_id"] for e in harness.engines[engine].log]


async def _engines_view(harness: Harness) -> dict[str, Any]:
    view = (await harness.get("/narwhal/engines")).json()
    return {e["id"]: e for e in view["engines"]}


async def test_an_ejected_engine_gets_no_more_client_traffic(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    harness.engines["d0"].faults.push(*[Fault(kind="done_first")] * 50)
    statuses = [(await harness.post("/v1/completions", BODY)).status for _ in range(12)]
    # d0 failed twice (alternating placement), was ejected, and every later request went to d1
    assert statuses.count(502) == 2
    assert len(_served(harness, "d0")) == 2
    assert len(_served(harness, "d1")) == 10
    view = await _engines_view(harness)
    assert view["d0"]["breaker"]["state"] == "ejected"
    assert view["d0"]["breaker"]["streak"] == 2
    assert (
        view["d0"]["breaker"]["last_cause"] == "stream ended with [DONE] before any token arrived"
    )
    assert view["d1"]["breaker"]["state"] == "closed"
    event = await harness.router.events.wait_event("ejected", "d0")
    assert event["cause"] == "stream"
    await finish(harness)


async def test_client_errors_never_eject(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode"})
    harness.engines["d0"].faults.push(*[Fault(kind="status", status=400)] * 5)
    for _ in range(5):
        assert (await harness.post("/v1/completions", BODY)).status == 400
    assert harness.router.fleet.by_id["d0"].breaker.state is BreakerState.CLOSED
    assert harness.router.fleet.by_id["d0"].breaker.streak == 0
    await finish(harness)


async def test_the_probe_readmits_a_healed_engine_with_a_fresh_handoff_from_the_same_producer(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(
        nursery,
        {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"},
        readmit_s=0.2,
    )
    harness.engines["d0"].faults.push(*[Fault(kind="tokens_then_close", tokens=1)] * 2)
    for _ in range(6):
        await post_raw(harness, "/v1/completions", BODY)  # a stream cut mid-way: no raise
    d0 = harness.router.fleet.by_id["d0"]
    failing_producer = d0.failed_with
    assert failing_producer in ("p0", "p1")
    with trio.fail_after(5):
        await harness.router.events.wait_event("readmitted", "d0")
    probe = await harness.router.events.wait_event("probe", "d0")
    assert probe["outcome"] == "pass"
    # the probe: a one-token prefill on the original producer, then a decode on d0,
    # with a fresh unique prompt and a new descriptor (never the failing request's)
    prefill = harness.engines[failing_producer].log[-1]
    decode = harness.engines["d0"].log[-1]
    assert prefill["body"]["prompt"].startswith("narwhal probe d0 ")
    assert prefill["body"]["max_tokens"] == 1
    assert decode["body"]["prompt"] == prefill["body"]["prompt"]
    failing = [
        e for e in harness.engines["d0"].log if not e["body"]["prompt"].startswith("narwhal")
    ]
    descriptor = decode["body"]["kv_transfer_params"]
    assert all(
        e["body"]["kv_transfer_params"]["remote_request_id"] != descriptor["remote_request_id"]
        for e in failing
    )
    assert d0.breaker.state is BreakerState.CLOSED
    # readmitted: it takes client traffic again
    before = len(_served(harness, "d0"))
    for _ in range(4):
        assert (await harness.post("/v1/completions", BODY)).status == 200
    assert len(_served(harness, "d0")) > before
    await finish(harness)


async def test_inconclusive_probes_change_nothing(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"}, readmit_s=0.1
    )
    harness.engines["d0"].faults.push(*[Fault(kind="done_first")] * 2)
    for _ in range(4):
        await harness.post("/v1/completions", BODY)
    d0 = harness.router.fleet.by_id["d0"].breaker
    assert d0.state is BreakerState.EJECTED
    harness.engines["p0"].faults.push(*[Fault(kind="status", status=503)] * 3)  # the peer fails
    with trio.fail_after(5):
        probe = await harness.router.events.wait_event("probe", "d0")
    assert probe["outcome"] == "inconclusive"
    assert (d0.streak, d0.ejections, d0.ejection_cause) == (2, 1, BreakerClass.STREAM)
    assert d0.state in (BreakerState.EJECTED, BreakerState.PROBING)
    # once the peer is healthy again, the next probe decides
    with trio.fail_after(5):
        await harness.router.events.wait_event("readmitted", "d0")
    await finish(harness)


async def test_an_unreachable_engine_comes_back_on_health_in_a_development_fleet(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(
        nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"}, readmit_s=0.1
    )
    d0 = harness.engines["d0"]
    d0.stop()
    for _ in range(4):
        await harness.post("/v1/completions", BODY)
    breaker = harness.router.fleet.by_id["d0"].breaker
    assert breaker.ejection_cause is BreakerClass.UNREACHABLE
    with trio.fail_after(5):
        probe = await harness.router.events.wait_event("probe", "d0")
    assert probe["outcome"] == "fail"  # still down
    await nursery.start(d0.serve)  # restarted on the same port
    with trio.fail_after(5):
        await harness.router.events.wait_event("readmitted", "d0")
    assert not [e for e in d0.log if e["body"]["prompt"].startswith("narwhal probe")]
    await finish(harness)


async def test_the_last_engine_of_a_role_stays_placeable(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode"})
    harness.engines["d0"].faults.push(*[Fault(kind="done_first")] * 2)
    for _ in range(2):
        assert (await harness.post("/v1/completions", BODY)).status == 502
    assert harness.router.fleet.by_id["d0"].breaker.state is BreakerState.EJECTED
    # ejected, yet the only consumer: held in, and the fact is visible
    assert (await harness.post("/v1/completions", BODY)).status == 200
    assert (await harness.get("/ready")).status == 503
    assert (await _engines_view(harness))["d0"]["held_in"] is True
    await harness.router.events.wait_event("held_in", role="decode")
    await finish(harness)


async def test_whole_wave_maintenance_and_readmission(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        recovery=RecoveryConfig(eject_after=1, restart_policy="whole_wave", readmit_interval_s=60),
        engine_contract=EngineContract(engine_version="0.32.0"),
    )
    harness.engines["d0"].faults.push(Fault(kind="done_first"))
    assert (await harness.post("/v1/completions", BODY)).status == 502
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"].startswith("router in maintenance")
    assert (await harness.get("/ready")).status == 503
    assert (await harness.get("/health")).json() == {"status": "maintenance"}
    bad = await harness.post("/narwhal/lifecycle/readmit", {"engines": ["d0"]})
    assert bad.status == 400  # a wave is the whole engine set
    wave = await harness.post("/narwhal/lifecycle/readmit", {"engines": ["p0", "d0"]})
    assert wave.status == 200
    assert wave.json() == {"maintenance": False, "engines": {"p0": "pass", "d0": "pass"}}
    assert (await harness.get("/ready")).status == 200
    assert (await harness.post("/v1/completions", BODY)).status == 200
    await finish(harness)


async def test_lifecycle_validation_refuses_a_wrong_version(nursery: trio.Nursery) -> None:
    harness = await _fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode"},
        readmit_s=0.1,
        recovery=RecoveryConfig(eject_after=1, readmit_interval_s=0.1),
        engine_contract=EngineContract(engine_version="0.99.0"),
    )
    harness.engines["d0"].faults.push(Fault(kind="done_first"))
    for _ in range(2):
        await harness.post("/v1/completions", BODY)
    with trio.fail_after(5):
        probe = await harness.router.events.wait_event("probe", "d0")
    assert probe["outcome"] == "fail"
    assert "0.99.0" in await harness.router.health.check_identity(harness.router.fleet.by_id["d0"])  # type: ignore[operator]
    await finish(harness)


async def test_check_passes_on_a_healthy_fleet_and_names_the_broken_pair(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    config = harness.router.config
    lines, ok = await check_fleet(config)
    assert ok
    assert lines[:3] == [
        f"p0 (prefill, {harness.engines['p0'].url}): ok",
        f"d0 (decode, {harness.engines['d0'].url}): ok",
        f"d1 (decode, {harness.engines['d1'].url}): ok",
    ]
    assert lines[3].startswith("p0 -> d0 moved KV, 4 tokens, first token ")
    assert lines[4].startswith("p0 -> d1 moved KV, 4 tokens")
    assert lines[-1] == "PASS: 3/3 engines ok, 2/2 transfers moved KV"
    harness.engines["d1"].faults.push(Fault(kind="tokens_then_close", tokens=1))
    lines, ok = await check_fleet(config)
    assert not ok
    assert lines[4].startswith("p0 -> d1 FAILED on the consumer: stream ended before [DONE]")
    assert lines[-1] == "FAIL: 3/3 engines ok, 1/2 transfers moved KV"
    await finish(harness)
