"""An engine's capacity from its reports: what it ran while some waited is what it runs;
one that never held any back is let run more, a share at a time, never a small one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.capacity import Capacity

SHARE = 0.25


def test_a_consumer_that_never_queues_is_let_run_past_what_it_was_let_run() -> None:
    """A consumer bound by its KV cache ran 26 streams, all it was given, none waiting:
    the next reports let it run a quarter more each, while it keeps up."""
    capacity = Capacity(300, 4096.0, SHARE)
    assert capacity.note(26, 0) == 26 + 6
    assert capacity.note(30, 0) == 32 + 8
    assert capacity.note(12, 0) == 40  # far below its bound: no more growth


def test_what_it_ran_while_some_waited_is_its_capacity() -> None:
    capacity = Capacity(300, 4096.0, SHARE)
    assert capacity.note(40, 0) == 50
    assert capacity.note(40, 3) == 40  # it held 3 back at 40: 40 it is
    assert capacity.note(40, 0) == 40  # and it stays known while that report is recent


def test_a_queue_far_below_the_bound_is_not_the_capacity_shown() -> None:
    """A consumer running 20 of a bound of 40 shows 2 waiting (streams pulling their KV):
    it did not run out of room, so the bound stays; nor does it grow on that report."""
    capacity = Capacity(300, 4096.0, SHARE)
    assert capacity.note(32, 0) == 40
    assert capacity.note(20, 2) == 40
    assert capacity.note(38, 0) == 50  # near the bound with no queue: it grows again


def test_our_own_queue_at_the_bound_stops_the_growth() -> None:
    """A router alone in front of an engine sees only its own requests wait there: a
    queue at the bound is the engine's capacity shown, whoever sent what waits."""
    capacity = Capacity(300, 4096.0, SHARE)
    assert capacity.note(4, 0) == 5
    assert capacity.note(4, 1) == 4
    for _ in range(10):
        assert capacity.note(4, 0) == 4


def test_a_sequence_limit_of_two_is_never_guessed_higher() -> None:
    """A real consumer with --max-num-seqs 2 and a waiting limit of 1: a guess of 3 would
    queue 2 there, over its limit, for as long as its streams run."""
    capacity = Capacity(300, 4096.0, SHARE)
    for _ in range(50):
        assert capacity.note(2, 0) == 2


@given(
    st.lists(
        st.tuples(
            st.floats(0, 5000) | st.just(float("nan")), st.floats(0, 50) | st.just(float("nan"))
        ),
        min_size=1,
        max_size=60,
    )
)
def test_the_guess_is_bounded_and_never_below_what_it_ran(
    reports: list[tuple[float, float]],
) -> None:
    window = 20
    capacity = Capacity(window, 4096.0, SHARE)
    before = 0.0
    for i, (running, waiting) in enumerate(reports):
        value = capacity.note(running, waiting)
        recent = [min(r, 4096.0) for r, _ in reports[max(0, i + 1 - window) : i + 1] if r > 0]
        assert max(recent, default=0.0) <= value <= 4096.0
        if waiting > 0:  # a queue: no growth on its account
            assert value <= max(before, max(recent, default=0.0))
        before = value


def test_once_shown_our_streams_do_not_raise_it() -> None:
    """A consumer with --max-num-seqs 2 showed a queue at 2. One of our streams ends there,
    the engine starts the next at once, and we read the first one's end a moment later:
    for that moment three of ours run. Trusted, the router let a fourth queue there."""
    capacity = Capacity(300, 4096.0, SHARE)
    assert capacity.note(0, 0) == 0
    assert capacity.ours(1) == 1  # not shown yet: our streams raise it at once
    assert capacity.ours(2) == 2
    assert capacity.note(2, 1) == 2  # a queue at 2: shown
    assert capacity.ours(3) == 2
    assert capacity.note(2, 0, ours_peak=3) == 2
