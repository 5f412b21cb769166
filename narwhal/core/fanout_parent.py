"""The parent of a fan-out request (``n > 1``, or a list of prompts): the machine that owns
its lifecycle, as ``narwhal.core.request.RequestMachine`` owns one chain's. Its children
are chains of their own, each with its machine; the parent stands where the furthest of
them has come (a child's retry goes back only in the child), commits once, at the first
output any child sends, and ends once.
"""

from __future__ import annotations

from typing import overload

from narwhal.core.faults import Phase
from narwhal.core.lifecycle import Input, Lifecycle, Standing, State
from narwhal.core.request_events import ChildOutput, ChildReached, ClientLeft, Finished, GaveUp
from narwhal.core.request_owner import PHASE_OF

# the parent follows the furthest child through these, in order
PROGRESS = (State.PREFILLING, State.HANDOFF, State.DECODING, State.GENERATING)
# where it may still follow a child from (written out: mypyc compiles no starred tuple)
_BEHIND = (State.ADMITTED, State.PREFILLING, State.HANDOFF, State.DECODING)
_INPUT_TO = {
    State.PREFILLING: Input.PREFILL,
    State.HANDOFF: Input.DESCRIPTOR,
    State.DECODING: Input.DISPATCH,
    State.GENERATING: Input.FIRST_TOKEN,
}


class FanOutParent:
    """A fan-out's own state: where it stands is where its furthest child stands. Told
    through ``handle``, as a child's machine is."""

    __slots__ = ("_life",)

    def __init__(self) -> None:
        self._life = Lifecycle()

    @overload
    def handle(self, event: ChildReached) -> None: ...
    @overload
    def handle(self, event: ChildOutput) -> bool | None: ...
    @overload
    def handle(self, event: Finished | GaveUp) -> bool: ...
    @overload
    def handle(self, event: ClientLeft) -> Phase: ...
    def handle(self, event: ChildReached | ChildOutput | Finished | GaveUp | ClientLeft) -> object:
        """``ChildReached``: the parent follows when that is further. ``ChildOutput``: True
        when the child's frames commit the answer now, False when it is committed already,
        None when it has ended (nothing more is written). ``Finished``, ``GaveUp``: True
        when it was committed before. ``ClientLeft``: the phase it was in."""
        life = self._life
        if isinstance(event, ChildReached):
            self._follow(event.state)
            return None
        if isinstance(event, ChildOutput):
            return self._output()
        if isinstance(event, Finished):
            return self._finish()
        if isinstance(event, GaveUp):
            committed = life.committed
            life.advance(Input.FAIL)
            return committed
        phase = PHASE_OF[life.state]
        life.advance(Input.CANCEL)
        return phase

    @property
    def standing(self) -> Standing:
        """Where it stands, to read (``Lifecycle``, as its read-only ``Standing``)."""
        return self._life

    def _follow(self, reached: State) -> None:
        life = self._life
        if reached not in PROGRESS or life.finished:
            return
        while life.state in _BEHIND:
            current = life.state
            rank = -1 if current is State.ADMITTED else PROGRESS.index(current)
            if rank >= PROGRESS.index(reached):
                return
            life.advance(_INPUT_TO[PROGRESS[rank + 1]])

    def _output(self) -> bool | None:
        life = self._life
        if life.finished:
            return None
        if life.committed:
            return False
        self._follow(State.GENERATING)  # output: some child has come that far
        life.advance(Input.COMMIT)
        return True

    def _finish(self) -> bool:
        """Every child answered: a child that answered at once is followed to its output
        first."""
        life = self._life
        if life.state is not State.GENERATING and not life.committed:
            self._follow(State.GENERATING)
        committed = life.committed
        if not committed:
            life.advance(Input.COMMIT)
        life.advance(Input.DONE)
        return committed
