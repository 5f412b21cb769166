"""Per-engine breaker, sans IO: streaks, ejection, probes, quarantine (contract 6.2).

Rules the table below encodes:
* a CLOSED engine takes traffic; each engine-side failure extends its streak, any success
  resets it, and the failure that brings the streak to ``eject_after`` TRIPs it: EJECTED;
* client errors and client disconnects are never fed in (``BreakerClass.NONE``);
* an EJECTED engine leaves placement until a probe passes: PROBE_START moves it to PROBING
  (at most one probe in flight: PROBING refuses a second start), PROBE_PASS readmits it,
  PROBE_FAIL and PROBE_INCONCLUSIVE send it back to EJECTED (an inconclusive probe changes
  nothing else: the next one follows at the readmission cadence);
* late results of legs that were in flight when the engine was ejected change nothing.
Quarantine is an overlay with a clock, not a state: a CLOSED engine that just failed is
skipped by placement until ``quarantined_until``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from narwhal.core.faults import BreakerClass


class BreakerState(StrEnum):
    CLOSED = "closed"
    EJECTED = "ejected"
    PROBING = "probing"


class Event(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"  # an engine-side failure below the threshold
    TRIP = "trip"  # the failure that reaches eject_after
    PROBE_START = "probe_start"
    PROBE_PASS = "probe_pass"
    PROBE_FAIL = "probe_fail"
    PROBE_INCONCLUSIVE = "probe_inconclusive"


C, E, P = BreakerState.CLOSED, BreakerState.EJECTED, BreakerState.PROBING
TRANSITIONS: dict[tuple[BreakerState, Event], BreakerState] = {
    (C, Event.SUCCESS): C,
    (C, Event.FAILURE): C,
    (C, Event.TRIP): E,
    (E, Event.SUCCESS): E,
    (E, Event.FAILURE): E,
    (E, Event.PROBE_START): P,
    (P, Event.SUCCESS): P,
    (P, Event.FAILURE): P,
    (P, Event.PROBE_PASS): C,
    (P, Event.PROBE_FAIL): E,
    (P, Event.PROBE_INCONCLUSIVE): E,
}
ProbeOutcome = Literal["pass", "fail", "inconclusive"]
_PROBE_EVENTS: dict[ProbeOutcome, Event] = {
    "pass": Event.PROBE_PASS,
    "fail": Event.PROBE_FAIL,
    "inconclusive": Event.PROBE_INCONCLUSIVE,
}


class Breaker:
    """One engine's breaker. Every method takes ``now`` (the caller's clock)."""

    __slots__ = (
        "eject_after",
        "ejected_at",
        "ejection_cause",
        "ejections",
        "last_cause",
        "last_probe",
        "last_probe_at",
        "quarantine_s",
        "quarantined_until",
        "state",
        "streak",
    )

    def __init__(self, eject_after: int, quarantine_s: float = 0.0) -> None:
        self.eject_after = eject_after
        self.quarantine_s = quarantine_s
        self.state = BreakerState.CLOSED
        self.streak = 0
        self.last_cause: str | None = None
        self.ejection_cause: BreakerClass | None = None  # the class of the tripping failure
        self.ejected_at: float | None = None
        self.ejections = 0
        self.quarantined_until = 0.0
        self.last_probe: ProbeOutcome | None = None
        self.last_probe_at: float | None = None

    def _apply(self, event: Event) -> BreakerState:
        nxt = TRANSITIONS.get((self.state, event))
        if nxt is None:
            raise ValueError(f"breaker: {event.value} is not allowed in state {self.state.value}")
        self.state = nxt
        return nxt

    def record_success(self) -> None:
        if self.state is BreakerState.CLOSED:
            self.streak = 0
        self._apply(Event.SUCCESS)

    def record_failure(self, cls: BreakerClass, cause: str, now: float) -> bool:
        """Feed an engine-side failure; True when it ejected the engine."""
        if cls is BreakerClass.NONE:
            return False  # the client's doing, never the engine's
        if self.state is not BreakerState.CLOSED:
            self._apply(Event.FAILURE)
            return False
        self.streak += 1
        self.last_cause = cause
        if self.quarantine_s > 0:
            self.quarantined_until = now + self.quarantine_s
        if self.streak < self.eject_after:
            self._apply(Event.FAILURE)
            return False
        self._apply(Event.TRIP)
        self.ejection_cause = cls
        self.ejected_at = now
        self.ejections += 1
        return True

    def start_probe(self, now: float) -> bool:
        """Claim the one probe slot; False when the engine is not waiting for a probe."""
        if self.state is not BreakerState.EJECTED:
            return False
        self._apply(Event.PROBE_START)
        self.last_probe_at = now
        return True

    def finish_probe(self, outcome: ProbeOutcome) -> None:
        self._apply(_PROBE_EVENTS[outcome])
        self.last_probe = outcome
        if outcome == "pass":
            self.streak = 0
            self.ejection_cause = None
            self.ejected_at = None
            self.quarantined_until = 0.0

    def healthy(self, now: float) -> bool:
        """Placeable on its own merits: closed and out of quarantine."""
        return self.state is BreakerState.CLOSED and now >= self.quarantined_until
