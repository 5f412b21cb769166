"""One request's machine, walked as h11 walks its state table: hypothesis plays the shell
(placement, legs, faults, the client, the clock) over whole request lives, and every path
keeps the rules of docs/contract.md section 8 that are the machine's own:

1. one terminal outcome; 3. no retry after output, a resume continues from what was sent;
4. retries within the budget and the attempts, away from the engines that failed;
6. a descriptor to at most one decode leg, never past the lease; 7. a descriptor no decode
took goes to the reclaim queue; 11. a queued request leaves the queue once.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.config import (
    EngineConfig,
    EngineSpec,
    FleetConfig,
    RecoveryConfig,
    ServingConfig,
)
from narwhal.core.connector import PrefillResult
from narwhal.core.faults import (
    DescriptorInvalid,
    EngineStatusError,
    EngineUnreachable,
    HandoffExpired,
    NoCapacity,
    Phase,
    PrefillTimeout,
    RequestFault,
    StreamBroken,
)
from narwhal.core.handoff import Fate, Handoff
from narwhal.core.lifecycle import Input, InvalidTransition, State
from narwhal.core.request import RequestMachine, outcome_of
from narwhal.core.request_actions import Continue, End, Fresh, GoLocal, Prefill, Resume, Retry
from narwhal.core.retry import RetryBudget

ENGINES = ("e0", "e1", "e2")
LEASE_S = 60.0
LIMIT_S = EngineConfig(kv_lease_s=LEASE_S / 0.98).lease_limit_s  # the lease less its slack
DEADLINE_S = 120.0
BODY: dict[str, Any] = {"model": "m", "prompt": "hello", "max_tokens": 40}
ECHO = {**BODY, "echo": True}  # its answer needs the prefill leg's prompt side


def _config(max_attempts: int, resume_streams: int) -> FleetConfig:
    return FleetConfig(
        model="m",
        engines=tuple(EngineSpec(e, f"http://h:{i + 1}", "both") for i, e in enumerate(ENGINES)),
        serving=ServingConfig(max_attempts=max_attempts, request_timeout_s=DEADLINE_S),
        engine=EngineConfig(kv_lease_s=LEASE_S / 0.98),
        recovery=RecoveryConfig(resume_streams=resume_streams),
    )


class _Kept:
    """A stream's kept ids, as ``narwhal.stream.continuation.Kept`` keeps them."""

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = [1, 2, 3]
        self.ids: list[int] = []

    def sent(self) -> list[int]:
        return list(self.ids)

    def refusal(self) -> str | None:
        return None


def _result() -> PrefillResult:
    return PrefillResult("u", "/v1/completions", "r", "NixlConnector", msgspec.Raw(b"{}"))


def _fault(data: st.DataObject, phase: Phase, engine: str) -> RequestFault:
    kinds = [PrefillTimeout, EngineUnreachable, StreamBroken, DescriptorInvalid, None]
    kind = data.draw(st.sampled_from(kinds))
    if kind is None:  # the client's own error, as an engine answered it: never retried
        return EngineStatusError(400, "bad", phase=phase, engine_id=engine)
    fault: RequestFault = kind("engine fault", phase=phase, engine_id=engine)
    return fault


@dataclass
class Life:
    """What the shell saw of one request's life."""

    retries: int = 0
    resumes: int = 0
    decode_legs: dict[int, int] = field(default_factory=dict)  # id(handoff) -> decode legs
    orphans: list[Handoff] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # rules a step broke, as it saw them

    def saw(self, holds: bool, rule: str) -> None:
        if not holds:
            self.broken.append(rule)


def _place(data: st.DataObject, machine: RequestMachine, apart_from: str | None = None) -> str:
    """Placement as ``choose`` keeps it: engines this request saw fail only when no other
    is left, and the other leg's engine only when nothing else is."""
    pool = machine.usable(ENGINES)
    pool = [e for e in pool if e != apart_from] or pool
    return data.draw(st.sampled_from(pool))


def _end(machine: RequestMachine, life: Life, how: str) -> None:
    life.ends.append(how)
    assert machine.lifecycle.finished


def _live(data: st.DataObject, machine: RequestMachine, life: Life, kept: bool) -> None:
    """Drive the machine through one request, as ``RequestRun`` does."""
    if data.draw(st.booleans(), label="leaves while queued"):
        machine.cancelled()
        _end(machine, life, "cancelled")
        return
    machine.dispatched()
    with pytest.raises(InvalidTransition):  # it left the queue once
        machine.dispatched()
    body = data.draw(st.sampled_from([BODY, ECHO]), label="body")
    now = 0.0
    while True:
        step = machine.attempt()
        line = machine.attempt_line
        if data.draw(st.booleans(), label="a token told before the decode leg"):
            with pytest.raises(InvalidTransition):  # output comes from a dispatched decode leg
                machine.first_token()
            with pytest.raises(InvalidTransition):  # and is committed once, after it came
                machine.commit()
        life.saw(line.number == len(machine.attempts), "attempts are numbered in order")
        handoff: Handoff | None = None
        decode_taken = False
        leg_engine = "e0"
        phase = Phase.ADMISSION
        try:
            if type(step) is Continue:
                life.saw(machine.lifecycle.output_seen, "a continuation only after output")
                consumer = _place(data, machine)
                machine.resume_consumer(consumer)
                producer = _place(data, machine, apart_from=consumer)
                route: GoLocal | Prefill = machine.continuation_prefill(producer, consumer)
            else:
                life.saw(type(step) is Fresh, "an attempt is fresh or a continuation")
                life.saw(not machine.lifecycle.output_seen, "a fresh attempt only before output")
                producer = _place(data, machine)
                decode_first = data.draw(st.none() | st.sampled_from(ENGINES))
                route = machine.producer_placed(
                    producer,
                    consumer=decode_first,
                    only_consumer=None,
                    consumers=len(ENGINES),
                    body=body,
                )
            if isinstance(route, GoLocal):
                machine.going_local(route.consumer)
                leg_engine, phase = route.consumer, Phase.DECODE
            else:
                leg_engine, phase = route.producer, Phase.PREFILL
                life.saw(
                    route.asks_descriptor or route.consumer == route.producer,
                    "no descriptor asked for only where one engine runs both legs",
                )
                machine.prefill_sent(route.producer, asks_descriptor=route.asks_descriptor)
                started = now
                if data.draw(st.booleans(), label="prefill fails"):
                    raise _fault(data, phase, leg_engine)
                now += data.draw(st.floats(0, 2 * LEASE_S), label="prefill and placement")
                handoff = machine.prefill_answered("r", route.producer, _result(), started)
                life.saw(
                    (handoff is not None) == route.asks_descriptor, "a descriptor iff asked for"
                )
                if handoff is not None:
                    life.handoffs.append(handoff)
                consumer = route.consumer or _place(data, machine, apart_from=route.producer)
                phase = Phase.HANDOFF
                try:
                    decode = machine.handing_off(consumer, now)
                except HandoffExpired:
                    expired = handoff is not None and handoff.age(now) > LIMIT_S
                    life.saw(expired, "a descriptor expires past the lease only")
                    life.saw(handoff is not None and handoff.fate is Fate.EXPIRED, "expired")
                    raise
                if handoff is not None:
                    life.saw(
                        handoff.age(now) <= LIMIT_S, "invariant 6: never handed off past the lease"
                    )
                    if decode.crossed:  # the handoff clock bounds the send, from the prefill
                        life.saw(decode.send_by == handoff.started + LIMIT_S, "handoff clock")
                leg_engine, phase = consumer, Phase.DECODE
                if decode.crossed and data.draw(st.booleans(), label="clock fires before send"):
                    late = HandoffExpired("KV handoff expired: not sent", phase=Phase.HANDOFF)
                    machine.decode_failed(consumer, late)
                    life.saw(handoff is not None and handoff.fate is Fate.EXPIRED, "unsent")
                    raise late
                if data.draw(st.booleans(), label="consumer refuses"):
                    fault = _fault(data, phase, consumer)
                    machine.decode_failed(consumer, fault)
                    raise fault
                machine.decode_taken(decode)
                decode_taken = True
                if decode.crossed:
                    key = id(handoff)
                    life.decode_legs[key] = life.decode_legs.get(key, 0) + 1
            # the decode leg streams
            tokens = data.draw(st.integers(0, 5), label="tokens before the leg ends")
            if tokens and not machine.lifecycle.output_seen:
                machine.first_token()
            if tokens and machine.lifecycle.state is State.GENERATING:
                machine.commit()  # a stream commits at its first token
            if tokens and data.draw(st.booleans(), label="the first token told again"):
                with pytest.raises(InvalidTransition):  # one first token, one commit point
                    machine.first_token()
                with pytest.raises(InvalidTransition):
                    machine.commit()
            if machine.kept is not None:
                machine.kept.ids.extend(
                    range(len(machine.kept.ids), len(machine.kept.ids) + tokens)
                )
            ending = data.draw(st.sampled_from(["done", "fault", "client"]), label="leg ends")
            if ending == "client":
                machine.cancelled()
                _end(machine, life, "cancelled")
                return
            if ending == "fault" or not machine.lifecycle.output_seen:
                raise _fault(
                    data, Phase.STREAM if machine.lifecycle.output_seen else phase, leg_engine
                )
            machine.finish()
            _end(machine, life, "completed")
            return
        except RequestFault as fault:
            output = machine.lifecycle.output_seen
            after = machine.failed(
                fault, now=now, body=body, chat=False, consumers=lambda: ENGINES, needed_s=0.0
            )
            if type(after) is Retry:
                life.saw(not output, "invariant 3: no retry after output")
                life.saw(fault.transient, "only a transient fault is retried")
                life.retries += 1
                if fault.engine_id is not None and fault.breaker.value != "none":
                    life.saw(
                        fault.engine_id in machine.failed_engines,
                        "invariant 4: a retry avoids the engine",
                    )
                now += after.delay_s
            elif type(after) is Resume:
                life.saw(output and kept, "only a kept stream, only after output")
                sent = list(range(len(machine.kept.ids))) if machine.kept else None
                prompt = (machine.continuation or {}).get("prompt")
                life.saw(prompt == [1, 2, 3, *(sent or [])], "a resume goes on from what was sent")
                life.resumes += 1
            else:
                life.saw(isinstance(after, End) and after.fault is fault, "the end is the fault")
                machine.lifecycle.advance(Input.FAIL)
                _end(machine, life, outcome_of(fault))
                return
        finally:
            if handoff is not None:
                orphan = machine.leg_done()
                if decode_taken and handoff.result is not None and orphan is None:
                    life.saw(handoff.fate is Fate.DECODED, "a taken descriptor is decoded")
                else:
                    life.saw(orphan is handoff, "invariant 7: to the reclaim queue")
                    life.orphans.append(handoff)
            if not machine.lifecycle.finished:
                life.saw(
                    len(machine.attempts) <= 1 + life.retries + life.resumes,
                    "one attempt per retry or resume",
                )


@settings(max_examples=400, deadline=None)
@given(
    data=st.data(),
    max_attempts=st.integers(1, 4),
    credits=st.integers(0, 3),
    resume_streams=st.integers(0, 2),
)
def test_every_life_keeps_the_rules(
    data: st.DataObject, max_attempts: int, credits: int, resume_streams: int
) -> None:
    budget = RetryBudget(float(credits), 0.0)
    machine = RequestMachine(
        _config(max_attempts, resume_streams),
        deadline=DEADLINE_S,
        budget=budget,
        rng=random.Random(0),
        new_kept=_Kept if resume_streams else None,
    )
    life = Life()
    _live(data, machine, life, kept=resume_streams > 0)
    assert life.broken == []  # every step's rule held (invariants 3, 4, 6 and 7 as it went)
    assert len(life.ends) == 1  # invariant 1
    assert machine.lifecycle.finished
    assert machine.lifecycle.history.count(State.FINISHED) == 1
    # invariant 4: the budget pays for each retry and each resume, attempts are bounded
    assert life.retries + life.resumes <= credits
    assert budget.credits >= 0
    fresh = sum(1 for a in machine.attempts if a.resumed_at_token is None)
    assert fresh <= max_attempts
    assert life.resumes <= resume_streams
    # invariant 6: each descriptor to at most one decode leg
    assert all(n == 1 for n in life.decode_legs.values())
    # invariant 7: every descriptor is decoded or handed to the reclaim queue
    for handoff in life.handoffs:
        assert (handoff.fate is Fate.DECODED) != (handoff in life.orphans)
    # every attempt's record says how its descriptor ended
    assert sum(1 for a in machine.attempts if a.handoff_fate is not None) == len(life.handoffs)


def _attempting(max_attempts: int, credits: int) -> RequestMachine:
    """A machine dispatched and in its first attempt, resume off."""
    budget = RetryBudget(float(credits), 0.0)
    config = _config(max_attempts, 0)
    machine = RequestMachine(config, deadline=DEADLINE_S, budget=budget, rng=random.Random(0))
    machine.dispatched()
    machine.attempt()
    return machine


def test_a_retry_goes_to_engines_that_have_not_failed() -> None:
    machine = _attempting(max_attempts=3, credits=5)
    machine.prefill_sent("e0")
    fault = PrefillTimeout("slow", phase=Phase.PREFILL, engine_id="e0")
    after = machine.failed(
        fault, now=1.0, body=BODY, chat=False, consumers=lambda: ENGINES, needed_s=0
    )
    assert type(after) is Retry
    assert machine.usable(ENGINES) == ["e1", "e2"]
    assert machine.attempts[0].retry == "retry"
    assert machine.attempts[0].error == "slow"


def test_a_handoff_to_its_own_producer_runs_alone_unless_it_needs_the_prefill() -> None:
    machine = _attempting(max_attempts=1, credits=0)
    route = machine.producer_placed("e0", consumer=None, only_consumer="e0", consumers=1, body=BODY)
    assert type(route) is GoLocal
    assert route.decision == "local_one_engine"
    echo = machine.producer_placed(
        "e0", consumer=None, only_consumer="e0", consumers=1, body={**BODY, "echo": True}
    )
    assert type(echo) is Prefill
    assert not echo.asks_descriptor  # its producer decodes too: no descriptor, no blocks held
    with pytest.raises(NoCapacity):
        machine.producer_placed("e0", consumer=None, only_consumer=None, consumers=0, body=BODY)


def test_a_descriptor_past_the_lease_is_never_handed_off() -> None:
    machine = _attempting(max_attempts=1, credits=0)
    machine.prefill_sent("e0")
    handoff = machine.prefill_answered("r", "e0", _result(), started=0.0)
    with pytest.raises(HandoffExpired, match="older than the producer's KV lease"):
        machine.handing_off("e1", now=LEASE_S + 1)
    assert handoff.fate is Fate.EXPIRED
    assert machine.leg_done() is handoff  # to the reclaim queue
    assert machine.attempts[0].handoff_fate == "expired"
