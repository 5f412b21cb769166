"""The admission queue's shell (contract 4.5, invariant 11), on trio's MockClock over in-memory
streams: who goes on when room frees, who leaves and when, and what a queued request holds.

The fleet is one producer whose prefill takes a virtual second per prompt word and one
consumer; nothing scrapes, so an engine's waiting queue is this router's legs it has not
started, and with ``engine_waiting_limit = 1`` the producer takes one prefill at a time:
every other request waits in the router, and the order the producer sees them in is the
queue's.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from narwhal.core.config import AdmissionConfig, EngineConfig, PlacementConfig, ServingConfig
from narwhal.core.flow import Priority
from narwhal.core.flow_class import Flow
from narwhal.core.requests import parse_request
from narwhal.fake_engine.faults import Fault
from narwhal.router.admission import Admission
from tests.support.fleet import MODEL, fleet_config
from tests.support.memory_fleet import MemoryFleet, RecordingSink, memory_fleet

NO_SCRAPES = PlacementConfig(metrics_interval_s=0.0)
ONE_AT_A_TIME = AdmissionConfig(engine_waiting_limit=1)
PREFILL_S = 1.0  # a one-word prompt's prefill


async def _fleet(
    nursery: trio.Nursery, admission: AdmissionConfig = ONE_AT_A_TIME, **sections: Any
) -> MemoryFleet:
    sections.setdefault("serving", ServingConfig(graceful_timeout_s=5.0))
    return await memory_fleet(
        nursery, prefill_delay=PREFILL_S, placement=NO_SCRAPES, admission=admission, **sections
    )


class Clients:
    """Requests sent straight to ``Router.handle``, each with its id, class and tenant."""

    def __init__(self, fleet: MemoryFleet, nursery: trio.Nursery) -> None:
        self.fleet = fleet
        self.nursery = nursery
        self.sinks: dict[str, RecordingSink] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.ended: dict[str, trio.Event] = {}

    async def send(
        self, rid: str, cls: Priority = Priority.DEFAULT, tenant: str = "t", *, stream: bool = False
    ) -> None:
        """Start the request and return once it is queued or on its engine."""
        body = {"model": MODEL, "prompt": "word", "max_tokens": 2, "stream": stream}
        req = parse_request(msgspec.json.encode(body), endpoint="/v1/completions", model=MODEL)
        sink = self.sinks[rid] = RecordingSink()
        scope = self.scopes[rid] = trio.CancelScope()
        ended = self.ended[rid] = trio.Event()

        async def run() -> None:
            with scope:
                await self.fleet.router.handle(
                    req, rid, sink, trio.sleep_forever, flow=Flow(cls, tenant)
                )
            ended.set()

        self.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()

    async def hold_the_producer(self) -> None:
        """A request ("held") whose prefill hangs: the producer is full until it ends."""
        self.fleet.producer.faults.push(Fault(kind="hang", leg="prefill"))
        await self.send("held")

    async def wait_ended(self, rid: str) -> None:
        with trio.fail_after(60):
            await self.ended[rid].wait()

    def status(self, rid: str) -> int:
        what, data = self.sinks[rid].events[-1][1:]
        return data[0] if what == "json" else 200

    def line(self, rid: str) -> Any:
        return next(line for line in self.fleet.router.journal.lines if line.request_id == rid)


def prefill_order(fleet: MemoryFleet) -> list[str]:
    """The client request ids in the order their prefill legs reached the producer."""
    return [
        entry["request_id"].split("-a")[0]
        for entry in fleet.producer.log
        if entry["request_id"].endswith("-prefill")
    ]


async def drained(fleet: MemoryFleet) -> None:
    with trio.fail_after(120):
        await fleet.router.wait_drained()


async def test_room_goes_to_the_highest_class_first(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery)
    clients = Clients(fleet, nursery)
    await clients.send("first", Priority.BATCH)
    for rid, cls in (("b", Priority.BATCH), ("d", Priority.DEFAULT), ("i", Priority.INTERACTIVE)):
        await clients.send(rid, cls)
    assert fleet.router.admission.queued() == 3
    await drained(fleet)
    assert prefill_order(fleet) == ["first", "i", "d", "b"]
    # each waited for the prefills before it, and its wait is in its journal line
    waits = {rid: clients.line(rid).queued_s for rid in ("first", "i", "d", "b")}
    assert waits == {"first": 0.0, "i": 1.0, "d": 2.0, "b": 3.0}
    assert clients.line("i").prefill_s == pytest.approx(2.0)  # the wait is part of it
    assert {clients.line(rid).cls for rid in ("i", "d", "b")} == {"interactive", "default", "batch"}
    assert all(clients.status(rid) == 200 for rid in clients.sinks)


async def test_tenants_take_turns_within_a_class(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery)
    clients = Clients(fleet, nursery)
    await clients.send("first")
    for n in range(4):
        await clients.send(f"big{n}", tenant="big")
    await clients.send("small0", tenant="small")
    await clients.send("small1", tenant="small")
    await drained(fleet)
    # ten times the traffic buys no more than every other turn while both wait
    assert prefill_order(fleet) == [
        "first", "big0", "small0", "big1", "small1", "big2", "big3"
    ]  # fmt: skip


async def test_a_queued_request_holds_no_engine_leg_and_no_connection(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery)
    clients = Clients(fleet, nursery)
    await clients.hold_the_producer()
    for n in range(5):
        await clients.send(f"q{n}")
    router = fleet.router
    assert router.admission.queued() == 5
    assert router.fleet.reserved() == 1  # the held prefill, nothing for the queued five
    assert sum(active for _, active in router.client.connections().values()) == 1
    assert router.admission.dispatched == 1  # queued requests take no max_inflight slot
    assert len(fleet.producer.log) == 1


async def test_a_request_leaves_the_queue_after_max_queue_wait_s(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery, AdmissionConfig(engine_waiting_limit=1, max_queue_wait_s=2.0))
    clients = Clients(fleet, nursery)
    await clients.hold_the_producer()
    start = trio.current_time()
    await clients.send("waits")
    await clients.wait_ended("waits")
    when, status, message = clients.sinks["waits"].error
    assert (when - start, status, message) == (2.0, 429, "no capacity within 2s")
    line = clients.line("waits")
    assert (line.outcome, line.queued_s, line.attempts) == ("rejected", 2.0, [])


async def test_a_request_leaves_when_its_deadline_could_not_cover_a_first_token(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    serving = ServingConfig(request_timeout_s=5.0, prefill_timeout_s=5.0, graceful_timeout_s=1)
    engine = EngineConfig(first_token_timeout_s=2.0)
    fleet = await _fleet(nursery, serving=serving, engine=engine)
    clients = Clients(fleet, nursery)
    await clients.hold_the_producer()
    await clients.send("waits")
    await clients.wait_ended("waits")
    when, status, message = clients.sinks["waits"].error
    # the deadline (5 s) less the first token's budget (2 s): no point sending it later
    assert (when, status, message) == (3.0, 429, "no capacity within 3s")


async def test_a_client_that_leaves_while_queued_is_gone_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery)
    clients = Clients(fleet, nursery)
    await clients.send("first")
    await clients.send("leaves")
    await clients.send("stays")
    clients.scopes["leaves"].cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert fleet.router.admission.queued() == 1
    assert clients.line("leaves").outcome == "cancelled"
    assert trio.current_time() == 0.0  # at once
    await drained(fleet)
    assert prefill_order(fleet) == ["first", "stays"]
    shed = fleet.router.metrics.queue_shed.labels("default", "cancelled", MODEL)._value.get()
    assert shed == 1


async def test_draining_answers_queued_requests_503_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery)
    clients = Clients(fleet, nursery)
    await clients.send("running")
    await clients.send("queued", Priority.INTERACTIVE)
    assert fleet.router.admission.queued() == 1
    fleet.router.begin_drain()
    await clients.wait_ended("queued")
    when, status, message = clients.sinks["queued"].error
    assert (when, status) == (0.0, 503)  # at once, not after the grace (5 s)
    assert message == "the router is shutting down"
    assert clients.line("queued").outcome == "rejected"
    await drained(fleet)
    assert clients.status("running") == 200  # the one that started finishes within the grace
    assert prefill_order(fleet) == ["running"]


async def test_a_full_queue_sheds_the_newest_of_a_lower_class(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery, AdmissionConfig(engine_waiting_limit=1, max_queued=2))
    clients = Clients(fleet, nursery)
    await clients.send("first")
    await clients.send("batch-old", Priority.BATCH)
    await clients.send("batch-new", Priority.BATCH)
    await clients.send("batch-late", Priority.BATCH)  # full, nothing lower: refused
    assert clients.sinks["batch-late"].error[1:] == (429, "queue full")
    await clients.send("urgent", Priority.INTERACTIVE)  # full: the newest batch makes room
    assert clients.sinks["batch-new"].error[1:] == (429, "queue full")
    assert trio.current_time() == 0.0
    await drained(fleet)
    assert prefill_order(fleet) == ["first", "urgent", "batch-old"]


async def test_max_inflight_bounds_dispatched_requests_and_the_rest_wait(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    roomy = AdmissionConfig(engine_waiting_limit=100)
    serving = ServingConfig(max_inflight=1, graceful_timeout_s=1.0)
    fleet = await _fleet(nursery, roomy, serving=serving)
    clients = Clients(fleet, nursery)
    for n in range(3):
        await clients.send(f"r{n}")
    assert fleet.router.admission.queued() == 2  # waiting, not refused
    await drained(fleet)
    assert [clients.status(f"r{n}") for n in range(3)] == [200, 200, 200]
    assert [clients.line(f"r{n}").queued_s for n in range(3)] == [0.0, 1.0, 2.0]


async def test_a_decode_that_has_started_leaves_room_on_its_consumer(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """A long stream counts as waiting on its consumer only until its first token."""
    fleet = await memory_fleet(nursery, itl_s=1.0, placement=NO_SCRAPES, admission=ONE_AT_A_TIME)
    clients = Clients(fleet, nursery)
    await clients.send("long", stream=True)  # two tokens a virtual second apart
    await trio.sleep(PREFILL_S + 0.5)  # virtual: its prefill is done, its first token out
    assert clients.sinks["long"].committed
    await clients.send("next", stream=True)
    assert fleet.router.admission.queued() == 0  # went on while "long" still streams
    await drained(fleet)


async def test_reservations_are_held_during_the_legs(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Each leg holds its engine from its placement to its end: the producer while it
    prefills, the consumer while it decodes."""
    fleet = await memory_fleet(nursery, prefill_delay=PREFILL_S, itl_s=1.0, placement=NO_SCRAPES)
    producer, consumer = fleet.router.fleet.engines
    clients = Clients(fleet, nursery)
    await clients.send("r", stream=True)  # its prefill takes a virtual second
    assert (producer.inflight, consumer.inflight) == (
        {"prefill": 1, "decode": 0},
        {"prefill": 0, "decode": 0},
    )
    await trio.sleep(PREFILL_S + 0.5)  # virtual: its prefill is done, its first token out
    assert clients.sinks["r"].committed
    assert (producer.inflight, consumer.inflight) == (
        {"prefill": 0, "decode": 0},
        {"prefill": 0, "decode": 1},
    )
    await drained(fleet)
    assert clients.status("r") == 200
    assert consumer.inflight == {"prefill": 0, "decode": 0}


async def test_without_the_queue_every_request_goes_on_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _fleet(nursery, AdmissionConfig(queue=False, engine_waiting_limit=1))
    clients = Clients(fleet, nursery)
    for n in range(4):
        await clients.send(f"r{n}", Priority.BATCH)
    assert len(fleet.producer.log) == 4  # all on the engine, whose own queue holds them
    await drained(fleet)
    assert all(clients.line(f"r{n}").queued_s == 0.0 for n in range(4))


def test_workers_share_max_queued_as_they_share_max_inflight() -> None:
    """``--workers N`` behave as one router: together they queue no more than max_queued."""
    config = fleet_config(
        {"p0": ("http://127.0.0.1:1", "prefill")}, admission=AdmissionConfig(max_queued=3)
    )
    shares = []
    for index in range(2):
        admission = Admission()
        admission.configure(config)
        admission.worker_index, admission.worker_count = index, 2
        shares.append(admission.queue_limit())
        assert admission.view(config.serving)["max_queued"] == {
            "router": 3,
            "this_worker": shares[-1],
        }
    assert shares == [2, 1]
