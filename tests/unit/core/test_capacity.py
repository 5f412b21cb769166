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
    for i, (running, waiting) in enumerate(reports):
        value = capacity.note(running, waiting)
        recent = [min(r, 4096.0) for r, _ in reports[max(0, i + 1 - window) : i + 1] if r > 0]
        assert max(recent, default=0.0) <= value <= 4096.0
        if waiting > 0:  # it held some back: no guess past what it ran lately
            assert value == max(recent, default=0.0)
