"""What readmits an ejected engine (contract 6.2), sans IO: which probe lifts its ejection,
which peer a crossed probe runs with, and what the probes' results say."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.breaker import ProbeOutcome
from narwhal.core.faults import BreakerClass
from narwhal.core.readmission import (
    Probe,
    combined,
    crossed_verdict,
    probe_for,
    probe_leg,
    probe_peer,
)
from tests.support.pure_fleet import MODEL, eject, pure_fleet, serving


def test_an_unreachable_engine_is_readmitted_by_health_a_bad_stream_only_by_inference() -> None:
    fleet = pure_fleet({"p0": "prefill", "d0": "decode"})
    p0, d0 = fleet.engines
    eject(p0, BreakerClass.UNREACHABLE)
    eject(d0, BreakerClass.STREAM)  # a hung engine still answers /health
    assert probe_for(p0, contract=False) is Probe.HEALTH
    assert probe_for(d0, contract=False) is Probe.INFERENCE
    # with an [engine_contract], every readmission validates the engine
    assert probe_for(p0, contract=True) is Probe.VALIDATE
    assert probe_for(d0, contract=True) is Probe.VALIDATE


def test_an_inference_probe_tries_the_role_the_engine_failed_in() -> None:
    fleet = pure_fleet({"b0": "both", "p0": "prefill"})
    both, producer = fleet.engines
    assert probe_leg(both) == "decode"  # no failure recorded: decode, where it may
    assert probe_leg(producer) == "prefill"
    both.failed_as = "prefill"
    assert probe_leg(both) == "prefill"


def test_a_decode_probe_crosses_with_the_producer_of_the_failed_handoff() -> None:
    fleet = pure_fleet({"p0": "prefill", "p1": "prefill", "d0": "decode"})
    p0, p1, d0 = fleet.engines
    p1.inflight["prefill"] = 3
    assert probe_peer(fleet, d0, "decode", MODEL, 0.0) is p0  # the least loaded
    d0.failed_with = "p1"
    assert probe_peer(fleet, d0, "decode", MODEL, 0.0) is p1
    eject(p1)  # no longer healthy: the least loaded of the healthy ones
    assert probe_peer(fleet, d0, "decode", MODEL, 0.0) is p0


def test_a_prefill_probe_crosses_with_the_least_loaded_healthy_consumer() -> None:
    fleet = pure_fleet({"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"})
    p0, d0, d1, d2 = fleet.engines
    p0.failed_with = "d2"  # only a decode probe prefers a peer
    d0.inflight["decode"], d1.inflight["decode"], d2.inflight["decode"] = 2, 1, 0
    eject(d2)
    assert probe_peer(fleet, p0, "prefill", MODEL, 0.0) is d1
    # in a whole wave every engine is under validation together: any will do
    assert probe_peer(fleet, p0, "prefill", MODEL, 0.0, wave=True) is d2


def test_a_probe_crosses_only_with_engines_serving_its_model_as_the_fleet_means_it() -> None:
    fleet = pure_fleet(
        {
            "p0": ("prefill", serving("tiny", "sql:tiny")),
            "d0": ("decode", serving("tiny", "sql:other")),  # another model under the name
            "d1": ("decode", serving("other")),
        }
    )
    p0 = fleet.engines[0]
    assert probe_peer(fleet, p0, "prefill", "sql", 0.0) is None  # inconclusive
    assert probe_peer(fleet, p0, "prefill", "tiny", 0.0) is fleet.engines[1]


def test_a_lone_engine_crosses_with_itself_and_none_of_the_other_role_is_no_peer() -> None:
    fleet = pure_fleet({"b0": "both", "p0": "prefill"})
    b0, p0 = fleet.engines
    eject(b0)
    assert probe_peer(fleet, b0, "prefill", MODEL, 0.0) is b0  # the only consumer
    assert probe_peer(fleet, p0, "prefill", MODEL, 0.0) is None  # its only one is ejected
    assert probe_peer(fleet, p0, "prefill", MODEL, 0.0, wave=True) is b0


def test_a_crossed_handoff_fails_only_the_engine_whose_leg_failed() -> None:
    fleet = pure_fleet({"p0": "prefill", "d0": "decode", "b0": "both"})
    p0, d0, b0 = fleet.engines
    assert crossed_verdict(d0, p0, d0, True, None) == "pass"
    assert crossed_verdict(d0, p0, d0, False, "consumer") == "fail"
    assert crossed_verdict(d0, p0, d0, False, "producer") == "inconclusive"  # the peer's
    assert crossed_verdict(p0, p0, d0, False, "producer") == "fail"
    assert crossed_verdict(p0, p0, d0, False, "consumer") == "inconclusive"
    # crossed with itself: either side failing is its own
    assert crossed_verdict(b0, b0, b0, False, "producer") == "fail"
    assert crossed_verdict(b0, b0, b0, False, "consumer") == "fail"


outcomes = st.lists(st.sampled_from(["pass", "fail", "inconclusive"]), max_size=6)


@given(outcomes)
def test_probes_combined_fail_on_any_failure_and_pass_only_when_all_pass(
    seen: list[ProbeOutcome],
) -> None:
    verdict = combined(seen)
    assert (verdict == "fail") == ("fail" in seen)
    assert (verdict == "pass") == all(o == "pass" for o in seen)
    assert combined(reversed(seen)) == verdict
