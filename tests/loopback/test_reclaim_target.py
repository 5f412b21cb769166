"""Where a reclaim leg goes (contract 5): to a placeable consumer other than the one whose leg
with the descriptor failed, never to the producer; a consumer whose connection fails before
the request was sent is followed by one more try on another, never a third.

A stopped consumer is the case that matters: its decode leg fails at connect, and a reclaim
sent back to it fails the same way, so the producer keeps the KV until its lease.
"""

from __future__ import annotations

import msgspec
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.config import EngineConfig
from narwhal.core.connector import PrefillResult
from narwhal.core.handoff import DROP_REASONS, Handoff, reclaim_plan
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}
# no health check while a test runs: a stopped consumer stays placeable, as it is between
# two checks in production, and only the failed legs tell the router about it
QUIET = EngineConfig(health_interval_s=300.0)


def value(harness: Harness, name: str, **labels: str) -> float:
    return harness.router.metrics.registry.get_sample_value(name, labels) or 0.0


def reclaims(harness: Harness, engine: str) -> list[str]:
    return [
        e["request_id"] for e in harness.engines[engine].log if e["request_id"].endswith("-reclaim")
    ]


def decodes(harness: Harness, engine: str) -> list[str]:
    return [
        e["request_id"] for e in harness.engines[engine].log if e["request_id"].endswith("-decode")
    ]


def held(harness: Harness, engine: str = "p0") -> int:
    """Leases the producer still holds: KV blocks nobody read or freed."""
    return len(harness.engines[engine].store.leases)


async def settled(harness: Harness) -> None:
    with trio.fail_after(5):
        await harness.router.wait_drained()
        await harness.router.reclaimer.wait_idle()


async def test_a_stopped_consumers_orphan_is_reclaimed_on_another_consumer(
    nursery: trio.Nursery,
) -> None:
    # the outside report's fleet: 1 producer, 2 consumers, max_attempts = 1; both consumers
    # have served (each has moved KV from p0), then d0 stops: connections refused
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode", "d1": "decode"}, engine=QUIET
    )
    for _ in range(6):  # bounded: placement alternates the two consumers
        if all(decodes(harness, c) for c in ("d0", "d1")):
            break
        assert (await harness.post("/v1/completions", BODY)).status == 200
    assert all(decodes(harness, c) for c in ("d0", "d1"))
    harness.engines["d0"].stop()
    failed: list[str] = []
    for _ in range(6):
        reply = await harness.post("/v1/completions", BODY)
        if reply.status == 502:
            assert "cannot connect" in reply.json()["error"]["message"]
            failed.append(reply.headers["x-request-id"])
            break
        assert reply.status == 200
    assert failed, "no request met the stopped consumer"
    await settled(harness)
    (rid,) = failed
    assert reclaims(harness, "d1") == [f"{rid}-a1-reclaim"]  # not back to the stopped d0
    assert held(harness) == 0  # the producer freed the blocks at once, not at its lease
    assert value(harness, "narwhal_handoffs_total", fate="reclaimed") == 1
    assert value(harness, "narwhal_handoffs_total", fate="reclaim_failed") == 0
    await finish(harness)


async def _orphan(harness: Harness, failed_consumer: str) -> Handoff:
    """A real descriptor from p0 that a decode leg on ``failed_consumer`` did not take."""
    p0 = harness.router.fleet.by_id["p0"]
    result = await harness.router.client.prefill(
        p0.url, "/v1/completions", BODY, request_id="r-a1-prefill"
    )
    handoff = Handoff("r", 1, "p0", result, trio.current_time())
    handoff.failed_consumer = failed_consumer
    return handoff


async def test_a_reclaim_refused_at_connect_goes_once_more_to_another_consumer(
    nursery: trio.Nursery,
) -> None:
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
    harness = await start_fleet(nursery, roles, engine=QUIET)
    harness.engines["d0"].stop()  # first in fleet order: the reclaim's first choice
    harness.router.reclaimer.submit(await _orphan(harness, "d1"))
    await settled(harness)
    assert reclaims(harness, "d1") == []  # the consumer whose leg failed is never asked
    assert reclaims(harness, "d2") == ["r-a1-reclaim"]
    assert held(harness) == 0
    assert value(harness, "narwhal_reclaim_retries_total") == 1
    assert value(harness, "narwhal_handoffs_total", fate="reclaimed") == 1
    await finish(harness)


async def test_a_reclaim_is_tried_on_two_consumers_at_most(nursery: trio.Nursery) -> None:
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode", "d3": "decode"}
    harness = await start_fleet(nursery, roles, engine=QUIET)
    harness.engines["d0"].stop()
    harness.engines["d2"].stop()
    harness.router.reclaimer.submit(await _orphan(harness, "d1"))
    await settled(harness)
    # d0 refused the connection, d2 too: d3 could have taken it, but a reclaim is bounded
    assert reclaims(harness, "d3") == []
    assert value(harness, "narwhal_reclaim_retries_total") == 1
    assert value(harness, "narwhal_handoffs_total", fate="reclaim_failed") == 1
    assert held(harness) == 1  # left to the lease, and counted as such
    await finish(harness)


async def test_the_only_consumer_failed_so_the_reclaim_is_dropped_and_counted(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, engine=QUIET)
    harness.engines["d0"].faults.push(Fault(kind="status", status=503, leg="decode"))
    assert (await harness.post("/v1/completions", BODY)).status == 502
    await settled(harness)
    assert reclaims(harness, "d0") == []
    assert value(harness, "narwhal_reclaim_dropped_total", reason="no_consumer") == 1
    assert held(harness) == 1
    await finish(harness)


# ---- the pure choice ---------------------------------------------------------------------


class _Consumer(msgspec.Struct, frozen=True):
    id: str
    load: int


_IDS = ("p0", "d0", "d1", "d2", "d3")


@settings(deadline=None)
@given(
    consumers=st.lists(
        st.tuples(st.sampled_from(_IDS), st.integers(0, 3), st.booleans()),
        unique_by=lambda c: c[0],
    ),
    failed=st.none() | st.sampled_from(_IDS),
    tried=st.sets(st.sampled_from(_IDS), max_size=2),
    paired=st.sets(st.sampled_from(_IDS)),
    age=st.floats(0, 40),
    limit=st.floats(0, 40),
)
def test_the_reclaim_target_is_never_the_producer_nor_a_failed_consumer(
    consumers: list[tuple[str, int, bool]],
    failed: str | None,
    tried: set[str],
    paired: set[str],
    age: float,
    limit: float,
) -> None:
    result = PrefillResult("u", "/v1/completions", "r", "NixlConnector", msgspec.Raw(b"{}"))
    handoff = Handoff("r", 1, "p0", result, 0.0)
    handoff.failed_consumer = failed
    engines = [_Consumer(i, load) for i, load, _ in consumers]
    room = {i for i, _, free in consumers if free}
    plan = reclaim_plan(
        handoff,
        age,
        limit_s=limit,
        consumers=engines,
        has_room=lambda c: c.id in room,
        paired={("p0", c) for c in paired},
        tried=tried,
    )
    eligible = [c for c in engines if c.id not in {"p0", failed, *tried}]
    free = [c for c in eligible if c.id in room]
    if isinstance(plan, str):
        assert plan in DROP_REASONS
        assert age > limit or not free
        assert plan != "no_consumer" or not eligible
        return
    assert age <= limit
    assert plan in free  # never the producer, the failed consumer, nor one already tried
    # a consumer that already moved KV from the producer first, then the least loaded
    assert (plan.id not in paired, plan.load) == min((c.id not in paired, c.load) for c in free)
