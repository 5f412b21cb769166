"""A KV handoff's life, sans I/O (contract 5 "lease bound" and "orphaned handoffs").

A producer holds a prefilled request's KV blocks until a consumer reads them or its lease
(vLLM 0.32's ``kv_lease_duration``; ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` before) runs out.
Past the lease the blocks may be freed or reused and a consumer reads garbage without an
error, so a descriptor is never sent once it is too old. One that no decode will read is
an orphan: left alone it pins its blocks for the rest of the lease, so it is reclaimed
(``narwhal.router.reclaim``).

Every descriptor has exactly one fate: ``decoded`` (a consumer accepted its decode leg:
from then on the consumer engine owns the read), ``expired`` (too old for
``handoff_timeout_s`` or the lease when it was due to be sent: never sent to the client's
consumer) or ``orphaned`` (no decode will read it). Each one not decoded then gets one
reclaim outcome: ``reclaimed``, ``reclaim_failed`` or ``reclaim_dropped`` (not sent: too
near its lease, no consumer free, the queue full, shutdown). With
``engine.reclaim_orphans`` off it has none: left to the lease.

The reclaim leg's consumer is ``reclaim_plan``'s: never the producer (vLLM frees the blocks
when a *consumer* refuses the request), never a consumer whose leg with this descriptor
failed (a stopped or sick one fails the reclaim too, and nothing else would try: the
producer holds the blocks until its lease), never one the reclaim already failed to reach.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from enum import StrEnum
from typing import Protocol, TypeVar

from narwhal.core.connector import PrefillResult


class Fate(StrEnum):
    DECODED = "decoded"
    EXPIRED = "expired"
    ORPHANED = "orphaned"
    RECLAIMED = "reclaimed"
    RECLAIM_FAILED = "reclaim_failed"
    RECLAIM_DROPPED = "reclaim_dropped"


FATES = ("produced", *(f.value for f in Fate))


def too_old(age: float, *, handoff_timeout_s: float, lease_limit_s: float) -> str | None:
    """Why a descriptor of this age may not go to a client's consumer, or None.

    ``handoff_timeout_s`` (0: no bound of its own) never outlives the lease: past
    ``EngineConfig.lease_limit_s`` the blocks may be gone whatever the operator set."""
    if age > lease_limit_s:
        return f"older than the producer's KV lease allows ({lease_limit_s:g}s)"
    if handoff_timeout_s > 0 and age > handoff_timeout_s:
        return f"limit {handoff_timeout_s:g}s"
    return None


def age_limit(*, handoff_timeout_s: float, lease_limit_s: float) -> float:
    """The oldest a descriptor may be at the last byte of its decode request (``too_old``'s
    bound as one number): the handoff clock runs from the producer leg's start to there."""
    if handoff_timeout_s > 0:
        return min(handoff_timeout_s, lease_limit_s)
    return lease_limit_s


class Handoff:
    """One descriptor on its way from a producer to a consumer, and where it ended."""

    __slots__ = ("attempt", "failed_consumer", "fate", "producer", "result", "rid", "started")

    def __init__(
        self, rid: str, attempt: int, producer: str, result: PrefillResult, started: float
    ) -> None:
        self.rid = rid
        self.attempt = attempt
        self.producer = producer  # the producer engine's id
        self.result = result
        self.started = started  # when the producer leg started (contract 5: handoff age)
        self.fate = Fate.ORPHANED  # until a consumer accepts it, or it is found too old
        self.failed_consumer: str | None = None  # the consumer whose leg with it failed

    def age(self, now: float) -> float:
        return now - self.started

    def send_by(self, limit_s: float) -> float:
        """When its handoff clock fires: the last moment its decode request may be sent."""
        return self.started + limit_s

    @property
    def backend_id(self) -> str:
        return f"{self.rid}-a{self.attempt}-reclaim"


DROP_REASONS = ("lease", "no_consumer", "saturated", "queue_full", "shutdown")


def reclaim_verdict(
    handoff: Handoff, now: float, *, limit_s: float, placeable: int, free: int
) -> str | None:
    """None: send the reclaim leg now; else why it is dropped unsent (a ``DROP_REASONS``).

    ``placeable`` counts the consumers that may take it (``reclaim_candidates``), ``free``
    those of them with room for one more leg: a reclaim never queues behind client traffic."""
    if handoff.age(now) > limit_s:
        return "lease"  # too near the lease: the read could land after the blocks are freed
    if placeable == 0:
        return "no_consumer"
    if free == 0:
        return "saturated"
    return None


class Consumer(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def load(self) -> int: ...


C = TypeVar("C", bound=Consumer)


def reclaim_candidates(
    handoff: Handoff, consumers: Sequence[C], *, tried: Collection[str] = ()
) -> list[C]:
    """The placeable consumers that may take this descriptor's reclaim leg, in fleet order:
    not its producer, not the consumer whose leg with it failed, none already tried."""
    barred = {handoff.producer, *tried}
    if handoff.failed_consumer is not None:
        barred.add(handoff.failed_consumer)
    return [c for c in consumers if c.id not in barred]


def reclaim_plan(
    handoff: Handoff,
    now: float,
    *,
    limit_s: float,
    consumers: Sequence[C],
    has_room: Callable[[C], bool],
    paired: Collection[tuple[str, str]],
    tried: Collection[str] = (),
) -> C | str:
    """Where this orphan's reclaim leg goes, or why it is dropped (a ``DROP_REASONS``).

    ``consumers`` are the placeable ones (healthy, or held in as the last of their role);
    ``tried`` the consumers the reclaim already failed to reach. A consumer that already
    moved KV from this producer comes first (its NIXL handshake is done, it sends the
    release at once; a cold one opens the handshake first), then the least loaded; ties go
    to the first in fleet order."""
    candidates = reclaim_candidates(handoff, consumers, tried=tried)
    free = [c for c in candidates if has_room(c)]
    reason = reclaim_verdict(
        handoff, now, limit_s=limit_s, placeable=len(candidates), free=len(free)
    )
    if reason is not None:
        return reason
    return min(free, key=lambda c: ((handoff.producer, c.id) not in paired, c.load))
