"""Placement from engine truth (contract 4.4): each engine's /metrics scraped off the request
path, shown to the operator, and never a reason to eject an engine."""

from __future__ import annotations

from functools import partial

import httpcore
import msgspec
import pytest
import trio

from narwhal.core.config import EngineSpec, PlacementConfig
from tests.support.fleet import MODEL, finish, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


async def test_each_engines_queue_is_scraped_and_shown(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    router = harness.router
    for engine in router.fleet.engines:
        assert await router.scraper.scrape(engine)
    view = (await harness.get("/narwhal/engines")).json()
    for engine in view["engines"]:
        report = engine["report"]
        assert (report["running"], report["waiting"], report["stale"]) == (0, 0, False)
        assert engine["scrape_failures"] == 0
    text = (await harness.get("/metrics")).body.decode()
    assert 'narwhal_engine_requests{engine="p0",state="waiting"} 0.0' in text
    assert 'narwhal_engine_kv_cache_usage_ratio{engine="d0"} 0.0' in text
    assert (await harness.post("/v1/completions", BODY)).status == 200
    text = (await harness.get("/metrics")).body.decode()
    assert 'narwhal_placement_decisions_total{leg="prefill",reason="only"} 1.0' in text
    await finish(harness)


async def test_a_failed_scrape_never_moves_the_breaker(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    router, d0 = harness.router, harness.router.fleet.by_id["d0"]
    harness.engines["d0"].stop()
    assert not await router.scraper.scrape(d0)
    assert not await router.scraper.scrape(d0)
    assert d0.scrape_failures >= 2  # the background loop may have tried too
    assert (d0.breaker.streak, d0.breaker.healthy(trio.current_time()), d0.up) == (0, True, True)
    text = (await harness.get("/metrics")).body.decode()
    assert f'narwhal_engine_scrape_failures_total{{engine="d0"}} {d0.scrape_failures}.0' in text
    assert 'narwhal_engine_leg_failures_total{class="unreachable",engine="d0"} 0.0' in text
    await finish(harness)


async def _garbage_metrics(stream: trio.SocketStream) -> None:
    """An endpoint that answers every request 200 with a page that is not metrics."""
    async with stream:
        await stream.receive_some(65536)
        page = b"<html>login required</html>"
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n%s"
            % (len(page), page)
        )


async def test_an_engine_that_answers_garbage_is_weighed_by_our_legs_alone(
    nursery: trio.Nursery,
) -> None:
    listeners = await nursery.start(partial(trio.serve_tcp, _garbage_metrics, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    config = harness.router.config
    garbage = EngineSpec("x0", f"http://127.0.0.1:{port}", "decode")
    harness.router.reload(msgspec.structs.replace(config, engines=(*config.engines, garbage)))
    x0 = harness.router.fleet.by_id["x0"]
    assert not await harness.router.scraper.scrape(x0)
    assert (x0.report, x0.breaker.streak) == (None, 0)
    assert x0.scrape_failures >= 1  # the background loop may have tried too
    await finish(harness)


async def _tenant(url: str) -> None:
    """Another tenant's request straight to an engine (it waits until cancelled)."""
    async with httpcore.AsyncConnectionPool() as http:
        body = msgspec.json.encode({"model": MODEL, "prompt": "x " * 500, "max_tokens": 1})
        await http.request("POST", url + "/v1/completions", content=body)


@pytest.mark.parametrize("affinity", [False, True])
async def test_an_engine_queued_by_others_gets_no_new_prefills(
    nursery: trio.Nursery, affinity: bool
) -> None:
    """Load this router cannot see in its own legs (another router, a direct client) is in
    the engine's /metrics: placement sends new work to the other producer."""
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "p1": "prefill", "d0": "decode"},
        engine_config={"slots": 1, "prefill_ms_per_token": 100.0},  # 50 s per tenant
        placement=PlacementConfig(prefix_affinity=affinity),
    )
    p0, router = harness.engines["p0"], harness.router
    async with trio.open_nursery() as tenants:  # held until the end
        for _ in range(6):
            tenants.start_soon(_tenant, p0.url)
        with trio.fail_after(10):
            await p0.wait_queued(5)  # one runs, five queue
        assert await router.scraper.scrape(router.fleet.by_id["p0"])
        assert await router.scraper.scrape(router.fleet.by_id["p1"])
        assert harness.engines["p1"].counters["prefill"] == 0
        for i in range(4):  # one word: 0.1 s of prefill on p1
            body = {"model": MODEL, "prompt": f"q{i}", "max_tokens": 2}
            assert (await harness.post("/v1/completions", body)).status == 200
        assert harness.engines["p1"].counters["prefill"] == 4
        reasons = {
            line.split("reason=")[1].split("}")[0]
            for line in (await harness.get("/metrics")).body.decode().splitlines()
            if line.startswith('narwhal_placement_decisions_total{leg="prefill"')
            and not line.endswith(" 0.0")
        }
        # p0's queue saturates it (5 waiting): with or without affinity, the one with room
        assert reasons == {'"room"'}
        tenants.cancel_scope.cancel()
    await finish(harness)
