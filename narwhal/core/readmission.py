"""What readmits an ejected engine, pure (contract 6.2): which probe lifts its ejection,
which peer a crossed probe runs with, and what a probe's results say.

``narwhal.router.health.Health`` is the shell: it runs the probes (the engines' legs, the
health check, the identity check) and feeds the outcome to the breaker.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Literal

from narwhal.core.breaker import ProbeOutcome
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import BreakerClass
from narwhal.core.fleet import Fleet


class Probe(StrEnum):
    """What lifts an engine's ejection."""

    VALIDATE = "validate"  # lifecycle validation: the fleet has an [engine_contract]
    HEALTH = "health"  # a successful /health: it was ejected for being unreachable
    INFERENCE = "inference"  # a crossed handoff in the role it failed in (``probe_leg``)


def probe_for(engine: EngineState, *, contract: bool) -> Probe:
    """The probe that decides whether ``engine`` takes traffic again (``contract``: the
    fleet has an ``[engine_contract]``, which every readmission validates). A hung engine
    still answers ``/health``: only an unreachable one is readmitted by it."""
    if contract:
        return Probe.VALIDATE
    if engine.breaker.ejection_cause is BreakerClass.UNREACHABLE:
        return Probe.HEALTH
    return Probe.INFERENCE


def probe_leg(engine: EngineState) -> Leg:
    """The role an inference probe tries: the one it failed in, else decode if it may."""
    return engine.failed_as or ("decode" if engine.spec.can_decode else "prefill")


def probe_peer(
    fleet: Fleet, engine: EngineState, leg: Leg, model: str, now: float, *, wave: bool = False
) -> EngineState | None:
    """The engine a probe of ``engine``'s ``leg`` crosses with: one of the other role
    serving ``model`` as the fleet means it, healthy (in a whole wave every engine is under
    validation together, so any of them will do), the producer of the failed handoff for a
    decode probe when it still is, else the least loaded; a lone engine crosses with
    itself; None: no peer, the probe is inconclusive."""
    peers = fleet.consumers if leg == "prefill" else fleet.producers
    pool = [e for e in peers if fleet.catalog.means(fleet.served_by(e), model)]
    healthy = [e for e in pool if (wave or e.breaker.healthy(now)) and e is not engine]
    preferred = engine.failed_with if leg == "decode" else None
    if preferred is not None:
        for e in healthy:
            if e.id == preferred:
                return e
    if healthy:
        return min(healthy, key=lambda e: e.load)
    return engine if engine in pool else None


def crossed_verdict(
    engine: EngineState,
    producer: EngineState,
    consumer: EngineState,
    ok: bool,
    failed_side: Literal["producer", "consumer"] | None,
) -> ProbeOutcome:
    """What a crossed handoff says of ``engine`` (the producer or the consumer, or both when
    it crossed with itself): it passes when the handoff worked, fails when its own leg
    failed; the peer's failure decides nothing."""
    if ok:
        return "pass"
    failed = producer if failed_side == "producer" else consumer
    return "fail" if failed is engine else "inconclusive"


def combined(outcomes: Iterable[ProbeOutcome]) -> ProbeOutcome:
    """Several probes' outcome as one (every role of a validation, every engine of a
    wave): any failure fails, else anything undecided leaves it undecided."""
    seen = set(outcomes)
    if "fail" in seen:
        return "fail"
    return "inconclusive" if "inconclusive" in seen else "pass"
