"""The admission queue's policy (contract 4.5), sans IO: examples that read like the spec, a
hypothesis state machine against a plain model, and focused properties."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from itertools import count
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from narwhal.core.faults import NotDispatched, Phase, QueueDrained
from narwhal.core.flow import (
    BY_RANK,
    RANK,
    Displaced,
    Entry,
    Exit,
    FlowQueue,
    Offered,
    Priority,
    Refused,
    Saturation,
    room_left,
    shed_fault,
)

HI, D, B = Priority.INTERACTIVE, Priority.DEFAULT, Priority.BATCH


def entry(id: Hashable, cls: Priority = D, key: str = "t", at: float = 0.0) -> Entry:
    return Entry(id, cls, key, arrival=at, deadline=at + 600.0)


def dispatch_all(queue: FlowQueue, now: float = 0.0) -> list[Entry]:
    out = []
    while (nxt := queue.next(now)) is not None:
        out.append(nxt)
    return out


# ---- examples, as the spec says them ---------------------------------------------------


def test_order_is_strict_priority_between_classes() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    for id, cls in [("b", B), ("d", D), ("i", HI)]:
        assert queue.offer(entry(id, cls), now=0.0) == Offered()
    assert [e.id for e in dispatch_all(queue)] == ["i", "d", "b"]


def test_a_tenant_sending_ten_times_more_gets_no_more_than_an_equal_share() -> None:
    queue = FlowQueue(max_queued=100, max_queue_wait_s=30.0)
    ids = count()
    for _ in range(3):
        for _ in range(10):
            queue.offer(entry(next(ids), key="heavy"), now=0.0)
        queue.offer(entry(next(ids), key="light"), now=0.0)
    served = [e.key for e in dispatch_all(queue)]
    assert served[:6] == ["heavy", "light"] * 3  # while the light tenant waits, turns
    assert served[6:] == ["heavy"] * 27


def test_within_a_key_arrival_order() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    for id in range(5):
        queue.offer(entry(id, at=float(id)), now=float(id))
    assert [e.id for e in dispatch_all(queue, now=5.0)] == [0, 1, 2, 3, 4]


def test_a_full_queue_displaces_the_newest_of_the_lowest_class_below_the_arrival() -> None:
    queue = FlowQueue(max_queued=4, max_queue_wait_s=30.0)
    for id, cls in [("b1", B), ("b2", B), ("d1", D), ("d2", D)]:
        queue.offer(entry(id, cls), now=0.0)
    assert queue.offer(entry("i1", HI), now=1.0) == Displaced(entry("b2", B))
    assert queue.offer(entry("d3", D), now=1.0) == Displaced(entry("b1", B))
    # a default arrival finds nothing below it: refused, and nothing moved
    assert queue.offer(entry("d4", D), now=1.0) == Refused(Exit.QUEUE_FULL)
    assert queue.offer(entry("i2", HI), now=1.0) == Displaced(entry("d3", D))
    assert queue.answer(entry("b2", B), Exit.DISPLACED) == (429, "queue full")
    assert [e.id for e in dispatch_all(queue, now=1.0)] == ["i1", "i2", "d1", "d2"]


def test_a_full_queue_refuses_an_arrival_of_the_lowest_class() -> None:
    queue = FlowQueue(max_queued=1, max_queue_wait_s=30.0)
    queue.offer(entry("i", HI), now=0.0)
    assert queue.offer(entry("b", B), now=0.0) == Refused(Exit.QUEUE_FULL)
    assert queue.offer(entry("i2", HI), now=0.0) == Refused(Exit.QUEUE_FULL)
    assert len(queue) == 1


def test_a_request_that_waited_max_queue_wait_s_leaves_with_429() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    queue.offer(entry("r", at=2.0), now=2.0)
    assert queue.next_expiry() == 32.0
    assert queue.expire(31.9) == []
    assert queue.expire(32.0) == [(entry("r", at=2.0), Exit.WAIT)]
    assert queue.answer(entry("r", at=2.0), Exit.WAIT) == (429, "no capacity within 30s")
    assert queue.next_expiry() is None
    assert len(queue) == 0


def test_a_request_whose_deadline_cannot_cover_its_wait_leaves_at_its_deadline() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    short = Entry("r", D, "t", arrival=0.0, deadline=12.5)
    queue.offer(short, now=0.0)
    assert queue.next_expiry() == 12.5
    assert queue.expire(12.5) == [(short, Exit.DEADLINE)]
    assert queue.answer(short, Exit.DEADLINE) == (429, "no capacity within 12.5s")


def test_an_arrival_past_its_deadline_is_refused_and_never_queued() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    late = Entry("r", HI, "t", arrival=0.0, deadline=5.0)
    assert queue.offer(late, now=5.0) == Refused(Exit.DEADLINE)
    assert queue.answer(late, Exit.DEADLINE) == (429, "no capacity within 5s")
    assert len(queue) == 0
    assert FlowQueue(10, 0.0).offer(entry("w"), now=0.0) == Refused(Exit.WAIT)


def test_a_client_that_disconnects_while_queued_leaves_at_once() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    queue.offer(entry("a", key="x"), now=0.0)
    queue.offer(entry("b", key="y"), now=0.0)
    assert queue.remove("a")
    assert not queue.remove("a")
    assert "a" not in queue
    assert queue.next_expiry() == 30.0  # b's
    assert [e.id for e in dispatch_all(queue)] == ["b"]


def test_on_sigterm_every_queued_request_is_answered_503() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    for id, cls in [("b", B), ("d", D), ("i", HI)]:
        queue.offer(entry(id, cls), now=0.0)
    assert [e.id for e in queue.drain()] == ["i", "d", "b"]
    assert queue.answer(entry("b", B), Exit.DRAINED)[0] == 503
    assert len(queue) == 0
    assert queue.next_expiry() is None
    assert queue.next(100.0) is None


def test_a_due_request_is_shed_never_dispatched() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    queue.offer(entry("r"), now=0.0)
    with pytest.raises(ValueError, match="expire"):
        queue.next(30.0)
    assert queue.next(29.9) == entry("r")


def test_an_id_is_queued_once_and_may_come_back_after_it_left() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    queue.offer(entry("r"), now=0.0)
    with pytest.raises(ValueError, match="already queued"):
        queue.offer(entry("r"), now=0.0)
    queue.remove("r")
    queue.offer(entry("r", at=10.0), now=10.0)
    assert queue.expire(30.0) == []  # the first offer's expiry does not touch the second
    assert queue.next_expiry() == 40.0


def test_times_and_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="numbers"):
        Entry("r", D, "t", arrival=0.0, deadline=float("nan"))
    with pytest.raises(ValueError, match="max_queued"):
        FlowQueue(max_queued=0, max_queue_wait_s=1.0)


def test_priority_names_and_ranks() -> None:
    assert [p.value for p in BY_RANK] == ["interactive", "default", "batch"]
    assert Priority("batch") is B
    with pytest.raises(ValueError, match="urgent"):
        Priority("urgent")


def saturated(
    waiting: float | None, sent: int, kv_usage: float | None, **limits: Any
) -> Saturation | None:
    """Why an engine takes no more legs (``room_left``'s second half)."""
    return room_left(waiting, sent, kv_usage, **limits)[1]


def test_saturation() -> None:
    limits = {"waiting_limit": 2, "kv_limit": 0.95}
    # scraped waiting plus this router's legs sent since the scrape reaches the limit
    assert saturated(1, 1, None, **limits, consumer=False) == "waiting"
    assert saturated(1, 0, None, **limits, consumer=False) is None
    # without a scrape only this router's legs count
    assert saturated(None, 1, None, **limits, consumer=True) is None
    assert saturated(None, 2, None, **limits, consumer=True) == "waiting"
    # KV usage saturates consumers only
    assert saturated(0, 0, 0.95, **limits, consumer=True) == "kv_usage"
    assert saturated(0, 0, 0.95, **limits, consumer=False) is None
    assert saturated(0, 0, 0.94, **limits, consumer=True) is None


@given(
    waiting=st.none() | st.integers(0, 10),
    sent=st.integers(0, 10),
    kv=st.none() | st.floats(0, 1),
    limit=st.integers(1, 10),
    kv_limit=st.floats(0.01, 1),
    consumer=st.booleans(),
)
def test_saturation_is_monotone_in_load(
    waiting: int | None, sent: int, kv: float | None, limit: int, kv_limit: float, consumer: bool
) -> None:
    why = saturated(waiting, sent, kv, waiting_limit=limit, kv_limit=kv_limit, consumer=consumer)
    assert (why == "waiting") == ((waiting or 0) + sent >= limit)
    # one more leg never frees an engine
    more = saturated(
        waiting, sent + 1, kv, waiting_limit=limit, kv_limit=kv_limit, consumer=consumer
    )
    assert why is None or more is not None


# ---- the state machine -----------------------------------------------------------------

MAX_QUEUED = 6
MAX_WAIT = 5.0
KEYS = ("a", "b", "c")
# times on a half-second grid, so that arrivals, deadlines and expiries tie often
halves = st.integers(-2, 16).map(lambda n: n / 2)


class FlowMachine(RuleBasedStateMachine):
    """The queue against a model written the slow, obvious way: a list in offer order and
    one rotation list of keys per class."""

    offered = Bundle("offered")

    def __init__(self) -> None:
        super().__init__()
        self.queue = FlowQueue(MAX_QUEUED, MAX_WAIT)
        self.now = 0.0
        self.ids = count()
        self.model: list[Entry] = []
        self.rotation: dict[Priority, list[str]] = {cls: [] for cls in Priority}
        self.exits: dict[Hashable, Exit] = {}  # how each request left
        self.all: set[Hashable] = set()

    # the model's bookkeeping
    def leave_by(self, e: Entry) -> float:
        return min(e.arrival + MAX_WAIT, e.deadline)

    def left(self, e: Entry, how: Exit) -> None:
        assert e.id not in self.exits, f"{e.id} left twice"
        self.exits[e.id] = how
        self.model.remove(e)
        if not any(m.cls == e.cls and m.key == e.key for m in self.model):
            self.rotation[e.cls].remove(e.key)

    def due(self) -> list[Entry]:
        return [e for e in self.model if self.leave_by(e) <= self.now]

    @rule(
        target=offered,
        cls=st.sampled_from(Priority),
        key=st.sampled_from(KEYS),
        lag=st.sampled_from([0.0, 0.0, 0.5, 3.0, 5.0]),
        deadline_in=halves,
    )
    def offer(self, cls: Priority, key: str, lag: float, deadline_in: float) -> Hashable:
        e = Entry(next(self.ids), cls, key, arrival=self.now - lag, deadline=self.now + deadline_in)
        self.all.add(e.id)
        got = self.queue.offer(e, self.now)
        if self.leave_by(e) <= self.now:
            assert isinstance(got, Refused)
            assert got.exit is (Exit.WAIT if e.arrival + MAX_WAIT <= e.deadline else Exit.DEADLINE)
            self.exits[e.id] = got.exit
            return e.id
        if len(self.model) < MAX_QUEUED:
            assert got == Offered()
        else:
            lower = [m for m in self.model if RANK[m.cls] < RANK[cls]]
            if not lower:
                assert got == Refused(Exit.QUEUE_FULL)
                self.exits[e.id] = Exit.QUEUE_FULL
                return e.id
            lowest = min(RANK[m.cls] for m in lower)
            victim = [m for m in lower if RANK[m.cls] == lowest][-1]  # the newest
            assert got == Displaced(victim)
            # never a class equal to or above the arrival's
            assert RANK[got.victim.cls] < RANK[cls]
            self.left(victim, Exit.DISPLACED)
        self.model.append(e)
        if key not in self.rotation[cls]:
            self.rotation[cls].append(key)
        return e.id

    @precondition(lambda self: not self.due())
    @rule()
    def dispatch(self) -> None:
        got = self.queue.next(self.now)
        if not self.model:
            assert got is None
            return
        assert got is not None
        # strict priority: nothing of a higher class is queued
        assert all(RANK[m.cls] <= RANK[got.cls] for m in self.model)
        # round-robin: the key at the front of its class's rotation
        assert got.key == self.rotation[got.cls][0]
        # arrival order within the key: the oldest of its key
        assert got == next(m for m in self.model if (m.cls, m.key) == (got.cls, got.key))
        self.left(got, Exit.DISPATCHED)
        if got.key in self.rotation[got.cls]:  # still backlogged: to the back
            self.rotation[got.cls].remove(got.key)
            self.rotation[got.cls].append(got.key)

    @precondition(lambda self: self.due())
    @rule()
    def dispatch_while_due_is_refused(self) -> None:
        with pytest.raises(ValueError, match="expire"):
            self.queue.next(self.now)

    @rule()
    def expire(self) -> None:
        expected = self.due()
        got = self.queue.expire(self.now)
        assert sorted(e.id for e, _ in got) == sorted(e.id for e in expected)
        for e, how in got:
            assert how is (Exit.WAIT if e.arrival + MAX_WAIT <= e.deadline else Exit.DEADLINE)
            self.left(e, how)
        # nothing stays past min(arrival + max_queue_wait_s, deadline)
        assert all(self.leave_by(m) > self.now for m in self.model)

    @rule(id=consumes(offered))
    def cancel(self, id: Hashable) -> None:
        queued = next((m for m in self.model if m.id == id), None)
        assert self.queue.remove(id) == (queued is not None)
        if queued is not None:
            self.left(queued, Exit.CANCELLED)

    # now and then (when the offers so far number 6 mod 7), so the queue also fills up
    @precondition(lambda self: len(self.all) % 7 == 6)
    @rule()
    def drain(self) -> None:
        got = self.queue.drain()
        expected = [m for cls in BY_RANK for m in self.model if m.cls == cls]
        assert got == expected
        for e in got:
            self.left(e, Exit.DRAINED)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def same_as_the_model(self) -> None:
        assert len(self.queue) == len(self.model)
        for cls in Priority:
            assert self.queue.depth(cls) == sum(m.cls == cls for m in self.model)

    @invariant()
    def next_expiry_is_exact(self) -> None:
        expected = min((self.leave_by(m) for m in self.model), default=None)
        assert self.queue.next_expiry() == expected

    @invariant()
    def every_request_is_queued_or_left_exactly_once(self) -> None:
        queued = {m.id for m in self.model}
        assert not queued & self.exits.keys()
        assert queued | self.exits.keys() == self.all
        assert all(id in self.queue for id in queued)


FlowMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestFlowMachine = FlowMachine.TestCase


# ---- focused properties ----------------------------------------------------------------

arrivals = st.lists(st.tuples(st.sampled_from(Priority), st.sampled_from(KEYS)), max_size=40)


@given(arrivals)
def test_dispatch_is_strict_priority_then_arrival_order_per_key(
    offers: list[tuple[Priority, str]],
) -> None:
    queue = FlowQueue(max_queued=100, max_queue_wait_s=30.0)
    for id, (cls, key) in enumerate(offers):
        queue.offer(entry(id, cls, key), now=0.0)
    served = dispatch_all(queue)
    ranks = [RANK[e.cls] for e in served]
    assert ranks == sorted(ranks, reverse=True)
    for cls in Priority:
        for key in KEYS:
            ids = [e.id for e in served if (e.cls, e.key) == (cls, key)]
            assert ids == sorted(ids)
    assert sorted(e.id for e in served) == list(range(len(offers)))


@given(
    st.lists(st.text("abcdefgh", min_size=1, max_size=2), min_size=1, max_size=200),
    st.integers(0, 30),
)
def test_round_robin_serves_each_backlogged_key_once_per_round(keys: list[str], extra: int) -> None:
    """Any mix of tenants in one class: over any k consecutive dispatches with k keys
    backlogged, each key once; and no key gets more than one request ahead of a key that
    still waits, even when a key keeps sending while it is served."""
    queue = FlowQueue(max_queued=1000, max_queue_wait_s=30.0)
    ids = count()
    for key in keys:
        queue.offer(entry(next(ids), key=key), now=0.0)
    waiting = Counter(keys)
    served: Counter[str] = Counter()
    order: list[str] = []
    heavy = keys[0]
    for step in range(len(keys) + extra):
        if step < extra:  # the first key sends one more every time it is served
            queue.offer(entry(next(ids), key=heavy), now=0.0)
            waiting[heavy] += 1
        backlogged = {k for k, n in waiting.items() if n}
        got = queue.next(0.0)
        assert got is not None
        order.append(got.key)
        waiting[got.key] -= 1
        served[got.key] += 1
        # within one request per round of every key that was waiting all along
        assert all(served[got.key] <= served[k] + 1 for k in backlogged)
    # while every key stays backlogged the rotation is a fixed cycle: k-windows are distinct
    k = len(set(keys))
    all_backlogged = min(Counter(keys).values()) * k  # dispatches before the first key runs dry
    for start in range(max(0, all_backlogged - k + 1)):
        assert len(set(order[start : start + k])) == k


@given(
    st.lists(st.sampled_from(Priority), min_size=1, max_size=8),
    st.sampled_from(Priority),
)
def test_displacement_takes_the_newest_of_the_lowest_class_below_only(
    classes: list[Priority], arrival: Priority
) -> None:
    queue = FlowQueue(max_queued=len(classes), max_queue_wait_s=30.0)
    queued = [entry(id, cls, key=f"k{id % 3}") for id, cls in enumerate(classes)]
    for e in queued:
        assert queue.offer(e, now=0.0) == Offered()
    got = queue.offer(entry("new", arrival), now=0.0)
    below = [e for e in queued if RANK[e.cls] < RANK[arrival]]
    if not below:
        assert got == Refused(Exit.QUEUE_FULL)
        assert len(queue) == len(classes)
        return
    lowest = min(RANK[e.cls] for e in below)
    assert got == Displaced([e for e in below if RANK[e.cls] == lowest][-1])
    assert isinstance(got, Displaced)
    assert got.victim.id not in queue
    assert all(e.id in queue for e in queued if e is not got.victim)
    assert len(queue) == len(classes)


@given(
    st.lists(
        st.tuples(st.floats(0, 50), st.floats(0, 100), st.sampled_from(Priority)), max_size=30
    ),
    st.lists(st.floats(0, 150), max_size=10),
    st.floats(0, 40),
)
def test_nothing_stays_past_its_time_and_next_expiry_is_exact(
    offers: list[tuple[float, float, Priority]], checks: list[float], wait: float
) -> None:
    queue = FlowQueue(max_queued=100, max_queue_wait_s=wait)
    kept = {}
    for id, (arrival, deadline_in, cls) in enumerate(offers):
        e = Entry(id, cls, "t", arrival=arrival, deadline=arrival + deadline_in)
        if isinstance(queue.offer(e, now=0.0), Offered):
            kept[id] = e
    for now in sorted(checks):
        expected = min((queue.leave_by(e) for e in kept.values()), default=None)
        assert queue.next_expiry() == expected
        for e, _ in queue.expire(now):
            assert queue.leave_by(kept.pop(e.id)) <= now
        assert all(queue.leave_by(e) > now for e in kept.values())
        assert len(queue) == len(kept)


def test_the_expiry_heap_stays_small_when_requests_leave_another_way() -> None:
    queue = FlowQueue(max_queued=100_000, max_queue_wait_s=30.0)
    for id in range(10_000):
        queue.offer(entry(id, key=f"k{id % 50}"), now=0.0)
        if id % 2:
            assert queue.next(0.0) is not None
    assert len(queue._due) <= 2 * len(queue) + 64
    assert queue.next_expiry() == 30.0


# ---- dispatch by room: which queued request may go when only some engines have room -----


def needing(id: Hashable, pool: str | None, cls: Priority = D, local: bool = False) -> Entry:
    return Entry(id, cls, "t", arrival=0.0, deadline=600.0, local=local, pool=pool)


def test_with_one_kind_of_room_queued_the_head_goes_first_or_none_does() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    for id in ("r1", "r2"):
        queue.offer(needing(id, "a"), now=0.0)
    asked: list[tuple[bool, str | None]] = []

    def no_room(local: bool, pool: str | None) -> bool:
        asked.append((local, pool))
        return False

    assert queue.next_with_room(0.0, no_room) is None
    assert asked == [(False, "a")]
    assert queue.next_with_room(0.0, lambda local, pool: True) == needing("r1", "a")
    assert len(queue) == 1


def test_a_request_for_engines_with_room_is_not_held_back_by_one_for_full_engines() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    queue.offer(needing("full-1", "a", HI), now=0.0)
    queue.offer(needing("full-2", "a"), now=0.0)
    queue.offer(needing("alone", "a", local=True), now=0.0)  # its consumer serves it alone
    queue.offer(needing("roomy", "b", B), now=0.0)
    asked: list[tuple[bool, str | None]] = []

    def room(local: bool, pool: str | None) -> bool:
        asked.append((local, pool))
        return local or pool == "b"

    assert queue.next_with_room(0.0, room) == needing("alone", "a", local=True)
    assert asked == [(False, "a"), (True, "a")]  # each kind asked once, in the queue's order
    assert queue.next_with_room(0.0, room) == needing("roomy", "b", B)
    # what is left needs one room: the head decides again
    assert queue.next_with_room(0.0, room) is None
    assert [e.id for e in dispatch_all(queue)] == ["full-1", "full-2"]


kinds = st.tuples(st.booleans(), st.sampled_from([None, "a", "b"]))


@settings(max_examples=300)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("offer"), st.sampled_from(list(Priority)), kinds),
            st.tuples(st.just("remove"), st.integers(min_value=0, max_value=30)),
            st.tuples(st.just("expire"), st.integers(min_value=0, max_value=30)),
            st.tuples(st.just("next"), st.sets(kinds)),
            st.tuples(st.just("drain")),
        ),
        max_size=40,
    )
)
def test_dispatch_by_room_takes_the_first_request_in_order_whose_room_there_is(
    steps: list[tuple[Any, ...]],
) -> None:
    """However requests came and left (displaced, expired, removed, dispatched, drained),
    ``next_with_room`` lets go the first request in the queue's order whose kind of room
    there is (what ``next_where`` takes), asking each kind at most once."""
    queue = FlowQueue(max_queued=6, max_queue_wait_s=10.0)
    twin = FlowQueue(max_queued=6, max_queue_wait_s=10.0)
    ids = count()
    now = 0.0
    for step in steps:
        match step:
            case ("offer", cls, (local, pool)):
                offered = Entry(next(ids), cls, "t", now, now + 10.0, local, pool)
                assert queue.offer(offered, now) == twin.offer(offered, now)
            case ("remove", id):
                assert queue.remove(id) == twin.remove(id)
            case ("expire", tick):
                now += tick / 10
                assert queue.expire(now) == twin.expire(now)
            case ("next", roomy):
                asked: list[tuple[bool, str | None]] = []

                def room(
                    local: bool, pool: str | None, roomy: Any = roomy, asked: Any = asked
                ) -> bool:
                    asked.append((local, pool))
                    return (local, pool) in roomy

                taken = queue.next_with_room(now, room)
                assert taken == twin.next_where(now, lambda e: (e.local, e.pool) in roomy)
                assert len(asked) == len(set(asked))
                assert taken is None or (taken.local, taken.pool) in roomy
            case ("drain",):
                assert queue.drain() == twin.drain()
        assert len(queue) == len(twin)


def test_a_request_the_queue_let_go_unsent_is_answered_429_or_503_on_sigterm() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    waited = shed_fault(queue, entry("r"), Exit.WAIT)
    assert type(waited) is NotDispatched
    assert (waited.status, waited.message) == (429, "no capacity within 30s")
    full = shed_fault(queue, entry("r"), Exit.QUEUE_FULL)
    assert (type(full), full.status, full.message) == (NotDispatched, 429, "queue full")
    drained = shed_fault(queue, entry("r"), Exit.DRAINED)
    assert type(drained) is QueueDrained
    assert (drained.status, drained.message) == (503, "the router is shutting down")
    assert {f.phase for f in (waited, full, drained)} == {Phase.ADMISSION}


# ---- earliest deadline first within a key (contract 4.8) ------------------------------------


def test_a_request_that_needs_its_time_goes_before_one_that_arrived_just_before() -> None:
    """Interactive requests must start within 2 s: a long prompt predicted at 1.5 s has to
    start by 0.6 s, a short one that came at 0.0 s by 1.9 s; the long one goes first."""
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    short = Entry("short", HI, "t", arrival=0.0, deadline=600.0, due=1.9)
    long = Entry("long", HI, "t", arrival=0.1, deadline=600.0, due=0.6)
    for item in (short, long):
        queue.offer(item, now=0.1)
    assert [e.id for e in dispatch_all(queue, now=0.1)] == ["long", "short"]


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 100), st.floats(0, 100)),
        max_size=40,
    )
)
def test_each_keys_requests_leave_by_due_and_keys_still_take_turns(
    items: list[tuple[str, float, float]],
) -> None:
    queue = FlowQueue(max_queued=100, max_queue_wait_s=1e6)
    for n, (key, at, slack) in enumerate(items):
        queue.offer(Entry(n, D, key, arrival=at, deadline=1e6, due=at + slack), now=0.0)
    out = dispatch_all(queue)
    assert sorted(e.id for e in out) == list(range(len(items)))
    for key in ("a", "b"):
        dues = [e.due for e in out if e.key == key]
        assert dues == sorted(dues)
    # round-robin between keys holds: while both have requests, they alternate
    keys = [e.key for e in out]
    both = min(keys.count("a"), keys.count("b"))
    assert all(keys[i] != keys[i + 1] for i in range(2 * both - 1))


def test_without_a_due_arrival_order_is_kept() -> None:
    queue = FlowQueue(max_queued=10, max_queue_wait_s=30.0)
    for n in range(5):
        queue.offer(entry(n, at=float(5 - n)), now=0.0)  # arrival as offered, not by time
    assert [e.id for e in dispatch_all(queue)] == [0, 1, 2, 3, 4]
