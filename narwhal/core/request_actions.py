"""What a request's machine (``narwhal.core.request``) tells its shell to do next, as h11's
events are small classes: the attempt to make, the route it takes (every engine named: the
shell runs it as it is), the decode leg's descriptor, and what follows a fault (a resume, a
retry after its delay, or the end), with the fault."""

from __future__ import annotations

import math

from narwhal.core.connector import PrefillResult
from narwhal.core.disaggregation import Decision
from narwhal.core.faults import RequestFault
from narwhal.core.handoff import Handoff


class Fresh:
    """An attempt from the start: place its legs."""

    __slots__ = ()


class Continue:
    """A stream's continuation (a resume): its consumer first, then a producer."""

    __slots__ = ()


FRESH, CONTINUE = Fresh(), Continue()


class GoLocal:
    """One leg to ``consumer``, which computes the prompt itself; its first token is
    bounded by the prefill and first-token budgets together."""

    __slots__ = ("consumer", "decision")

    def __init__(self, consumer: str, decision: Decision) -> None:
        self.consumer = consumer
        self.decision = decision


class PlaceProducer:
    """Decode first placed ``consumer`` for a handoff: place a producer apart from it."""

    __slots__ = ("consumer",)

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer


class Prefill:
    """A producer leg on ``producer``, then a handoff to ``consumer`` (None: placed once
    the descriptor is in hand). ``asks_descriptor`` False: the producer decodes too, so
    the leg asks for no descriptor (it would hold the blocks for a read that never comes)."""

    __slots__ = ("asks_descriptor", "consumer", "producer")

    def __init__(
        self, producer: str, consumer: str | None, *, asks_descriptor: bool = True
    ) -> None:
        self.producer = producer
        self.consumer = consumer
        self.asks_descriptor = asks_descriptor


class Decode:
    """The decode leg on ``consumer``: with the descriptor (``crossed``), or without one,
    when the only consumer was the producer itself (its prefill asked for none).
    ``send_by``: the handoff clock, the time by which the decode request must be sent
    whole (contract 5); never, for a leg that carries no descriptor."""

    __slots__ = ("consumer", "crossed", "handoff", "send_by")

    def __init__(
        self, consumer: str, handoff: Handoff | None, crossed: bool, send_by: float = math.inf
    ) -> None:
        self.consumer = consumer
        self.handoff = handoff
        self.crossed = crossed
        self.send_by = send_by if crossed else math.inf

    @property
    def descriptor(self) -> PrefillResult | None:
        return self.handoff.result if self.crossed and self.handoff is not None else None


class Resume:
    """The stream goes on in a continuation (``RequestMachine.continuation``) after
    ``fault``."""

    __slots__ = ("fault",)

    def __init__(self, fault: RequestFault) -> None:
        self.fault = fault


class Retry:
    """A fresh attempt after ``fault``, once ``delay_s`` has passed."""

    __slots__ = ("delay_s", "fault")

    def __init__(self, fault: RequestFault, delay_s: float) -> None:
        self.fault = fault
        self.delay_s = delay_s


class End:
    """The fault is the request's answer. ``retry_denied``: why a transient fault got no
    fresh attempt (a metric's label); ``resume``: why its stream was not resumed, if one
    was asked."""

    __slots__ = ("fault", "resume", "retry_denied")

    def __init__(
        self, fault: RequestFault, retry_denied: str | None, resume: str | None = None
    ) -> None:
        self.fault = fault
        self.retry_denied = retry_denied
        self.resume = resume


AfterFault = Resume | Retry | End
