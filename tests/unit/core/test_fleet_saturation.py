"""When an engine is saturated for the admission queue (contract 4.5): its scraped waiting
queue plus this router's legs sent since that scrape and not yet started; and the room the
fleet has in all."""

from __future__ import annotations

import trio
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import EngineSpec, RecoveryConfig
from narwhal.core.engine_report import EngineReport
from narwhal.core.engine_state import EngineState
from narwhal.core.fleet import Fleet

INTERVAL = 1.0
LIMIT = 2
KV = 0.95


def _fleet(*roles: str) -> Fleet:
    specs = tuple(
        EngineSpec(f"e{i}", f"http://127.0.0.1:{9000 + i}", r) for i, r in enumerate(roles)
    )  # type: ignore[arg-type]
    return Fleet(specs, RecoveryConfig())


def _report(waiting: float, kv: float = 0.0, at: float = 0.0) -> EngineReport:
    return EngineReport(at=at, running=0, waiting=waiting, kv_usage=kv)


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


async def test_a_scrape_replaces_the_prefills_it_saw_but_not_those_sent_while_it_travelled() -> (
    None
):
    fleet = _fleet("prefill", "decode")
    engine = fleet.by_id["e0"]
    async with fleet.reserve(engine, "prefill"), fleet.reserve(engine, "prefill"):
        assert engine.pending == 2
        mark = engine.scrape_mark()  # the scrape goes out now
        async with fleet.reserve(engine, "prefill"):  # ... and this leg is sent meanwhile
            engine.note_report(_report(waiting=1), mark)  # it counted the first two
            assert engine.pending == 1
            assert engine.room(0, INTERVAL, 3, KV, "prefill") == (1, None)  # 3 - (1 + 1)
        assert engine.pending == 0
    # without a usable report every leg not started counts again
    async with fleet.reserve(engine, "prefill"), fleet.reserve(engine, "prefill"):
        engine.note_report(None)
        assert engine.room(0, INTERVAL, LIMIT, KV, "prefill") == (0, "waiting")


async def test_a_decode_counts_until_its_first_token_whatever_a_lagging_report_says() -> None:
    fleet = _fleet("prefill", "decode")
    consumer = fleet.by_id["e1"]
    async with fleet.reserve(consumer, "decode"):
        # the engine has not shown it yet (its gauges trail): it is still ours to count
        consumer.note_report(_report(waiting=0), consumer.scrape_mark())
        assert consumer.room(0, INTERVAL, LIMIT, KV, "decode") == (1, None)
        # once shown, it is not counted twice, and another router's request is
        consumer.note_report(_report(waiting=2), consumer.scrape_mark())
        assert consumer.room(0, INTERVAL, 3, KV, "decode") == (1, None)  # 3 - (1 other + 1)


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


@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=6),
    st.lists(st.integers(0, 5), min_size=1, max_size=3),
    st.integers(1, 4),
)
def test_the_fleet_has_the_lesser_room_of_its_two_roles(
    producers: list[int], consumers: list[int], limit: int
) -> None:
    fleet = _fleet(*(["prefill"] * len(producers)), *(["decode"] * len(consumers)))
    for i, w in enumerate([*producers, *consumers]):
        fleet.by_id[f"e{i}"].note_report(_report(waiting=w))  # nothing sent: mark 0
    room = [sum(max(0, limit - w) for w in ws) for ws in (producers, consumers)]
    assert fleet.headroom(0, INTERVAL, limit, KV) == min(room)


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


def test_an_engine_with_free_room_takes_a_burst_once_its_reports_showed_its_capacity() -> None:
    """Its reports showed it running 8 at once: it runs at least 8. At a report of 3
    running and none waiting, 5 legs sent since start there at once: the queue meters only
    what it would queue, so it has room for 5 + the waiting limit."""
    state = EngineState(EngineSpec("d0", "http://h:1", "decode"), RecoveryConfig())
    state.note_report(EngineReport(at=0.0, running=8, waiting=3, kv_usage=0.1))
    assert state.capacity == 8
    state.note_report(EngineReport(at=1.0, running=3, waiting=0, kv_usage=0.1))
    room, why = state.room(1.0, 1.0, 2, 0.95, "decode")
    assert (room, why) == (5 + 2, None)
    assert state.queued(1.0, 1.0) == 0  # one more starts at once
    state.note_report(EngineReport(at=2.0, running=8, waiting=0, kv_usage=0.1))
    assert state.queued(2.0, 1.0) == 1  # full: the next starts when one of the 8 ends


async def test_a_decode_that_started_since_the_scrape_takes_the_slot_it_showed_free() -> None:
    """Two slots (it ran 2 at once), its last scrape ran 1: one slot free, and the waiting
    limit (1) beyond it. A decode sent since takes the free slot; once it runs (its first
    token), the stale scrape still shows the slot free, and it must not be counted twice:
    a real consumer with --max-num-seqs 2 otherwise queued 2 under a limit of 1."""
    specs = (EngineSpec("p0", "http://h:1", "prefill"), EngineSpec("d0", "http://h:2", "decode"))
    fleet = Fleet(specs, RecoveryConfig())
    d0 = fleet.by_id["d0"]
    d0.note_report(EngineReport(at=0.0, running=2, waiting=0, kv_usage=0.0), d0.scrape_mark())
    d0.note_report(EngineReport(at=1.0, running=1, waiting=0, kv_usage=0.0), d0.scrape_mark())

    def room() -> int:
        return d0.room(1.0, 1.0, 1, 0.95, "decode")[0]

    assert room() == 2
    decode = fleet.reserve(d0, "decode")
    await decode.__aenter__()
    assert room() == 1  # sent, not started: it waits for the free slot, or in the queue
    decode.started()
    assert room() == 1  # running in the slot the scrape showed free
    await decode.__aexit__(None, None, None)


async def test_streams_a_consumer_runs_at_once_raise_its_capacity_before_a_report_does() -> None:
    """A fresh router's consumer showed 1 running; it then runs 3 of our streams at once
    (each had its first token): it runs at least 3, known at once rather than a scrape
    later, and its free room is counted from that."""
    specs = (EngineSpec("p0", "http://h:1", "prefill"), EngineSpec("d0", "http://h:2", "decode"))
    fleet = Fleet(specs, RecoveryConfig())
    d0 = fleet.by_id["d0"]
    d0.note_report(EngineReport(at=0.0, running=1, waiting=0, kv_usage=0.0), d0.scrape_mark())
    assert d0.capacity == 1
    streams = [fleet.reserve(d0, "decode") for _ in range(3)]
    for stream in streams:
        await stream.__aenter__()
        stream.started()
    assert d0.capacity == 3
    mark = d0.scrape_mark()
    for stream in streams:
        await stream.__aexit__(None, None, None)
    d0.note_report(EngineReport(at=1.0, running=0, waiting=0, kv_usage=0.0), mark)
    assert d0.capacity == 3  # the report came after they ended: what they ran is kept
