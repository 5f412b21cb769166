"""Admission: who gets in, and how many are in (SPEC 3's 429 and 503 rows, 8 invariant 1).

One object owns both the check a request passes before it is admitted (the router is not
draining nor in maintenance, and this process is under its share of
``serving.max_inflight``) and the count of admitted requests that check reads, so they
cannot drift apart. Requests to a completion endpoint are counted on arrival too
(``received``): each one, admitted or not, ends in exactly one journal line.
"""

from __future__ import annotations

from typing import Any

import trio

from narwhal.core.admission import inflight_share
from narwhal.core.config import ServingConfig
from narwhal.core.faults import Maintenance, Overloaded, Phase, ShuttingDown


class Admission:
    def __init__(self, in_flight_gauge: Any = None) -> None:
        self.received = 0  # requests to a completion endpoint, admitted or not
        self.admitted = 0
        # serve --workers N: this process is worker ``worker_index`` of ``worker_count``
        # and admits its share of max_inflight (``limit``)
        self.worker_index, self.worker_count = 0, 1
        self._gauge = in_flight_gauge  # narwhal_requests_in_flight, when exported
        self._drained = trio.Event()
        self._drained.set()

    def limit(self, serving: ServingConfig) -> int:
        """The admitted requests this process takes at once before 429."""
        return inflight_share(serving.max_inflight, self.worker_index, self.worker_count)

    def check(self, serving: ServingConfig, *, draining: bool, maintenance: bool) -> None:
        """Raise the fault that refuses a request now (503 draining or maintenance, 429 at
        the in-flight limit); return when it may be admitted."""
        if draining:
            raise ShuttingDown(
                "router shutting down: not taking new requests", phase=Phase.ADMISSION
            )
        if maintenance:
            raise Maintenance(
                "router in maintenance (whole-wave restart): an engine was ejected; "
                "POST /narwhal/lifecycle/readmit once the fleet is back",
                phase=Phase.ADMISSION,
            )
        if self.admitted >= self.limit(serving):
            raise Overloaded(self._at_limit(serving), phase=Phase.ADMISSION)

    def admit(self) -> None:
        if not self.admitted:
            self._drained = trio.Event()
        self.admitted += 1
        if self._gauge is not None:
            self._gauge.inc()

    def release(self) -> None:
        self.admitted -= 1
        if self._gauge is not None:
            self._gauge.dec()
        if not self.admitted:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Return once no admitted request is left."""
        await self._drained.wait()

    def view(self, serving: ServingConfig) -> dict[str, object]:
        """For ``/narwhal/engines``: the admitted count and the limit, per worker."""
        return {
            "admitted": self.admitted,
            "max_inflight": {
                "router": serving.max_inflight,
                "this_worker": self.limit(serving),
                "workers": self.worker_count,
            },
        }

    def _at_limit(self, serving: ServingConfig) -> str:
        total = serving.max_inflight
        if self.worker_count == 1:
            return f"router is at max_inflight={total}; retry later"
        return (
            f"router is at max_inflight={total} (this worker's share: {self.limit(serving)}, "
            f"of {self.worker_count} workers); retry later"
        )
