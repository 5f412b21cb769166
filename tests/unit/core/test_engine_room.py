"""An engine's room from its own reports (SPEC 4.5), pure: its capacity is the most it ran
while some waited; its predicted waiting queue is what it showed waiting, plus this router's
legs since, less the room it had free (capacity less running); before it ever showed
waiting it is not metered. Examples, properties, and a simulated engine the router meters
with nothing but its reports."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.flow import UNMETERED, free_room, learn_capacity, room_left

LIMITS = {"kv_limit": 0.95, "consumer": False}


def test_the_capacity_is_the_most_it_ran_while_some_waited() -> None:
    capacity = None
    for running, waiting in ((3, 0), (0, 4), (2, 1), (5, 2), (4, 7)):
        capacity = learn_capacity(capacity, running, waiting)
    assert capacity == 5  # (3, 0): never full; (0, 4): ran nothing, tells nothing
    assert learn_capacity(5, 9, 0) == 9  # it ran more than that: it can
    assert learn_capacity(None, 9, 0) is None  # not full: still unknown


def test_free_room_is_capacity_less_running_and_unknown_until_learned() -> None:
    assert free_room(running=3, waiting=0, capacity=8) == 5
    assert free_room(running=9, waiting=0, capacity=8) == 0  # never below 0
    assert free_room(running=3, waiting=0, capacity=None) is None  # room: not metered
    assert free_room(running=3, waiting=2, capacity=None) == 0  # it queues: none free


def test_the_predicted_queue_is_waiting_plus_sent_less_free() -> None:
    # 1 waiting + 4 sent since - 3 free = 2: at the limit of 2
    assert room_left(1, 4, None, waiting_limit=2, free=3, **LIMITS) == (0, "waiting")
    assert room_left(1, 3, None, waiting_limit=2, free=3, **LIMITS) == (1, None)
    # more of ours ended than were sent: their slots are free too
    assert room_left(0, -2, None, waiting_limit=2, free=0, **LIMITS) == (4, None)
    assert room_left(0, 40, None, waiting_limit=2, free=None, **LIMITS) == (UNMETERED, None)
    consumer = {**LIMITS, "consumer": True}
    assert room_left(0, 0, 0.96, waiting_limit=2, free=None, **consumer) == (0, "kv_usage")


@given(
    capacity=st.none() | st.integers(0, 64),
    running=st.integers(0, 64),
    waiting=st.integers(0, 64),
)
def test_capacity_only_rises_and_covers_every_full_report(
    capacity: int | None, running: int, waiting: int
) -> None:
    learned = learn_capacity(capacity, running, waiting)
    if capacity is not None:
        assert learned is not None
        assert learned >= capacity
    if waiting > 0 and running > 0:
        assert learned is not None
        assert learned >= running
    if capacity is None and (waiting == 0 or running == 0):
        assert learned is None


@given(
    waiting=st.integers(0, 20),
    running=st.integers(0, 20),
    capacity=st.none() | st.integers(1, 20),
    sent=st.integers(-10, 40),
    limit=st.integers(1, 8),
)
def test_room_is_the_limit_less_the_predicted_queue(
    waiting: int, running: int, capacity: int | None, sent: int, limit: int
) -> None:
    free = free_room(running, waiting, capacity)
    room, why = room_left(waiting, sent, None, waiting_limit=limit, free=free, **LIMITS)
    if free is None:  # unknown capacity, nothing waiting: a burst goes at once
        assert (room, why) == (UNMETERED, None)
        return
    predicted = waiting + sent - free
    assert (why == "waiting") == (predicted >= limit)
    assert room == max(0, limit - predicted)
    # one more leg never frees an engine; one ended never fills it
    more = room_left(waiting, sent + 1, None, waiting_limit=limit, free=free, **LIMITS)
    assert more[0] == max(0, room - 1)


@dataclass
class Engine:
    """A vLLM-like engine: ``capacity`` slots; what arrives waits until its next step,
    which fills the slots from the waiting queue in order."""

    capacity: int
    running: list[int] = field(default_factory=list)  # steps left for each
    waiting: deque[int] = field(default_factory=deque)

    def step(self) -> int:
        """One engine step; how many requests ended."""
        self.running = [left - 1 for left in self.running]
        ended = sum(1 for left in self.running if left <= 0)
        self.running = [left for left in self.running if left > 0]
        while self.waiting and len(self.running) < self.capacity:
            self.running.append(self.waiting.popleft())
        return ended


@given(
    capacity=st.integers(1, 6),
    limit=st.integers(1, 4),
    every=st.integers(1, 3),
    arrivals=st.lists(st.lists(st.integers(1, 5), max_size=12), min_size=1, max_size=30),
)
def test_a_router_metering_by_reports_fills_an_engine_and_queues_no_more_than_the_limit(
    capacity: int, limit: int, every: int, arrivals: list[list[int]]
) -> None:
    """A router that knows only the engine's reports (every ``every`` steps) and its own
    legs: a burst goes at once until a report shows the engine full; from then on the
    engine's waiting queue, as each step leaves it, never grows past the limit (what it
    held when the router learned is drained first), and whatever the router holds back,
    the engine is full and holds the limit waiting."""
    engine = Engine(capacity)
    held: deque[int] = deque()  # the router's queue
    learned: int | None = None
    report: tuple[int, int] | None = None  # (running, waiting) as scraped
    ours_at_report = 0
    before = None  # the waiting queue the last step left, once learned
    for tick, burst in enumerate(arrivals):
        engine.step()
        waiting = len(engine.waiting)
        if learned is not None:
            assert before is not None
            assert waiting <= max(limit, before)  # never grows past the limit
            before = waiting
        if tick % every == 0:  # a scrape: our legs then are all in what it shows
            report = (len(engine.running), waiting)
            learned = learn_capacity(learned, *report)
            ours_at_report = len(engine.running) + waiting
            if learned is not None and before is None:
                assert learned == capacity  # full when some waited: it ran all it could
                before = waiting
        held.extend(burst)
        assert report is not None
        while held:
            ours = len(engine.running) + len(engine.waiting)
            free = free_room(report[0], report[1], learned)
            room, _ = room_left(
                report[1], ours - ours_at_report, None, waiting_limit=limit, free=free, **LIMITS
            )
            if room <= 0:
                break
            engine.waiting.append(held.popleft())
        if learned is None:
            assert not held  # not metered before it ever showed waiting
        elif held:  # metered: it is full, with the limit waiting beyond what it runs
            assert len(engine.running) + len(engine.waiting) >= capacity + limit
