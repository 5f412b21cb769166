"""One request's life as a transition table (the h11 ``_state.py`` way): the only record of
where a request is. Retries, the answer to a fault (JSON or a terminal event) and the
disconnect watcher all read it.

Rules the table encodes:
* an attempt is prefill, then a held descriptor (handoff), then a decode leg;
* the first generated token moves DECODING to GENERATING: from here no retry is possible
  (contract 6.1: no retry after output, and bytes of two attempts are never mixed);
* the commit point is the 200 headers going out (contract 1): COMMIT moves GENERATING to
  COMMITTED. A streaming client is committed at its first token; a non-streaming client's
  JSON at its end, with the whole answer;
* a retry restarts from ADMITTED (a failure to place its legs retries from there too)
  and exists only before the first token;
* a resume (a stream's continuation, after output) leaves the request where its output
  left it: the continuation's legs move no state, and no retry follows them;
* every state can finish (success only once output exists) and a finished request stays so.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Protocol


class State(StrEnum):
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    HANDOFF = "handoff"
    DECODING = "decoding"
    GENERATING = "generating"  # output seen, nothing committed (a JSON being assembled)
    COMMITTED = "committed"  # 200 headers out
    FINISHED = "finished"


class Input(StrEnum):
    PREFILL = "prefill"  # producer leg dispatched
    DESCRIPTOR = "descriptor"  # valid descriptor in hand
    DISPATCH = "dispatch"  # consumer leg dispatched
    FIRST_TOKEN = "first_token"  # the decode leg produced output
    COMMIT = "commit"  # 200 headers out (the commit point)
    DONE = "done"  # [DONE] after output: the response is complete
    FAIL = "fail"  # a fault ends the request
    RETRY = "retry"  # a fresh attempt, before any output
    CANCEL = "cancel"  # client gone or deadline
    RESUME = "resume"  # the output goes on in a continuation


_BEFORE_OUTPUT = (State.PREFILLING, State.HANDOFF, State.DECODING)
# written out: mypyc compiles no starred tuple
_RETRIED_FROM = (State.ADMITTED, State.PREFILLING, State.HANDOFF, State.DECODING)
_WITH_OUTPUT = (State.GENERATING, State.COMMITTED)
_CONTINUATION = (Input.RESUME, Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH)

TRANSITIONS: dict[tuple[State, Input], State] = {
    (State.ADMITTED, Input.PREFILL): State.PREFILLING,
    (State.PREFILLING, Input.DESCRIPTOR): State.HANDOFF,
    (State.HANDOFF, Input.DISPATCH): State.DECODING,
    (State.DECODING, Input.FIRST_TOKEN): State.GENERATING,
    (State.GENERATING, Input.COMMIT): State.COMMITTED,
    (State.COMMITTED, Input.DONE): State.FINISHED,
    **{(s, Input.RETRY): State.ADMITTED for s in _RETRIED_FROM},
    **{(s, i): s for s in _WITH_OUTPUT for i in _CONTINUATION},
    **{(s, Input.FAIL): State.FINISHED for s in State if s is not State.FINISHED},
    **{(s, Input.CANCEL): State.FINISHED for s in State if s is not State.FINISHED},
}


class Standing(Protocol):
    """Where a request stands, to read: what its owner lets the shell see of its
    ``Lifecycle`` (only the owner advances it)."""

    @property
    def state(self) -> State: ...
    @property
    def output_seen(self) -> bool: ...
    @property
    def committed(self) -> bool: ...
    @property
    def finished(self) -> bool: ...


class InvalidTransition(Exception):
    pass


class Lifecycle:
    """``listener`` hears every state reached (a fan-out's parent follows its children)."""

    __slots__ = ("history", "listener", "state")

    def __init__(self, listener: Callable[[State], None] | None = None) -> None:
        self.state = State.ADMITTED
        self.history: list[State] = [State.ADMITTED]
        self.listener = listener

    def advance(self, event: Input) -> State:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise InvalidTransition(f"{event.value} is not allowed in state {self.state.value}")
        self.state = nxt
        self.history.append(nxt)
        if self.listener is not None:
            self.listener(nxt)
        return nxt

    @property
    def output_seen(self) -> bool:
        """The decode leg produced output: no retry from here."""
        return State.GENERATING in self.history

    @property
    def committed(self) -> bool:
        """200 headers went out: a failure can only end the stream with a terminal event."""
        return State.COMMITTED in self.history

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED
