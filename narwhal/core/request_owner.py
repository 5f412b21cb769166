"""Where a client request stands, as its owner keeps it (a chain's machine,
``narwhal.core.request``, or a fan-out's parent, ``narwhal.core.fanout_parent``): the
phase a state is in, how a fault's end is recorded, and what the shell may read of it."""

from __future__ import annotations

from typing import Protocol

from narwhal.core.faults import DeadlineExpired, NotDispatched, Phase, RequestFault
from narwhal.core.lifecycle import Standing, State
from narwhal.core.records import Outcome
from narwhal.core.request_events import GaveUp

PHASE_OF = {
    State.ADMITTED: Phase.ADMISSION,
    State.PREFILLING: Phase.PREFILL,
    State.HANDOFF: Phase.HANDOFF,
    State.DECODING: Phase.DECODE,
    State.GENERATING: Phase.STREAM,
    State.COMMITTED: Phase.STREAM,
    State.FINISHED: Phase.STREAM,
}


def outcome_of(fault: RequestFault) -> Outcome:
    """How a request that ends with ``fault`` is recorded: a request the queue never let
    go to an engine was rejected, one past its deadline expired, any other failed."""
    if isinstance(fault, DeadlineExpired):
        return "expired"
    return "rejected" if isinstance(fault, NotDispatched) else "failed"


class Owner(Protocol):
    """Where a client request stands, as its owner (a chain's machine, or a fan-out's
    parent) keeps it: read by the shell, ended through ``handle``."""

    @property
    def standing(self) -> Standing: ...
    def handle(self, event: GaveUp, /) -> bool: ...
