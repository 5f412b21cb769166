"""The request lifecycle table: every (state, input) pair, walked by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.lifecycle import TRANSITIONS, Input, InvalidTransition, Lifecycle, State


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Input))
def test_every_pair_is_either_in_the_table_or_refused(state: State, event: Input) -> None:
    life = Lifecycle()
    life.state = state
    if (state, event) in TRANSITIONS:
        assert life.advance(event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(InvalidTransition):
            life.advance(event)
        assert life.state is state


SUCCESS = (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH, Input.FIRST_TOKEN, Input.COMMIT)


def test_the_success_path() -> None:
    """Streaming commits at the first token; a JSON answer commits with its whole body at
    the end: the same inputs, at different times."""
    life = Lifecycle()
    for event in SUCCESS[:-1]:
        life.advance(event)
    assert life.output_seen
    assert not life.committed  # output, but no 200 headers yet
    life.advance(Input.COMMIT)
    life.advance(Input.DONE)
    assert life.state is State.FINISHED
    assert life.committed


def test_a_failure_after_output_before_the_commit_point_is_not_committed() -> None:
    life = Lifecycle()
    for event in SUCCESS[:-1]:
        life.advance(event)
    life.advance(Input.FAIL)
    assert life.finished
    assert life.output_seen
    assert not life.committed  # a non-streaming client gets a JSON error


@given(st.lists(st.sampled_from(list(Input)), max_size=30))
def test_invariants_over_random_walks(events: list[Input]) -> None:
    life = Lifecycle()
    for event in events:
        before = life.state
        try:
            life.advance(event)
        except InvalidTransition:
            continue
        # no retry after output; FINISHED is terminal; success only once committed, and the
        # commit point only after output
        if event is Input.RETRY:
            assert not life.output_seen
        assert before is not State.FINISHED
        if event is Input.DONE:
            assert before is State.COMMITTED
        if life.state is State.COMMITTED:
            assert before is State.GENERATING
        if life.committed:
            assert life.output_seen
