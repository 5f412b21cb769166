"""The parent of a fan-out request: where it stands is where its furthest child stands; it
commits once, at the first output written, and ends once (docs/architecture.md)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.fanout_parent import PROGRESS, FanOutParent
from narwhal.core.lifecycle import State
from narwhal.core.request_events import (
    CHILD_OUTPUT,
    CLIENT_LEFT,
    FINISHED,
    GAVE_UP,
    ChildReached,
)

EVENTS = st.one_of(
    st.tuples(st.just("reached"), st.sampled_from(list(State))),
    st.tuples(st.sampled_from(["output", "finish", "cancel", "give_up"]), st.none()),
)


def test_it_follows_its_furthest_child_and_never_goes_back() -> None:
    parent = FanOutParent()
    parent.handle(ChildReached(State.DECODING))
    assert parent.standing.state is State.DECODING
    parent.handle(ChildReached(State.PREFILLING))  # another child's retry: the parent stays
    assert parent.standing.state is State.DECODING


def test_the_first_output_commits_and_a_finished_answer_writes_nothing_more() -> None:
    parent = FanOutParent()
    parent.handle(ChildReached(State.GENERATING))
    assert parent.handle(CHILD_OUTPUT) is True
    assert parent.handle(CHILD_OUTPUT) is False
    assert parent.handle(FINISHED) is True  # a stream's end: committed before
    assert parent.handle(CHILD_OUTPUT) is None


def test_an_answer_every_child_gave_at_once_is_committed_whole() -> None:
    parent = FanOutParent()
    parent.handle(ChildReached(State.PREFILLING))
    assert parent.handle(FINISHED) is False  # a JSON answer: committed with its end
    assert parent.standing.finished


@given(st.lists(EVENTS, max_size=12))
def test_any_sequence_of_events_commits_at_most_once_and_ends_once(
    events: list[tuple[str, State | None]],
) -> None:
    parent = FanOutParent()
    commits = 0
    ended = False
    for kind, state in events:
        before = parent.standing.state
        if kind == "reached":
            assert state is not None
            parent.handle(ChildReached(state))
            after = parent.standing.state
            if before in (State.ADMITTED, *PROGRESS) and after in PROGRESS:
                rank = PROGRESS.index
                assert before is State.ADMITTED or rank(after) >= rank(before)  # never back
        elif kind == "output":
            written = parent.handle(CHILD_OUTPUT)
            commits += written is True
            assert (written is None) == ended
        elif ended:
            continue  # the end is once: a second end is the shell's bug, not an event
        elif kind == "finish":
            committed_before = parent.standing.committed
            assert parent.handle(FINISHED) is committed_before
            commits += not committed_before
            ended = True
        elif kind == "cancel":
            parent.handle(CLIENT_LEFT)
            ended = True
        else:
            committed_before = parent.standing.committed
            assert parent.handle(GAVE_UP) is committed_before
            ended = True
        assert commits <= 1
        assert parent.standing.finished == ended
