"""The breaker, sans IO: its table walked pair by pair, and a hypothesis state machine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from narwhal.core.breaker import TRANSITIONS, Breaker, BreakerState, Event
from narwhal.core.config import EngineSpec, RecoveryConfig
from narwhal.core.faults import BreakerClass
from narwhal.core.fleet import Fleet

ENGINE_SIDE = [BreakerClass.STREAM, BreakerClass.UNREACHABLE, BreakerClass.DESCRIPTOR]


@pytest.mark.parametrize("state", list(BreakerState))
@pytest.mark.parametrize("event", list(Event))
def test_every_pair_is_in_the_table_or_refused(state: BreakerState, event: Event) -> None:
    breaker = Breaker(eject_after=3)
    breaker.state = state
    if (state, event) in TRANSITIONS:
        assert breaker._apply(event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(ValueError, match="not allowed"):
            breaker._apply(event)


def test_ejection_and_readmission() -> None:
    breaker = Breaker(eject_after=2)
    assert not breaker.record_failure(BreakerClass.STREAM, "silent", now=1.0)
    breaker.record_success()
    assert breaker.streak == 0
    assert not breaker.record_failure(BreakerClass.STREAM, "silent", now=2.0)
    assert breaker.record_failure(BreakerClass.UNREACHABLE, "refused", now=3.0)
    assert breaker.state is BreakerState.EJECTED
    assert breaker.ejection_cause is BreakerClass.UNREACHABLE
    assert breaker.start_probe(now=4.0)
    assert not breaker.start_probe(now=4.5)  # one probe at a time
    breaker.finish_probe("inconclusive")
    assert breaker.state is BreakerState.EJECTED
    assert breaker.start_probe(now=5.0)
    breaker.finish_probe("pass")
    assert breaker.state is BreakerState.CLOSED
    assert breaker.healthy(now=5.0)


class BreakerMachine(RuleBasedStateMachine):
    """A fleet of three (one producer, one consumer, one of both) under random evidence."""

    def __init__(self) -> None:
        super().__init__()
        self.eject_after = 3
        specs = (
            EngineSpec("p", "http://h:1", "prefill"),
            EngineSpec("d", "http://h:2", "decode"),
            EngineSpec("b", "http://h:3", "both"),
        )
        self.fleet = Fleet(specs, RecoveryConfig(eject_after=3, failure_quarantine_s=5.0))
        self.now = 0.0
        self.streaks = {e.id: 0 for e in self.fleet.engines}
        self.passed_probe = {e.id: False for e in self.fleet.engines}

    engines = st.sampled_from(["p", "d", "b"])

    def breaker(self, engine: str) -> Breaker:
        return self.fleet.by_id[engine].breaker

    @rule(engine=engines)
    def success(self, engine: str) -> None:
        breaker = self.breaker(engine)
        closed = breaker.state is BreakerState.CLOSED
        breaker.record_success()
        if closed:
            self.streaks[engine] = 0

    @rule(engine=engines, cls=st.sampled_from(ENGINE_SIDE))
    def engine_failure(self, engine: str, cls: BreakerClass) -> None:
        breaker = self.breaker(engine)
        was_closed = breaker.state is BreakerState.CLOSED
        ejected = breaker.record_failure(cls, "boom", self.now)
        if was_closed:
            self.streaks[engine] += 1
            # ejected exactly at the Nth consecutive engine-side failure
            assert ejected == (self.streaks[engine] == self.eject_after)
        else:
            assert not ejected
        if ejected:
            self.passed_probe[engine] = False

    @rule(engine=engines)
    def client_error(self, engine: str) -> None:
        breaker = self.breaker(engine)
        before = (breaker.state, breaker.streak, breaker.quarantined_until)
        assert not breaker.record_failure(BreakerClass.NONE, "client's fault", self.now)
        assert (breaker.state, breaker.streak, breaker.quarantined_until) == before

    @rule(engine=engines)
    def start_probe(self, engine: str) -> None:
        breaker = self.breaker(engine)
        was = breaker.state
        started = breaker.start_probe(self.now)
        assert started == (was is BreakerState.EJECTED)  # never a second probe in flight

    @precondition(
        lambda self: any(e.breaker.state is BreakerState.PROBING for e in self.fleet.engines)
    )
    @rule(data=st.data(), outcome=st.sampled_from(["pass", "fail", "inconclusive"]))
    def finish_probe(self, data: st.DataObject, outcome: str) -> None:
        probing = [e.id for e in self.fleet.engines if e.breaker.state is BreakerState.PROBING]
        engine = data.draw(st.sampled_from(probing))
        self.breaker(engine).finish_probe(outcome)  # type: ignore[arg-type]
        if outcome == "pass":
            self.passed_probe[engine] = True
            self.streaks[engine] = 0

    @rule(seconds=st.floats(0.1, 10.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def closed_only_after_a_passing_probe(self) -> None:
        for engine in self.fleet.engines:
            b = engine.breaker
            if b.ejections and b.state is BreakerState.CLOSED:
                assert self.passed_probe[engine.id]

    @invariant()
    def streak_matches_the_model(self) -> None:
        for engine in self.fleet.engines:
            if engine.breaker.state is BreakerState.CLOSED:
                assert engine.breaker.streak == self.streaks[engine.id]

    @invariant()
    def every_role_keeps_an_engine(self) -> None:
        # the last engine able to serve a role is never quarantined or probe-held out
        for role in ("prefill", "decode"):
            engines, _ = self.fleet.placeable(role, self.now)  # type: ignore[arg-type]
            assert engines


TestBreakerMachine = BreakerMachine.TestCase
