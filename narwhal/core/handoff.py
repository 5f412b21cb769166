"""A KV handoff's life, sans I/O (SPEC 5 "lease bound" and "orphaned handoffs").

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
"""

from __future__ import annotations

from enum import StrEnum

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


class Handoff:
    """One descriptor on its way from a producer to a consumer, and where it ended."""

    __slots__ = ("attempt", "fate", "producer", "result", "rid", "started")

    def __init__(
        self, rid: str, attempt: int, producer: str, result: PrefillResult, started: float
    ) -> None:
        self.rid = rid
        self.attempt = attempt
        self.producer = producer  # the producer engine's id
        self.result = result
        self.started = started  # when the producer leg started (SPEC 5: handoff age)
        self.fate = Fate.ORPHANED  # until a consumer accepts it, or it is found too old

    def age(self, now: float) -> float:
        return now - self.started

    @property
    def backend_id(self) -> str:
        return f"{self.rid}-a{self.attempt}-reclaim"


DROP_REASONS = ("lease", "no_consumer", "saturated", "queue_full", "shutdown")


def reclaim_verdict(
    handoff: Handoff, now: float, *, limit_s: float, placeable: int, free: int
) -> str | None:
    """None: send the reclaim leg now; else why it is dropped unsent (a ``DROP_REASONS``).

    ``placeable`` counts the healthy consumers other than the producer, ``free`` those of
    them with room for one more leg: a reclaim never queues behind client traffic."""
    if handoff.age(now) > limit_s:
        return "lease"  # too near the lease: the read could land after the blocks are freed
    if placeable == 0:
        return "no_consumer"
    if free == 0:
        return "saturated"
    return None
