"""The parent of a fan-out request (``n > 1``, or a list of prompts): the machine that owns
its lifecycle, as ``narwhal.core.request.RequestMachine`` owns one chain's. Its children
are chains of their own, each with its machine; the parent stands where the furthest of
them has come (a child's retry goes back only in the child), commits once, at the first
output any child sends, and ends once.
"""

from __future__ import annotations

from narwhal.core.faults import Phase
from narwhal.core.lifecycle import Input, Lifecycle, State
from narwhal.core.request import PHASE_OF

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
    """A fan-out's own state: where it stands is where its furthest child stands."""

    __slots__ = ("lifecycle",)

    def __init__(self) -> None:
        self.lifecycle = Lifecycle()

    def child_reached(self, reached: State) -> None:
        """A child came to ``reached``: the parent follows when that is further."""
        lifecycle = self.lifecycle
        if reached not in PROGRESS or lifecycle.finished:
            return
        while lifecycle.state in _BEHIND:
            current = lifecycle.state
            rank = -1 if current is State.ADMITTED else PROGRESS.index(current)
            if rank >= PROGRESS.index(reached):
                return
            lifecycle.advance(_INPUT_TO[PROGRESS[rank + 1]])

    def output(self) -> bool | None:
        """A child's frames are to be written: True when they commit the answer now, False
        when it is committed already, None when it has ended (nothing more is written)."""
        lifecycle = self.lifecycle
        if lifecycle.finished:
            return None
        if lifecycle.committed:
            return False
        self.child_reached(State.GENERATING)  # output: some child has come that far
        lifecycle.advance(Input.COMMIT)
        return True

    def finish(self) -> bool:
        """Every child answered: the answer is complete. True when it was committed before
        (a stream's end); a child that answered at once is followed to its output first."""
        lifecycle = self.lifecycle
        if lifecycle.state is not State.GENERATING and not lifecycle.committed:
            self.child_reached(State.GENERATING)
        committed = lifecycle.committed
        if not committed:
            lifecycle.advance(Input.COMMIT)
        lifecycle.advance(Input.DONE)
        return committed

    def cancelled(self) -> Phase:
        """The client left, or the deadline or the drain ended it: the phase it was in."""
        phase = PHASE_OF[self.lifecycle.state]
        self.lifecycle.advance(Input.CANCEL)
        return phase

    def give_up(self) -> bool:
        """A fault ends it, told to the client; True when it was committed before."""
        committed = self.lifecycle.committed
        self.lifecycle.advance(Input.FAIL)
        return committed
