"""Scripted faults for the fake engine: a queue, each fault consumed by the next matching leg.

Set from tests (``engine.faults.push(...)``) or over HTTP (``POST /fake/faults`` with a JSON
list). This issue ships the queue and the two simplest kinds; the failure-contract issue
adds the rest of the catalogue here, without touching the engine's request handling.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import msgspec

Leg = Literal["prefill", "decode", "any"]
# "status": answer the leg with HTTP `status` and a vLLM-shaped error body.
# "hang": accept the request and never answer (until the client goes away).
FaultKind = Literal["status", "hang"]


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kind: FaultKind
    leg: Leg = "any"
    status: int = 500
    message: str = "scripted fault"


class FaultQueue:
    def __init__(self) -> None:
        self._queue: deque[Fault] = deque()

    def push(self, *faults: Fault) -> None:
        self._queue.extend(faults)

    def take(self, leg: Literal["prefill", "decode"]) -> Fault | None:
        """The first queued fault for ``leg`` (or for any leg), removed from the queue."""
        if not self._queue:
            return None
        for i, fault in enumerate(self._queue):
            if fault.leg in (leg, "any"):
                del self._queue[i]
                return fault
        return None

    def __len__(self) -> int:
        return len(self._queue)

    def clear(self) -> None:
        self._queue.clear()
