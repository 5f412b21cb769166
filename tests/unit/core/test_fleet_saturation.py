"""When an engine is saturated for the admission queue (SPEC 4.5): its waiting queue as
predicted from its reports (what it showed waiting, plus this router's legs since, less the
room it had free: its learned capacity less what it ran), or without reports this router's
legs not yet started; and the room the fleet has in all."""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import EngineSpec, RecoveryConfig
from narwhal.core.engine_report import EngineReport
from narwhal.core.fleet import Fleet
from narwhal.core.flow import UNMETERED

INTERVAL = 1.0
LIMIT = 2
KV = 0.95


def _fleet(*roles: str) -> Fleet:
    specs = tuple(
        EngineSpec(f"e{i}", f"http://127.0.0.1:{9000 + i}", r) for i, r in enumerate(roles)
    )  # type: ignore[arg-type]
    return Fleet(specs, RecoveryConfig())


def _report(waiting: float, kv: float = 0.0, at: float = 0.0, running: float = 0) -> EngineReport:
    return EngineReport(at=at, running=running, waiting=waiting, kv_usage=kv)


async def test_legs_not_yet_started_fill_an_engine_and_free_it_as_they_start() -> None:
    fleet = _fleet("prefill", "decode")
    producer = fleet.by_id["e0"]
    changes: list[int] = []
    fleet.on_change = lambda: changes.append(producer.pending)
    async with fleet.reserve(producer, "prefill"):
        assert producer.saturation(0, INTERVAL, LIMIT, KV) is None
        async with fleet.reserve(producer, "prefill"):
            assert producer.saturation(0, INTERVAL, LIMIT, KV) == "waiting"
            assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 0
        assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 1
    assert producer.pending == 0
    assert changes == [1, 0]  # each leg's end told the queue


async def test_a_report_counts_our_legs_as_its_scrape_went_out_and_those_sent_since() -> None:
    fleet = _fleet("prefill", "decode")
    engine = fleet.by_id["e0"]
    engine.note_report(_report(waiting=1, running=2))  # full: it runs two at once
    async with fleet.reserve(engine, "prefill"), fleet.reserve(engine, "prefill"):
        mark = engine.scrape_mark()  # the scrape goes out now
        async with fleet.reserve(engine, "prefill"):  # ... and this leg is sent meanwhile
            engine.note_report(_report(waiting=1, running=2), mark)  # it counted two
            assert engine.since_report == 1
            assert engine.room(0, INTERVAL, 3, KV, "prefill") == (1, None)  # 3 - (1 + 1)
        assert engine.since_report == 0
        assert engine.room(0, INTERVAL, 3, KV, "prefill") == (2, None)
    # the two it ran have ended: their slots went to the one waiting, and one is free
    assert engine.room(0, INTERVAL, 3, KV, "prefill") == (4, None)  # 3 - (1 - 2 - 0)
    # without a usable report every leg not started counts again
    async with fleet.reserve(engine, "prefill"), fleet.reserve(engine, "prefill"):
        engine.note_report(None)
        assert engine.room(0, INTERVAL, LIMIT, KV, "prefill") == (0, "waiting")
    assert engine.capacity is None  # and what was learned of it is learned anew


async def test_a_decode_not_started_is_ours_to_count_whatever_a_lagging_report_says() -> None:
    fleet = _fleet("prefill", "decode")
    consumer = fleet.by_id["e1"]
    consumer.note_report(_report(waiting=1, running=1))  # it runs one at a time
    async with fleet.reserve(consumer, "decode"):
        # the engine has not shown it yet (its gauges trail): it is still ours to count
        consumer.note_report(_report(waiting=0, running=0), consumer.scrape_mark())
        assert consumer.room(0, INTERVAL, LIMIT, KV, "decode") == (2, None)  # 2 - (1 - 1)
        # once shown waiting, it is not counted twice; another router's request is
        consumer.note_report(_report(waiting=2, running=1), consumer.scrape_mark())
        assert consumer.room(0, INTERVAL, 3, KV, "decode") == (1, None)  # 3 - (1 other + 1)


def test_an_engine_of_unknown_capacity_takes_a_burst_until_it_shows_waiting() -> None:
    fleet = _fleet("prefill", "decode")
    producer = fleet.by_id["e0"]
    producer.note_report(_report(waiting=0, running=5))  # running, never full yet
    for _ in range(32):  # a burst: 32 legs sent since that report
        producer.inflight["prefill"] += 1
    assert producer.capacity is None
    assert producer.saturation(0, INTERVAL, LIMIT, KV) is None
    view = producer.saturation_view(0, INTERVAL, LIMIT, KV)
    assert (view["capacity"], view["free_room"], view["room"]) == (None, None, None)
    # its next report shows it full: it runs 8 at once, and 29 wait
    producer.note_report(_report(waiting=29, running=8), producer.scrape_mark())
    assert producer.capacity == 8
    assert producer.saturation(0, INTERVAL, LIMIT, KV) == "waiting"
    view = producer.saturation_view(0, INTERVAL, LIMIT, KV)
    assert (view["capacity"], view["free_room"], view["room"]) == (8, 0, 0)


def test_a_full_engine_takes_its_free_room_and_the_waiting_limit_no_more() -> None:
    fleet = _fleet("prefill", "decode")
    producer = fleet.by_id["e0"]
    producer.note_report(_report(waiting=3, running=4))
    producer.note_report(_report(waiting=0, running=1))  # 3 of its 4 free
    assert producer.room(0, INTERVAL, LIMIT, KV, "prefill") == (3 + LIMIT, None)
    producer.inflight["prefill"] += 3 + LIMIT
    assert producer.room(0, INTERVAL, LIMIT, KV, "prefill") == (0, "waiting")


async def test_a_decode_leaves_the_count_at_its_first_token() -> None:
    fleet = _fleet("prefill", "decode")
    consumer = fleet.by_id["e1"]
    reservation = fleet.reserve(consumer, "decode")
    async with reservation:
        assert consumer.pending == 1
        reservation.started()
        reservation.started()  # once only
        assert consumer.pending == 0
        assert consumer.inflight["decode"] == 1
    assert consumer.pending == 0


def test_kv_usage_saturates_a_consumer_only() -> None:
    fleet = _fleet("prefill", "decode")
    producer, consumer = fleet.by_id["e0"], fleet.by_id["e1"]
    for engine in (producer, consumer):
        engine.note_report(_report(waiting=0, kv=0.97))
    assert producer.saturation(0, INTERVAL, LIMIT, KV) is None
    assert consumer.saturation(0, INTERVAL, LIMIT, KV) == "kv_usage"
    assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 0  # no consumer has room


def test_a_stale_report_is_not_believed() -> None:
    fleet = _fleet("prefill", "decode")
    producer = fleet.by_id["e0"]
    producer.note_report(_report(waiting=5, at=0.0))
    assert producer.saturation(1.0, INTERVAL, LIMIT, KV) == "waiting"
    assert producer.saturation(10.0, INTERVAL, LIMIT, KV) is None  # 10 intervals old


def test_a_role_with_no_placeable_engine_is_not_saturation() -> None:
    fleet = _fleet("prefill", "decode")
    fleet.health_checked = True  # and nobody answered a check yet
    assert fleet.headroom(0, INTERVAL, LIMIT, KV) is None  # the request is answered 503


engines = st.tuples(st.none() | st.integers(1, 6), st.integers(0, 6), st.integers(0, 5))


@given(
    st.lists(engines, min_size=1, max_size=6),
    st.lists(engines, min_size=1, max_size=3),
    st.integers(1, 4),
)
def test_the_fleet_has_the_lesser_room_of_its_two_roles(
    producers: list[tuple[int | None, int, int]],
    consumers: list[tuple[int | None, int, int]],
    limit: int,
) -> None:
    """Each engine as (the capacity it showed when full, running, waiting) now."""
    fleet = _fleet(*(["prefill"] * len(producers)), *(["decode"] * len(consumers)))
    for i, (capacity, running, waiting) in enumerate([*producers, *consumers]):
        engine = fleet.by_id[f"e{i}"]
        if capacity is not None:
            engine.note_report(_report(waiting=1, running=capacity))
        engine.note_report(_report(waiting=waiting, running=running))  # nothing sent

    def room(capacity: int | None, running: int, waiting: int) -> int:
        if waiting > 0 and running > 0:
            capacity = max(capacity or 0, running)
        if capacity is None:
            return UNMETERED if waiting == 0 else max(0, limit - waiting)
        if running > capacity:
            capacity = running
        return max(0, limit - (waiting - (capacity - running)))

    rooms = [sum(room(*e) for e in role) for role in (producers, consumers)]
    assert fleet.headroom(0, INTERVAL, limit, KV) == min(rooms)


def test_a_request_between_its_prefill_and_its_decode_holds_a_consumer_s_room() -> None:
    fleet = _fleet("prefill", "prefill", "decode")
    consumer = fleet.by_id["e2"]
    changes: list[int] = []
    fleet.on_change = lambda: changes.append(fleet.decodes_coming)
    assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 2  # the one consumer's
    with fleet.claim_decode():
        assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 1
        with fleet.claim_decode() as claim:
            assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 0  # producers have room left
            reservation = fleet.reserve(consumer, "decode", claim)

            async def decode() -> None:
                async with reservation:  # the decode leg takes the claim's room over
                    assert (fleet.decodes_coming, consumer.decoding) == (1, 1)
                    assert fleet.headroom(0, INTERVAL, LIMIT, KV) == 0

            trio.run(decode)
    # one claim went to its decode, one ended without: that one told the queue
    assert fleet.decodes_coming == 0
    assert changes[-1] == 0


async def test_a_request_between_its_prefill_and_its_decode_holds_one_leg_of_a_consumer() -> None:
    """A claim is one decode leg's worth: of a consumer that runs four at once and runs
    none now, it takes one of the four, not the consumer's whole room."""
    fleet = _fleet("prefill", "decode")
    producer, consumer = fleet.by_id["e0"], fleet.by_id["e1"]
    producer.note_report(_report(waiting=0, running=0))  # not full yet: not metered
    consumer.note_report(_report(waiting=1, running=4))
    consumer.note_report(_report(waiting=0, running=0))
    assert fleet.headroom(0, INTERVAL, 1, KV, consumers_only=True) == 5  # 4 free + 1 waiting
    with fleet.claim_decode():
        assert fleet.headroom(0, INTERVAL, 1, KV, consumers_only=True) == 4
        assert fleet.headroom(0, INTERVAL, 1, KV) == 4
    # a consumer whose capacity is not known yet is not metered: a claim takes nothing
    fleet = _fleet("prefill", "decode")
    fleet.by_id["e1"].note_report(_report(waiting=0, running=0))
    with fleet.claim_decode(), fleet.claim_decode():
        assert fleet.headroom(0, INTERVAL, 1, KV, consumers_only=True) == UNMETERED - 2
