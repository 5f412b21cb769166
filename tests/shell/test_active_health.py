"""Honest readiness and active health (issue "deployable", item 2; contract 3 ``/ready``).

Every engine is checked (``GET /health``) every ``engine.health_interval_s``, jittered,
idle or not; an engine joins placement only after it answered, and one that stops
answering leaves it before a client pays for it: ``/ready`` is 503 until a producer and a
consumer are placeable, and a request then gets a 503 without any engine leg.
"""

from __future__ import annotations

import itertools
from typing import Any

import trio

from narwhal.core.config import EngineConfig
from narwhal.core.engine_state import HEALTH_FAILS_TO_LEAVE
from tests.support.fleet import MODEL, finish, start_fleet
from tests.support.memory_fleet import memory_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


async def test_an_engine_that_stops_answering_leaves_placement_before_a_client_pays(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    router, d0 = harness.router, harness.engines["d0"]
    assert (await harness.get("/ready")).status == 200
    assert (await harness.post("/v1/completions", BODY)).status == 200

    d0.stop()  # the consumer dies while nobody is asking it anything
    for _ in range(HEALTH_FAILS_TO_LEAVE):
        await router.health.check_all()
    assert (await harness.get("/ready")).status == 503
    prefills_before = harness.engines["p0"].counters["prefill"]
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 503
    assert "no placeable consumer" in reply.json()["error"]["message"]
    # refused at admission: no prefill was computed for a decode that could not happen
    assert harness.engines["p0"].counters["prefill"] == prefills_before
    view = (await harness.get("/narwhal/engines")).json()
    d0_view = next(e for e in view["engines"] if e["id"] == "d0")
    assert (d0_view["up"], d0_view["health_failures"]) == (False, HEALTH_FAILS_TO_LEAVE)
    await router.events.wait_event("left", "d0")

    await nursery.start(d0.serve)  # back on the same port
    await router.health.check_all()
    await router.events.wait_event("joined", "d0")
    assert (await harness.get("/ready")).status == 200
    assert (await harness.post("/v1/completions", BODY)).status == 200
    await finish(harness)


async def test_one_lost_check_is_not_enough_to_leave(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    d0 = harness.engines["d0"]
    d0.stop()
    await harness.router.health.check_all()  # one hiccup
    await nursery.start(d0.serve)
    await harness.router.health.check_all()
    assert harness.router.fleet.by_id["d0"].up
    assert (await harness.get("/ready")).status == 200
    await finish(harness)


async def test_every_engine_is_checked_on_its_interval_idle_or_not(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, engine=EngineConfig(health_interval_s=5.0))
    router = fleet.router
    engine = router.fleet.by_id["d0"]
    checked: list[float] = []
    start = trio.current_time()
    for _ in range(600):  # a minute of no traffic at all, looked at every 0.1 s
        await trio.sleep(0.1)
        if engine.checked_at is not None and engine.checked_at not in checked:
            checked.append(engine.checked_at)
    gaps = [b - a for a, b in itertools.pairwise(checked)]
    assert len(checked) >= 60 / 6  # every 4 to 6 s (jittered), with nobody asking
    assert all(4.0 <= gap <= 6.0 + 0.01 for gap in gaps), gaps
    assert checked[0] - start <= 6.0 + 0.1
    assert len(set(round(g, 6) for g in gaps)) > 1  # jittered: routers do not beat in step


async def test_a_router_whose_engines_never_answered_is_not_ready(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    for engine in harness.engines.values():
        engine.stop()
    router = harness.router
    for engine_state in router.fleet.engines:  # a router starting with its engines down
        engine_state.up = False
    assert not router.fleet.ready(trio.current_time())
    assert (await harness.get("/ready")).status == 503
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status == 503
    await finish(harness)
