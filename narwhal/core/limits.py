"""Admission limits, pure (contract 3, 4.5): which fault refuses a request at its arrival,
each worker's share of the router's limits, and whether one more request may go on to the
engines.

``narwhal.router.admission.Admission`` is the shell: it holds the counts (admitted,
dispatched, handed on from the queue) and the clock, and applies these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.faults import Maintenance, Overloaded, Phase, RequestFault, ShuttingDown


def inflight_share(max_inflight: int, index: int, count: int) -> int:
    """Worker ``index`` of ``count``'s share of ``serving.max_inflight``: the workers do
    not share a counter, so each admits its part, and the parts sum to ``max_inflight``
    (the first ``max_inflight % count`` workers take one more)."""
    return max_inflight // count + (1 if index < max_inflight % count else 0)


def check_workers(config: FleetConfig, count: int, source: str) -> None:
    """Refuse a fleet file that cannot be split over ``count`` workers (``--workers N``)."""
    total = config.serving.max_inflight
    if total < count:
        problem = (
            f"serving.max_inflight: {total} is fewer than the {count} workers (--workers); "
            "each worker admits its share of it, at least 1"
        )
        raise ConfigError(source, [problem])


@dataclass(frozen=True, slots=True)
class Limits:
    """This process's limits: the router's ``serving.max_inflight`` and
    ``admission.max_queued`` (``queue``: ``admission.queue``), of which worker ``index`` of
    ``count`` (``serve --workers N``) holds its share, so that N workers together hold no
    more than one router."""

    max_inflight: int
    max_queued: int
    queue: bool
    index: int = 0
    count: int = 1

    def inflight(self) -> int:
        """The dispatched requests this process runs at once."""
        return inflight_share(self.max_inflight, self.index, self.count)

    def queued(self) -> int:
        """The requests this process holds queued at once."""
        return inflight_share(self.max_queued, self.index, self.count)

    def full(self, admitted: int, dispatched: int, *, queues: bool = True) -> bool:
        """Whether a request arriving now is refused 429. Without the queue, ``admitted``
        requests fill the in-flight share; with it, a request that may queue is refused
        at the share plus the queue's, and one that never waits (``queues`` False:
        ``/tokenize``) by the ``dispatched`` count alone."""
        if not self.queue:
            return admitted >= self.inflight()
        if queues:
            return admitted >= self.inflight() + self.queued()
        return dispatched >= self.inflight()

    def at_limit(self) -> str:
        """The 429's message: the router's limits, and this worker's share of them."""
        queued = f" and max_queued={self.max_queued}" if self.queue else ""
        if self.count == 1:
            return f"router is at max_inflight={self.max_inflight}{queued}; retry later"
        return (
            f"router is at max_inflight={self.max_inflight}{queued} (this worker's share: "
            f"{self.inflight()}, of {self.count} workers); retry later"
        )


def refusal(
    limits: Limits,
    admitted: int,
    dispatched: int,
    *,
    draining: bool,
    maintenance: bool,
    queues: bool = True,
) -> RequestFault | None:
    """The fault that refuses a request arriving now, or None: it may be admitted. A
    draining router refuses first (503), then one in maintenance (503), then one at its
    limits (429, ``Limits.full``)."""
    if draining:
        return ShuttingDown("router shutting down: not taking new requests", phase=Phase.ADMISSION)
    if maintenance:
        return Maintenance(
            "router in maintenance (whole-wave restart): an engine was ejected; "
            "POST /narwhal/lifecycle/readmit once the fleet is back",
            phase=Phase.ADMISSION,
        )
    if limits.full(admitted, dispatched, queues=queues):
        return Overloaded(limits.at_limit(), phase=Phase.ADMISSION)
    return None


def dispatchable(
    dispatched: int, limit: int, handed: int, headroom: Callable[[], int | None]
) -> bool:
    """Whether one more request may go on to the engines now: fewer than ``limit`` (this
    process's in-flight share) are dispatched, and the room of the engines it needs
    (``headroom()``, asked only then: it reads every engine) is more than the requests
    already let go from the queue and not yet running. The room is summed over the engines,
    which holds only because placement sends a request to an engine with room while any
    has it (``narwhal.core.placement.with_room``). No room known (None: no placeable
    engine of a role) lets it go: its run answers 503 at once rather than wait."""
    if dispatched >= limit:
        return False
    room = headroom()
    return room is None or room > handed


def dispatch_by(deadline: float, request_timeout_s: float, first_token_timeout_s: float) -> float:
    """The latest a queued request is worth sending on: its deadline less the time a first
    token may take, ``min(first_token_timeout_s, request_timeout_s / 2)`` (a request sent
    later would most likely end in a 504)."""
    return deadline - min(first_token_timeout_s, request_timeout_s / 2)
