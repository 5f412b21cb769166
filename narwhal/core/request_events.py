"""What the shell tells a request's machine (``narwhal.core.request``), as h11's events are
small classes: each says what happened, with every fact and time the machine needs to
answer it, and none can be changed once told. ``RequestMachine.handle`` takes one and
answers with the action to take (``narwhal.core.request_actions``).

Events without fields are told as their one instance (``DISPATCHED``, ``FIRST_TOKEN``, …):
the per-token path tells two of them and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from narwhal.core.connector import PrefillResult
from narwhal.core.disaggregation import Decision
from narwhal.core.faults import RequestFault
from narwhal.core.lifecycle import State


@dataclass(frozen=True, slots=True)
class Dispatched:
    """The admission queue let the request go (it leaves the queue once)."""


@dataclass(frozen=True, slots=True)
class NextAttempt:
    """The request needs an attempt: a fresh one, or a stream's continuation."""


@dataclass(frozen=True, slots=True)
class ConsumerPlaced:
    """Decode first: placement chose ``consumer``, and ``decision`` says whether it may
    compute the prompt alone (anything but "disaggregated")."""

    consumer: str
    decision: Decision


@dataclass(frozen=True, slots=True)
class ProducerPlaced:
    """Placement chose ``producer`` for the prefill leg. ``consumer``: the one decode first
    chose (None: placed once the descriptor is in hand); ``only_consumer``: the one engine
    left that may decode, if one; ``consumers``: how many may decode."""

    producer: str
    consumer: str | None
    only_consumer: str | None
    consumers: int
    now: float


@dataclass(frozen=True, slots=True)
class ContinuationPlaced:
    """A stream's continuation was placed: ``consumer`` decodes it, ``producer`` prefills
    the prompt and what was sent. ``context``: the consumer's context length (None:
    unknown, or not asked of an engine this request saw fail)."""

    producer: str
    consumer: str
    context: int | None
    now: float
    view: RunView


@dataclass(frozen=True, slots=True)
class PrefillAnswered:
    """The producer answered the prefill leg of request ``rid`` that started at
    ``started``; ``result``: its descriptor."""

    rid: str
    producer: str
    result: PrefillResult
    started: float


@dataclass(frozen=True, slots=True)
class DecodeDue:
    """The decode leg is about to go to ``consumer`` at ``now``."""

    consumer: str
    now: float
    view: RunView


@dataclass(frozen=True, slots=True)
class DecodeTaken:
    """The consumer took the decode request: reading the blocks is its job now."""


@dataclass(frozen=True, slots=True)
class DecodeFailed:
    """The decode leg on ``consumer`` failed with ``fault`` (its descriptor's reclaim goes
    elsewhere)."""

    consumer: str
    fault: RequestFault


@dataclass(frozen=True, slots=True)
class LegsDone:
    """The attempt's legs are over, however they ended."""


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The decode leg produced its first output."""


@dataclass(frozen=True, slots=True)
class Committed:
    """The 200 headers went out with the first output (the commit point)."""


@dataclass(frozen=True, slots=True)
class LegFailed:
    """An attempt failed at ``now`` with ``fault``, in a leg or in placing one."""

    fault: RequestFault
    now: float
    view: RunView


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """The request's stream ended, however (completed, failed, cancelled)."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The answer is complete and about to be written."""


@dataclass(frozen=True, slots=True)
class GaveUp:
    """A fault ends the request and is told to its client."""


@dataclass(frozen=True, slots=True)
class ClientLeft:
    """The client left, or the deadline or the drain ended the request (the shell's cancel
    scopes have cancelled its legs)."""


@dataclass(frozen=True, slots=True)
class ChildReached:
    """A fan-out's child came to ``state``."""

    state: State


@dataclass(frozen=True, slots=True)
class ChildOutput:
    """A fan-out's child has frames to write."""


# the events that move the lifecycle and answer nothing
Told = Dispatched | DecodeTaken | DecodeFailed | FirstToken | Committed
# the events that place an attempt's legs
Placement = ConsumerPlaced | ProducerPlaced | ContinuationPlaced
# the events that end the request, answered with whether it was committed
Ending = Finished | GaveUp
Event = (
    Told
    | Placement
    | Ending
    | NextAttempt
    | PrefillAnswered
    | DecodeDue
    | LegsDone
    | LegFailed
    | StreamEnded
    | ClientLeft
)


class RunView(Protocol):
    """What the machine asks of its shell, only when a fault may be answered by a resume
    (told with the events that may bring one, never kept: the machine holds no reference
    to its shell, so a request's objects are freed with it, not by the cycle collector):
    the placeable consumers (a continuation goes to one this request has not failed on)
    and how long its first output took (a continuation needs as long)."""

    def consumers(self) -> Sequence[str]: ...
    @property
    def needed_s(self) -> float: ...


class KeptStream(Protocol):
    """What a stream kept for a resume (``narwhal.stream.continuation.Kept``)."""

    @property
    def prompt_ids(self) -> list[int] | None: ...
    @property
    def ids(self) -> list[int]: ...
    def sent(self) -> list[int]: ...
    def refusal(self) -> str | None: ...


# Where the running attempt is, and the events each step allows (the lifecycle table
# says where the request is; a continuation's legs leave it where its output left it)
Step = Literal["closed", "placing", "prefilling", "handing_off", "decoding", "ended"]
_OPEN: tuple[Step, ...] = ("placing", "prefilling", "handing_off", "decoding")
STEPS: dict[type, tuple[Step, ...]] = {
    NextAttempt: ("closed",),
    ConsumerPlaced: ("placing",),
    ProducerPlaced: ("placing",),
    ContinuationPlaced: ("placing",),
    PrefillAnswered: ("prefilling",),
    DecodeDue: ("handing_off",),
    DecodeTaken: ("decoding",),
    DecodeFailed: ("decoding",),
    FirstToken: ("decoding",),
    Committed: ("decoding",),
    Finished: ("decoding",),
    LegFailed: _OPEN,
}

DISPATCHED, NEXT_ATTEMPT, DECODE_TAKEN, LEGS_DONE = (
    Dispatched(),
    NextAttempt(),
    DecodeTaken(),
    LegsDone(),
)
FIRST_TOKEN, COMMITTED, STREAM_ENDED = FirstToken(), Committed(), StreamEnded()
FINISHED, GAVE_UP, CLIENT_LEFT, CHILD_OUTPUT = Finished(), GaveUp(), ClientLeft(), ChildOutput()
