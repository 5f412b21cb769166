"""The request lifecycle table: every (state, input) pair, walked by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.router.lifecycle import TRANSITIONS, Input, InvalidTransition, Lifecycle, State


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


def test_the_success_path() -> None:
    life = Lifecycle()
    for event in (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH, Input.FIRST_TOKEN, Input.DONE):
        life.advance(event)
    assert life.state is State.FINISHED
    assert life.committed


@given(st.lists(st.sampled_from(list(Input)), max_size=30))
def test_invariants_over_random_walks(events: list[Input]) -> None:
    life = Lifecycle()
    for event in events:
        before = life.state
        try:
            life.advance(event)
        except InvalidTransition:
            continue
        # no retry after the commit point; FINISHED is terminal; success only after output
        if event is Input.RETRY:
            assert not life.committed
        assert before is not State.FINISHED
        if event is Input.DONE:
            assert before is State.STREAMING
        if life.state is State.STREAMING:
            assert before is State.DECODING
