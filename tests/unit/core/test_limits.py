"""Admission limits (contract 3, 4.5), sans IO: which fault refuses a request at arrival,
each worker's share of the router's limits, and whether one more request may go on."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import ConfigError, FleetConfig, ServingConfig
from narwhal.core.faults import Maintenance, Overloaded, Phase, ShuttingDown
from narwhal.core.limits import (
    Limits,
    check_workers,
    dispatch_by,
    dispatchable,
    inflight_share,
    refusal,
)

counts = st.integers(min_value=0, max_value=200)


@pytest.mark.parametrize("count", range(1, 9))
def test_the_shares_sum_to_max_inflight_and_each_is_at_least_one(count: int) -> None:
    for total in range(count, 40):
        shares = [inflight_share(total, index, count) for index in range(count)]
        assert sum(shares) == total
        assert min(shares) >= 1
        assert max(shares) - min(shares) <= 1


@given(st.integers(min_value=1, max_value=10_000), st.integers(min_value=1, max_value=64))
def test_the_first_workers_take_the_remainder_one_each(total: int, count: int) -> None:
    shares = [inflight_share(total, index, count) for index in range(count)]
    assert sum(shares) == total
    assert shares == sorted(shares, reverse=True)
    assert shares.count(total // count + 1) == total % count


def test_a_fleet_file_that_cannot_be_split_over_the_workers_is_refused() -> None:
    config = FleetConfig(model="m", serving=ServingConfig(max_inflight=3))
    check_workers(config, 3, "fleet.toml")  # one each: fine
    with pytest.raises(ConfigError) as refused:
        check_workers(config, 4, "fleet.toml")
    assert refused.value.source == "fleet.toml"
    assert refused.value.problems == [
        "serving.max_inflight: 3 is fewer than the 4 workers (--workers); "
        "each worker admits its share of it, at least 1"
    ]


def test_without_the_queue_admitted_requests_fill_the_share() -> None:
    limits = Limits(max_inflight=4, max_queued=10, queue=False)
    assert not limits.full(admitted=3, dispatched=0)
    assert limits.full(admitted=4, dispatched=0)
    assert limits.full(admitted=4, dispatched=0, queues=False)


def test_with_the_queue_one_that_may_queue_is_refused_at_the_share_plus_the_queue() -> None:
    limits = Limits(max_inflight=4, max_queued=10, queue=True)
    assert not limits.full(admitted=13, dispatched=4)
    assert limits.full(admitted=14, dispatched=0)


def test_a_request_that_never_waits_is_bounded_by_the_dispatched_count_alone() -> None:
    limits = Limits(max_inflight=4, max_queued=10, queue=True)
    assert not limits.full(admitted=13, dispatched=3, queues=False)
    assert limits.full(admitted=0, dispatched=4, queues=False)


@given(counts, counts, st.booleans(), st.booleans(), st.integers(min_value=1, max_value=8), counts)
def test_a_worker_is_full_at_its_share_whatever_the_others_hold(
    admitted: int, dispatched: int, queue: bool, queues: bool, count: int, index: int
) -> None:
    index %= count
    limits = Limits(40, 20, queue, index, count)
    bound = limits.inflight() + (limits.queued() if queue and queues else 0)
    held = dispatched if queue and not queues else admitted
    assert limits.full(admitted, dispatched, queues=queues) == (held >= bound)


def test_the_429_names_the_router_limits_and_this_workers_share() -> None:
    alone = Limits(max_inflight=5, max_queued=8, queue=False)
    assert alone.at_limit() == "router is at max_inflight=5; retry later"
    queued = Limits(max_inflight=5, max_queued=8, queue=True)
    assert queued.at_limit() == "router is at max_inflight=5 and max_queued=8; retry later"
    second = Limits(max_inflight=5, max_queued=8, queue=True, index=1, count=2)
    assert second.queued() == 4
    assert second.at_limit() == (
        "router is at max_inflight=5 and max_queued=8 (this worker's share: 2, of 2 "
        "workers); retry later"
    )


def test_draining_refuses_first_then_maintenance_then_the_limit() -> None:
    full = Limits(max_inflight=1, max_queued=1, queue=False)
    draining = refusal(full, 9, 9, draining=True, maintenance=True)
    assert isinstance(draining, ShuttingDown)
    assert draining.status == 503
    assert draining.message == "router shutting down: not taking new requests"
    maintenance = refusal(full, 9, 9, draining=False, maintenance=True)
    assert isinstance(maintenance, Maintenance)
    assert maintenance.status == 503
    assert maintenance.message == (
        "router in maintenance (whole-wave restart): an engine was ejected; "
        "POST /narwhal/lifecycle/readmit once the fleet is back"
    )
    at_limit = refusal(full, 1, 0, draining=False, maintenance=False)
    assert isinstance(at_limit, Overloaded)
    assert at_limit.status == 429
    assert at_limit.message == "router is at max_inflight=1; retry later"
    assert {f.phase for f in (draining, maintenance, at_limit)} == {Phase.ADMISSION}
    assert refusal(full, 0, 0, draining=False, maintenance=False) is None


def test_a_tokenizer_request_is_admitted_while_queued_requests_fill_the_router() -> None:
    limits = Limits(max_inflight=2, max_queued=4, queue=True)
    assert isinstance(refusal(limits, 6, 1, draining=False, maintenance=False), Overloaded)
    assert refusal(limits, 6, 1, draining=False, maintenance=False, queues=False) is None


def test_no_request_goes_on_past_the_in_flight_share_and_the_fleet_is_not_asked() -> None:
    asked: list[bool] = []

    def headroom() -> int | None:
        asked.append(True)
        return 10

    assert not dispatchable(dispatched=3, limit=3, handed=0, headroom=headroom)
    assert asked == []  # reading every engine is not needed to say no


@given(counts, counts, counts, st.none() | counts)
def test_a_request_goes_on_while_the_fleet_takes_more_than_was_let_go(
    dispatched: int, limit: int, handed: int, room: int | None
) -> None:
    goes = dispatchable(dispatched, limit, handed, lambda: room)
    assert goes == (dispatched < limit and (room is None or room > handed))


def test_a_queued_request_is_sent_no_later_than_a_first_token_before_its_deadline() -> None:
    assert dispatch_by(100.0, request_timeout_s=60.0, first_token_timeout_s=10.0) == 90.0
    # a first-token budget longer than half the request's: half the request's
    assert dispatch_by(100.0, request_timeout_s=20.0, first_token_timeout_s=15.0) == 90.0
