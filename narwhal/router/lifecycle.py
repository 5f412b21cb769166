"""One request's life as a transition table (the h11 ``_state.py`` way).

Rules the table encodes:
* an attempt is prefill, then a held descriptor (handoff), then a decode leg;
* the commit point is the first generated token: STREAMING is only reached through it;
* a retry restarts from ADMITTED and exists only before the commit point;
* every state can finish (success only from STREAMING) and a finished request stays so.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    HANDOFF = "handoff"
    DECODING = "decoding"
    STREAMING = "streaming"
    FINISHED = "finished"


class Input(StrEnum):
    PREFILL = "prefill"  # producer leg dispatched
    DESCRIPTOR = "descriptor"  # valid descriptor in hand
    DISPATCH = "dispatch"  # consumer leg dispatched
    FIRST_TOKEN = "first_token"  # commit point
    DONE = "done"  # [DONE] after output
    FAIL = "fail"  # a fault ends the request
    RETRY = "retry"  # a fresh attempt, before any output
    CANCEL = "cancel"  # client gone or deadline


TRANSITIONS: dict[tuple[State, Input], State] = {
    (State.ADMITTED, Input.PREFILL): State.PREFILLING,
    (State.PREFILLING, Input.DESCRIPTOR): State.HANDOFF,
    (State.HANDOFF, Input.DISPATCH): State.DECODING,
    (State.DECODING, Input.FIRST_TOKEN): State.STREAMING,
    (State.STREAMING, Input.DONE): State.FINISHED,
    **{(s, Input.RETRY): State.ADMITTED for s in (State.PREFILLING, State.HANDOFF, State.DECODING)},
    **{(s, Input.FAIL): State.FINISHED for s in State if s is not State.FINISHED},
    **{(s, Input.CANCEL): State.FINISHED for s in State if s is not State.FINISHED},
}


class InvalidTransition(RuntimeError):
    pass


class Lifecycle:
    __slots__ = ("history", "state")

    def __init__(self) -> None:
        self.state = State.ADMITTED
        self.history: list[State] = [State.ADMITTED]

    def advance(self, event: Input) -> State:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise InvalidTransition(f"{event.value} is not allowed in state {self.state.value}")
        self.state = nxt
        self.history.append(nxt)
        return nxt

    @property
    def committed(self) -> bool:
        """True once visible output went out (no retry is possible from here)."""
        return State.STREAMING in self.history
