"""No stranded KV (contract 5, invariant 7): a handoff never outlives the producer's lease, and
one that no decode will read is reclaimed at once by a one-token decode leg owned by the
server, so the producer frees its blocks now instead of when its lease runs out.

Every orphan source is here: the client leaving after prefill, an attempt failing before
its decode leg, the request deadline, a fan-out sibling failing, ``handoff_timeout_s``.
The fake producer models the lease and counts a read of an expired descriptor
(``kv_pull_refused_expired``): it must stay 0.
"""

from __future__ import annotations

import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.config import EngineConfig, EngineContract, ServingConfig
from narwhal.core.connector import RECLAIM_MODEL, NixlConnector, PrefillResult
from narwhal.core.handoff import Fate, Handoff, reclaim_verdict, too_old
from narwhal.fake_engine.faults import Fault
from narwhal.process.check import lease_warning
from tests.support.fleet import MODEL, Harness, finish, fleet_config, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}


def fates(harness: Harness) -> dict[str, float]:
    value = harness.router.metrics.registry.get_sample_value
    names = ("produced", *(f.value for f in Fate))
    return {n: value("narwhal_handoffs_total", {"fate": n}) or 0.0 for n in names}


def ids(harness: Harness, engine: str) -> list[str]:
    return [entry["request_id"] for entry in harness.engines[engine].log]


async def settled(harness: Harness) -> None:
    with trio.fail_after(5):
        await harness.router.wait_drained()
        await harness.router.reclaimer.wait_idle()


def held(harness: Harness, engine: str = "p0") -> int:
    """Leases the producer still holds: KV blocks nobody read."""
    return len(harness.engines[engine].store.leases)


async def kv_usage(harness: Harness, engine: str = "p0") -> float:
    """The producer's ``vllm:kv_cache_usage_perc``, as an operator's scrape reads it."""
    url = harness.router.fleet.by_id[engine].url
    reply = await harness.http.request("GET", url + "/metrics")
    for line in reply.content.decode().splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc")


def consumers_of(harness: Harness) -> tuple[str, str]:
    """(the consumer the only request's decode leg met, the other one of d0 and d1)."""
    (line,) = harness.router.journal.lines
    failed = line.attempts[0].consumer
    assert failed in ("d0", "d1")
    return failed, "d1" if failed == "d0" else "d0"


def legs_of(harness: Harness) -> list[tuple[str | None, str | None]]:
    """(producer, consumer) of every attempt the journal wrote."""
    lines = harness.router.journal.lines
    return [(a.producer, a.consumer) for line in lines for a in line.attempts]


def expired_reads(harness: Harness) -> int:
    return sum(
        e.counters["kv_pull_refused_expired"] + e.counters["kv_release_declined_expired"]
        for e in harness.engines.values()
    )


# ---- every orphan source is reclaimed ---------------------------------------------------------


async def test_a_refused_decode_leaves_an_orphan_that_is_reclaimed_at_once(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    for consumer in ("d0", "d1"):  # whichever the decode meets refuses it
        harness.engines[consumer].faults.push(Fault(kind="status", status=503, leg="decode"))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 502
    rid = reply.headers["x-request-id"]
    await settled(harness)
    failed, other = consumers_of(harness)
    # the reclaim goes to the other consumer: the one that just refused would refuse again
    assert ids(harness, failed) == [f"{rid}-a1-decode"]
    assert ids(harness, other) == [f"{rid}-a1-reclaim"]
    assert held(harness) == 0  # the producer freed the blocks, told by the consumer
    assert await kv_usage(harness) == 0
    p0, reclaimer = harness.engines["p0"], harness.engines[other]
    assert (p0.counters["kv_released_unread"], p0.counters["kv_released"]) == (1, 0)
    assert reclaimer.counters["kv_release_sent"] == 1
    assert fates(harness) | {} == {
        "produced": 1,
        "decoded": 0,
        "expired": 0,
        "orphaned": 1,
        "reclaimed": 1,
        "reclaim_failed": 0,
        "reclaim_dropped": 0,
    }
    # the reclaim is a request the consumer refuses before admission: nothing computed,
    # nothing moved, the descriptor passed on untouched
    leg = reclaimer.log[-1]
    assert leg["body"]["model"] == RECLAIM_MODEL
    assert leg["body"]["kv_transfer_params"]["remote_engine_id"] == p0.engine_id
    assert reclaimer.counters["generation_tokens"] == 0
    assert reclaimer.counters["kv_pull_ok"] == 0
    (line,) = harness.router.journal.lines
    assert line.attempts[0].handoff_fate == "orphaned"
    assert harness.router.metrics.registry.get_sample_value("narwhal_reclaim_seconds_count") == 1
    await finish(harness)


async def test_a_client_gone_after_prefill_leaves_no_kv_behind(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    harness.engines["d0"].faults.push(Fault(kind="hang", leg="decode"))
    async with trio.open_nursery() as client:  # a user who gives up before the first token
        client.start_soon(harness.post, "/v1/completions", {**BODY, "stream": True})
        await harness.engines["d0"].wait_running()  # the decode leg is there, and hangs
        client.cancel_scope.cancel()
    await settled(harness)
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.attempts[0].handoff_fate) == ("cancelled", "orphaned")
    assert ids(harness, "d0")[-1] == f"{line.request_id}-a1-reclaim"
    assert held(harness) == 0
    assert fates(harness)["reclaimed"] == 1
    await finish(harness, disconnects=1)


async def test_the_deadline_orphan_is_reclaimed(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=0.4),
        engine=EngineConfig(first_token_timeout_s=0.3),
    )
    for consumer in ("d0", "d1"):
        harness.engines[consumer].faults.push(Fault(kind="hang", leg="decode"))
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 504
    await settled(harness)
    _, other = consumers_of(harness)
    assert ids(harness, other)[-1].endswith("-a1-reclaim")
    assert held(harness) == 0
    assert fates(harness)["reclaimed"] == 1
    await finish(harness)


async def test_a_fan_out_sibling_that_fails_leaves_no_orphan_behind(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    # a child's consumer closes the connection 0.3 s in, with both children decoding by
    # then; a second leg on the same consumer hangs until that failure cancels it
    for consumer in ("d0", "d1"):
        harness.engines[consumer].faults.push(
            Fault(kind="script", value=[("sleep", 0.3), ("close", None)]),
            Fault(kind="hang", leg="decode"),
        )
    reply = await harness.post("/v1/completions", {**BODY, "n": 2, "temperature": 0.7})
    assert reply.status == 502
    await settled(harness)
    reclaims = [i for c in ("d0", "d1") for i in ids(harness, c) if i.endswith("-reclaim")]
    assert len(reclaims) == 2
    assert len(set(reclaims)) == 2
    assert held(harness) == 0
    assert fates(harness)["reclaimed"] == 2
    await finish(harness)


async def test_an_expired_handoff_within_the_lease_is_reclaimed(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine_config={"prefill_delay_per_token_s": 0.1},
        serving=ServingConfig(graceful_timeout_s=0.5, handoff_timeout_s=0.15),
    )
    reply = await harness.post("/v1/completions", BODY)  # 2 prompt tokens: 0.2 s of prefill
    assert reply.status == 504
    rid = reply.headers["x-request-id"]
    await settled(harness)
    assert ids(harness, "d0") == [f"{rid}-a1-reclaim"]  # never decoded for the client
    assert held(harness) == 0
    assert (fates(harness)["expired"], fates(harness)["reclaimed"]) == (1, 1)
    await finish(harness)


# ---- the lease bounds every handoff -----------------------------------------------------------


async def test_a_handoff_older_than_the_lease_never_reaches_a_consumer(
    nursery: trio.Nursery,
) -> None:
    # lease 1 s: a descriptor older than 0.95 s may not be sent, whatever handoff_timeout_s
    # says; a 1.2 s prefill makes every handoff too old
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine_config={"prefill_delay_per_token_s": 0.6, "kv_lease_s": 1.0},
        serving=ServingConfig(graceful_timeout_s=0.5, handoff_timeout_s=100.0, max_attempts=2),
        engine=EngineConfig(first_token_timeout_s=0.3, kv_lease_s=1.0),
    )
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 504
    message = reply.json()["error"]["message"]
    assert message.startswith("KV handoff expired"), message
    assert "lease" in message, message
    await settled(harness)
    assert ids(harness, "d0") == []  # no consumer leg, not even a reclaim
    (line,) = harness.router.journal.lines
    assert [a.handoff_fate for a in line.attempts] == ["expired", "expired"]  # a fresh attempt too
    f = fates(harness)
    assert (f["produced"], f["expired"], f["reclaim_dropped"]) == (2, 2, 2)
    value = harness.router.metrics.registry.get_sample_value
    assert value("narwhal_reclaim_dropped_total", {"reason": "lease"}) == 2
    assert expired_reads(harness) == 0
    await finish(harness)


# ---- what a reclaim leg is not ----------------------------------------------------------------


async def test_reclaim_off_leaves_the_orphan_to_the_lease(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine=EngineConfig(reclaim_orphans=False),
    )
    harness.engines["d0"].faults.push(Fault(kind="status", status=503, leg="decode"))
    assert (await harness.post("/v1/completions", BODY)).status == 502
    await settled(harness)
    assert not [i for i in ids(harness, "d0") if i.endswith("-reclaim")]
    assert held(harness) == 1  # pinned until the lease runs out: what reclaim is for
    assert await kv_usage(harness) > 0
    f = fates(harness)
    assert (f["orphaned"], f["reclaimed"], f["reclaim_dropped"]) == (1, 0, 0)
    await finish(harness)


async def test_a_failed_reclaim_counts_against_no_breaker_and_no_client_metric(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"})
    for consumer in ("d0", "d1"):
        harness.engines[consumer].faults.push(
            Fault(kind="status", status=503, leg="decode"), Fault(kind="status", leg="reclaim")
        )
    assert (await harness.post("/v1/completions", BODY)).status == 502
    await settled(harness)
    assert fates(harness)["reclaim_failed"] == 1
    value = harness.router.metrics.registry.get_sample_value
    # the client's failed decode leg counted once; the failed reclaim not at all
    failed, other = consumers_of(harness)
    assert ids(harness, other)[-1].endswith("-a1-reclaim")
    assert harness.router.fleet.by_id[failed].breaker.streak == 1
    assert harness.router.fleet.by_id[other].breaker.streak == 0
    assert (
        value(
            "narwhal_requests_total",
            {"model": MODEL, "endpoint": "completions", "outcome": "failed", "status": "502"},
        )
        == 1
    )
    assert value("narwhal_attempts_total") == 1
    assert harness.router.journal.written == 1
    await finish(harness)


async def test_no_healthy_consumer_but_the_producer_drops_the_reclaim(
    nursery: trio.Nursery,
) -> None:
    # e0 plays both roles, d1 refuses the decode: the orphan's reclaim may go neither back to
    # its producer nor to the consumer that just refused it (the retry runs on e0 alone)
    serving = ServingConfig(max_attempts=2, graceful_timeout_s=0.5)
    harness = await start_fleet(nursery, {"e0": "both", "d1": "decode"}, serving=serving)
    harness.engines["d1"].faults.push(Fault(kind="status", status=503, leg="decode"))
    reply = await harness.post("/v1/completions", BODY)
    await settled(harness)
    assert legs_of(harness)[0] == ("e0", "d1")
    value = harness.router.metrics.registry.get_sample_value
    assert value("narwhal_reclaim_dropped_total", {"reason": "no_consumer"}) == 1
    assert reply.status == 200
    assert legs_of(harness)[1] == (None, "e0")  # the retry: local, on e0 alone
    await finish(harness)


# ---- an engine in both roles never hands KV to itself -------------------------------------


async def test_engines_in_both_roles_hand_off_to_each_other_and_hold_no_kv(
    nursery: trio.Nursery,
) -> None:
    # each prompt's prefix is then held by its producer, which prefix affinity would pick
    # to decode too: a handoff to itself leaves the prefill's blocks held for the lease
    harness = await start_fleet(nursery, {"e0": "both", "e1": "both"})
    for i in range(6):
        body = {**BODY, "prompt": f"turn {i % 2}: " + "the same long prefix " * 40}
        assert (await harness.post("/v1/completions", body)).status == 200
    await settled(harness)
    legs = legs_of(harness)
    assert len(legs) == 6
    assert all(producer != consumer for producer, consumer in legs), legs
    assert (held(harness, "e0"), held(harness, "e1")) == (0, 0)
    assert fates(harness)["decoded"] == 6
    assert sum(e.counters["kv_pull_ok"] for e in harness.engines.values()) == 6
    await finish(harness)


async def test_one_engine_in_both_roles_serves_a_request_alone(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"e0": "both"})
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 200
    assert reply.json()["choices"][0]["text"]
    await settled(harness)
    (line,) = harness.router.journal.lines
    assert line.attempts[0].local
    assert [e["request_id"] for e in harness.engines["e0"].log] == [f"{line.request_id}-a1-decode"]
    assert held(harness, "e0") == 0
    value = harness.router.metrics.registry.get_sample_value
    decision = {"decision": "local_one_engine"}
    assert value("narwhal_disaggregation_decisions_total", decision) == 1
    await finish(harness)


async def test_a_producer_beside_the_only_consumer_takes_the_prefill(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"e0": "both", "p1": "prefill"})
    for _ in range(4):
        assert (await harness.post("/v1/completions", BODY)).status == 200
    await settled(harness)
    legs = legs_of(harness)
    assert legs == [("p1", "e0")] * 4
    assert (held(harness, "e0"), held(harness, "p1")) == (0, 0)
    await finish(harness)


@pytest.mark.parametrize(
    "extra", [{"echo": True}, {"prompt_logprobs": 1}, {"return_token_ids": True}]
)
async def test_an_answer_that_needs_the_prefill_on_one_engine_holds_no_kv(
    nursery: trio.Nursery, extra: dict[str, object]
) -> None:
    # its answer needs the prefill leg, and the only consumer is its producer: both legs go
    # there, and the prefill asks for no descriptor, so the engine holds no blocks for a
    # read that never comes (a fleet of one engine would otherwise fill its cache)
    harness = await start_fleet(nursery, {"e0": "both"})
    for _ in range(3):
        reply = await harness.post("/v1/completions", {**BODY, **extra})
        assert reply.status == 200
    if "echo" in extra:
        assert reply.json()["choices"][0]["text"].startswith(BODY["prompt"])
    await settled(harness)
    assert legs_of(harness) == [("e0", "e0")] * 3
    assert all(a.handoff_fate is None for ln in harness.router.journal.lines for a in ln.attempts)
    prefills = [e["body"] for e in harness.engines["e0"].log if e["request_id"].endswith("prefill")]
    assert len(prefills) == 3
    assert all("kv_transfer_params" not in body for body in prefills)
    assert held(harness, "e0") == 0
    assert harness.engines["e0"].counters["kv_leases_issued"] == 0
    value = harness.router.metrics.registry.get_sample_value
    assert value("narwhal_reclaim_dropped_total", {"reason": "no_consumer"}) in (None, 0.0)
    await finish(harness)


# ---- the sans-IO rules -----------------------------------------------------------------------


def _handoff(started: float = 0.0) -> Handoff:
    result = PrefillResult("u", "/v1/completions", "r", "NixlConnector", msgspec.Raw(b"{}"))
    return Handoff("r", 1, "p0", result, started)


@settings(deadline=None)
@given(
    age=st.floats(0, 1000),
    handoff_timeout=st.floats(0, 1000),
    lease=st.floats(1, 1000),
    first_token=st.floats(0.01, 10),
)
def test_no_descriptor_older_than_the_lease_limit_passes(
    age: float, handoff_timeout: float, lease: float, first_token: float
) -> None:
    limit = EngineConfig(kv_lease_s=lease, first_token_timeout_s=first_token).lease_limit_s
    reason = too_old(age, handoff_timeout_s=handoff_timeout, lease_limit_s=limit)
    if age > limit or (handoff_timeout > 0 and age > handoff_timeout):
        assert reason is not None
    else:
        assert reason is None
    assert limit < lease  # the send happens inside the lease, with slack


@settings(deadline=None)
@given(
    age=st.floats(0, 100),
    limit=st.floats(0, 100),
    placeable=st.integers(0, 3),
    free=st.integers(0, 3),
)
def test_a_reclaim_is_sent_only_inside_the_lease_to_a_free_consumer(
    age: float, limit: float, placeable: int, free: int
) -> None:
    free = min(free, placeable)
    verdict = reclaim_verdict(_handoff(), age, limit_s=limit, placeable=placeable, free=free)
    if verdict is None:
        assert age <= limit
        assert free > 0
    else:
        assert verdict in ("lease", "no_consumer", "saturated")


def test_the_reclaim_request_carries_the_descriptor_byte_for_byte() -> None:
    descriptor = (
        b'{"do_remote_prefill":true,"remote_engine_id":"e \\u00e9","remote_block_ids":[[1,2]]}'
    )
    result = PrefillResult(
        "u", "/v1/chat/completions", "r", "NixlConnector", msgspec.Raw(descriptor)
    )
    raw = NixlConnector().reclaim_body(result)
    assert descriptor in raw
    body = msgspec.json.decode(raw)
    assert body == {
        "model": RECLAIM_MODEL,  # refused before admission: no engine serves it
        "prompt": "x",
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": msgspec.json.decode(descriptor),
    }


def test_check_warns_when_the_leases_disagree() -> None:
    base = fleet_config({"p0": ("http://127.0.0.1:1", "prefill")})
    pinned = msgspec.structs.replace(
        base, engine_contract=EngineContract(engine_version="0.32.0", kv_lease_s=60.0)
    )
    assert lease_warning(base) is None  # nothing pinned: nothing to compare
    warning = lease_warning(pinned)  # ours is the 30 s default, vLLM 0.32's
    assert warning is not None
    assert "30s" in warning
    assert "60s" in warning
    assert "refused" in warning
    longer = msgspec.structs.replace(pinned, engine=EngineConfig(kv_lease_s=480.0))
    warning = lease_warning(longer)
    assert warning is not None
    assert "480s" in warning
    assert "freed" in warning
    same = msgspec.structs.replace(pinned, engine=EngineConfig(kv_lease_s=60.0))
    assert lease_warning(same) is None
