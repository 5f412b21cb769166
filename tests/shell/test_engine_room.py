"""Saturation from the engines' own reports (SPEC 4.5), on trio's MockClock over in-memory
streams: the router scrapes its fake engines' ``/metrics`` as ``narwhal serve`` does, learns
how many requests each runs at once from the reports that show it full, and the admission
queue holds only what the engines would queue. A one-word prompt's prefill on the producer
takes ``PREFILL_S`` virtual seconds; a consumer computes a prompt at once."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from narwhal.core.config import AdmissionConfig, PlacementConfig, ServingConfig
from tests.support.clients import Clients, drained, prefill_order
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, memory_fleet

INTERVAL = 1.0
SCRAPED = PlacementConfig(metrics_interval_s=INTERVAL)
PREFILL_S = 10.0
SERVING = ServingConfig(graceful_timeout_s=5.0, prefill_timeout_s=200.0, request_timeout_s=300.0)


async def _fleet(
    nursery: trio.Nursery,
    limit: int,
    placement: PlacementConfig = SCRAPED,
    **fields: Any,
) -> MemoryFleet:
    producer = {"prefill_delay_per_token_s": PREFILL_S, **fields.pop("producer_fields", {})}
    fleet = await memory_fleet(
        nursery,
        scrape=True,
        producer_fields=producer,
        placement=placement,
        admission=AdmissionConfig(engine_waiting_limit=limit, max_queue_wait_s=200.0),
        serving=SERVING,
        **fields,
    )
    await trio.testing.wait_all_tasks_blocked()  # the first scrapes are in
    assert all(e.report is not None for e in fleet.router.fleet.engines)
    return fleet


def _body(words: int, **more: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": " ".join(["word"] * words), "max_tokens": 2, **more}


async def test_a_burst_into_engines_with_room_goes_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Engines that report what they run and never a queue: 32 requests at once all reach
    the producer at once, none waits in the router (the queue's old estimate held all but
    two per engine)."""
    fleet = await _fleet(nursery, limit=2)
    clients = Clients(fleet, nursery)
    for n in range(32):
        await clients.send(f"r{n}")
        assert fleet.router.admission.queued() == 0
    assert len(prefill_order(fleet)) == 32
    assert trio.current_time() == 0.0
    await drained(fleet)
    assert all(clients.status(f"r{n}") == 200 for n in range(32))
    assert all(clients.line(f"r{n}").queued_s == 0.0 for n in range(32))
    view = fleet.router.fleet.by_id["p0"].saturation_view(trio.current_time(), INTERVAL, 2, 0.95)
    assert (view["capacity"], view["room"], view["saturated"]) == (None, None, None)


async def test_a_saturated_engine_still_meters(nursery: trio.Nursery, autojump_clock: Any) -> None:
    """A producer that runs two prefills at once: the first burst teaches the router that
    (its report shows two running and two waiting); from then on what it has no room for
    waits in the router, and the producer's own queue stays within the limit."""
    fleet = await _fleet(nursery, limit=1, producer_fields={"slots": 2})
    clients = Clients(fleet, nursery)
    for n in range(4):  # not full yet, as far as anything showed: they all go
        await clients.send(f"first{n}")
    assert fleet.router.admission.queued() == 0
    await trio.sleep(INTERVAL * 1.5)  # virtual: a scrape shows it full
    producer = fleet.router.fleet.by_id["p0"]
    assert producer.capacity == 2
    assert producer.saturation(trio.current_time(), INTERVAL, 1, 0.95) == "waiting"
    # what an operator reads (/narwhal/engines): full, and why
    view = msgspec.json.decode(fleet.router.engines_view())
    p0 = next(e for e in view["engines"] if e["id"] == "p0")["saturation"]
    assert (p0["saturated"], p0["capacity"], p0["free_room"], p0["room"]) == ("waiting", 2, 0, 0)
    for n in range(4):
        await clients.send(f"then{n}")
    assert fleet.router.admission.queued() == 4
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:  # each virtual tenth, once the first prefills ended
            await trio.sleep(0.1)
            if trio.current_time() > PREFILL_S + 0.05:
                peak = max(peak, fleet.producer.waiting)

    watching = trio.CancelScope()
    nursery.start_soon(_run_in, watching, watch)
    await drained(fleet)
    watching.cancel()
    assert peak == 1  # filled to the limit, never past it
    assert [clients.status(rid) for rid in clients.sinks] == [200] * 8
    assert sorted(prefill_order(fleet)[4:]) == [f"then{n}" for n in range(4)]
    assert all(clients.line(f"then{n}").queued_s > 0 for n in range(4))


async def _run_in(scope: trio.CancelScope, fn: Any) -> None:
    with scope:
        await fn()


BUSY = PlacementConfig(metrics_interval_s=INTERVAL, local_prefill_when_busy=True)


async def _full_producer(nursery: trio.Nursery) -> tuple[MemoryFleet, Clients]:
    """The smallest fleet: one producer that runs one prefill at a time, one consumer,
    ``engine_waiting_limit = 1``. The producer runs a long prefill with a second request
    queued behind it, as its last report shows."""
    fleet = await _fleet(nursery, limit=1, placement=BUSY, producer_fields={"slots": 1})
    clients = Clients(fleet, nursery)
    await clients.send("running", body=_body(1))
    await clients.send("behind", body=_body(1))
    assert (fleet.producer.running, fleet.producer.waiting) == (2, 1)
    await trio.sleep(INTERVAL * 1.5)  # virtual: a scrape shows it
    now = trio.current_time()
    assert fleet.router.fleet.saturated("prefill", now, INTERVAL, 1, 0.95)
    return fleet, clients


async def test_a_long_prompt_goes_to_the_idle_consumer_while_the_one_producer_is_full(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Decode first (SPEC 4.4, ``local_prefill_when_busy``): the request in prefill and
    the one behind it hold one decode leg each of the consumer, not all its room."""
    fleet, clients = await _full_producer(nursery)
    await clients.send("long", body=_body(40, stream=True))
    assert fleet.router.admission.queued() == 0
    await clients.wait_ended("long")
    line = clients.line("long")
    assert (line.outcome, line.queued_s) == ("completed", 0.0)
    assert line.attempts[0].local
    assert prefill_order(fleet) == ["running", "behind"]  # it never went to the producer
    await drained(fleet)


async def test_a_request_its_consumer_serves_alone_is_not_held_behind_one_that_needs_a_producer(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet, clients = await _full_producer(nursery)
    # an echo needs the producer's prompt side: it waits for the producer
    await clients.send("echo", body=_body(1, echo=True))
    assert fleet.router.admission.queued() == 1
    await clients.send("local", body=_body(40, stream=True))
    await clients.wait_ended("local")
    line = clients.line("local")
    assert (line.outcome, line.queued_s) == ("completed", 0.0)
    assert line.attempts[0].local
    assert fleet.router.admission.queued() == 1  # the echo kept its place, and waits on
    await drained(fleet)
    assert clients.status("echo") == 200
    assert prefill_order(fleet) == ["running", "behind", "echo"]
