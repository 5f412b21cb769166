"""Fleet state: engines, their in-flight legs, and reservations.

Placement is a pure function of this state (``narwhal.router.placement``); reservations are
async context managers, so a leg's count is released on every exit path, cancellation
included.
"""

from __future__ import annotations

from types import TracebackType
from typing import Literal

from narwhal.config import EngineSpec

LegPhase = Literal["prefill", "decode"]


class EngineState:
    __slots__ = ("index", "inflight", "spec")

    def __init__(self, spec: EngineSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.inflight: dict[LegPhase, int] = {"prefill": 0, "decode": 0}

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        return self.inflight["prefill"] + self.inflight["decode"]

    def snapshot(self) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.spec.role,
            "inflight": dict(self.inflight),
            "breaker": {"state": "closed", "streak": 0, "last_cause": None},
            "ejected_until": None,
            "quarantined_until": None,
        }


class Reservation:
    """One in-flight leg on one engine, held for the leg's whole life."""

    __slots__ = ("engine", "phase")

    def __init__(self, engine: EngineState, phase: LegPhase) -> None:
        self.engine = engine
        self.phase = phase

    async def __aenter__(self) -> EngineState:
        self.engine.inflight[self.phase] += 1
        return self.engine

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.engine.inflight[self.phase] -= 1


class Fleet:
    def __init__(self, specs: tuple[EngineSpec, ...]) -> None:
        self.engines = [EngineState(spec, i) for i, spec in enumerate(specs)]
        self.producers = [e for e in self.engines if e.spec.can_prefill]
        self.consumers = [e for e in self.engines if e.spec.can_decode]
        self.turn = 0  # rotates ties so equal engines share load

    def reserve(self, engine: EngineState, phase: LegPhase) -> Reservation:
        return Reservation(engine, phase)

    def reserved(self) -> int:
        """Legs in flight across the fleet (0 after a drain)."""
        return sum(e.load for e in self.engines)

    def ready(self) -> bool:
        return bool(self.producers) and bool(self.consumers)
