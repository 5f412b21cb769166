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
from hypothesis import event as event_note
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
from narwhal.core.lifecycle import InvalidTransition, State
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import (
    Continue,
    Decode,
    End,
    Fresh,
    GoLocal,
    Prefill,
    Resume,
    Retry,
)
from narwhal.core.request_events import (
    CLIENT_LEFT,
    COMMITTED,
    DECODE_TAKEN,
    DISPATCHED,
    FINISHED,
    FIRST_TOKEN,
    GAVE_UP,
    LEGS_DONE,
    NEXT_ATTEMPT,
    STREAM_ENDED,
    ConsumerPlaced,
    ContinuationPlaced,
    DecodeDue,
    DecodeFailed,
    LegFailed,
    PrefillAnswered,
    ProducerPlaced,
)
from narwhal.core.request_owner import outcome_of
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


class _View:
    """The shell's side a resume reads: every engine may decode; the first output came at
    once."""

    needed_s = 0.0

    def consumers(self) -> list[str]:
        return list(ENGINES)


VIEW = _View()


def _machine(
    max_attempts: int, resume_streams: int, credits: int, body: dict[str, Any] = BODY
) -> RequestMachine:
    return RequestMachine(
        _config(max_attempts, resume_streams),
        deadline=DEADLINE_S,
        budget=RetryBudget(float(credits), 0.0),
        rng=random.Random(0),
        body=body,
        chat=False,
        new_kept=_Kept if resume_streams else None,
    )


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
    pool = [e for e in ENGINES if e not in machine.failed_engines] or list(ENGINES)
    pool = [e for e in pool if e != apart_from] or pool
    return data.draw(st.sampled_from(pool))


def _end(machine: RequestMachine, life: Life, how: str) -> None:
    life.ends.append(how)
    assert machine.standing.finished


def _live(data: st.DataObject, machine: RequestMachine, life: Life, kept: bool) -> None:
    """Drive the machine through one request, as ``RequestRun`` does."""
    if data.draw(st.booleans(), label="leaves while queued"):
        machine.handle(CLIENT_LEFT)
        _end(machine, life, "cancelled")
        return
    machine.handle(DISPATCHED)
    with pytest.raises(InvalidTransition):  # it left the queue once
        machine.handle(DISPATCHED)
    now = 0.0
    while True:
        step = machine.handle(NEXT_ATTEMPT)
        line = machine.attempt_line
        if data.draw(st.booleans(), label="a token told before the decode leg"):
            with pytest.raises(InvalidTransition):  # output comes from a dispatched decode leg
                machine.handle(FIRST_TOKEN)
            with pytest.raises(InvalidTransition):  # and is committed once, after it came
                machine.handle(COMMITTED)
        life.saw(line.number == len(machine.attempts), "attempts are numbered in order")
        handoff: Handoff | None = None
        decode_taken = False
        leg_engine = "e0"
        phase = Phase.ADMISSION
        after: Resume | Retry | End | None = None
        try:
            if type(step) is Continue:
                life.saw(machine.standing.output_seen, "a continuation only after output")
                consumer = _place(data, machine)
                producer = _place(data, machine, apart_from=consumer)
                context = data.draw(st.sampled_from([None, 4, 4096]), label="context")
                placed = ContinuationPlaced(producer, consumer, context, now, VIEW)
                route = machine.handle(placed)
            else:
                life.saw(type(step) is Fresh, "an attempt is fresh or a continuation")
                life.saw(not machine.standing.output_seen, "a fresh attempt only before output")
                producer = _place(data, machine)
                decode_first = data.draw(st.none() | st.sampled_from(ENGINES))
                consumers = data.draw(st.sampled_from([0, len(ENGINES)]), label="consumers")
                if decode_first is not None:
                    consumers = 1
                route = machine.handle(ProducerPlaced(producer, decode_first, None, consumers, now))
            if isinstance(route, Resume | Retry | End):
                life.saw(type(route.fault) is NoCapacity, "placement's fault: no capacity")
                after = route
                raise route.fault
            if isinstance(route, GoLocal):
                life.saw(machine.attempt_line.local, "a local attempt is recorded so")
                leg_engine, phase = route.consumer, Phase.DECODE
            else:
                leg_engine, phase = route.producer, Phase.PREFILL
                life.saw(
                    route.asks_descriptor or route.consumer == route.producer,
                    "no descriptor asked for only where one engine runs both legs",
                )
                life.saw(machine.attempt_line.producer == route.producer, "its producer recorded")
                started = now
                if data.draw(st.booleans(), label="prefill fails"):
                    raise _fault(data, phase, leg_engine)
                now += data.draw(st.floats(0, 2 * LEASE_S), label="prefill and placement")
                handoff = machine.handle(PrefillAnswered("r", route.producer, _result(), started))
                life.saw(
                    (handoff is not None) == route.asks_descriptor, "a descriptor iff asked for"
                )
                if handoff is not None:
                    life.handoffs.append(handoff)
                consumer = route.consumer or _place(data, machine, apart_from=route.producer)
                phase = Phase.HANDOFF
                decode = machine.handle(DecodeDue(consumer, now, VIEW))
                if not isinstance(decode, Decode):
                    expired = handoff is not None and handoff.age(now) > LIMIT_S
                    life.saw(expired, "a descriptor expires past the lease only")
                    life.saw(handoff is not None and handoff.fate is Fate.EXPIRED, "expired")
                    life.saw(type(decode.fault) is HandoffExpired, "the fault says so")
                    after = decode
                    raise decode.fault
                if handoff is not None:
                    life.saw(
                        handoff.age(now) <= LIMIT_S, "invariant 6: never handed off past the lease"
                    )
                    if decode.crossed:  # the handoff clock bounds the send, from the prefill
                        life.saw(decode.send_by == handoff.started + LIMIT_S, "handoff clock")
                leg_engine, phase = consumer, Phase.DECODE
                if decode.crossed and data.draw(st.booleans(), label="clock fires before send"):
                    late = HandoffExpired("KV handoff expired: not sent", phase=Phase.HANDOFF)
                    machine.handle(DecodeFailed(consumer, late))
                    life.saw(handoff is not None and handoff.fate is Fate.EXPIRED, "unsent")
                    raise late
                if data.draw(st.booleans(), label="consumer refuses"):
                    fault = _fault(data, phase, consumer)
                    machine.handle(DecodeFailed(consumer, fault))
                    raise fault
                machine.handle(DECODE_TAKEN)
                decode_taken = True
                if decode.crossed:
                    key = id(handoff)
                    life.decode_legs[key] = life.decode_legs.get(key, 0) + 1
            # the decode leg streams
            tokens = data.draw(st.integers(0, 5), label="tokens before the leg ends")
            if tokens and not machine.standing.output_seen:
                machine.handle(FIRST_TOKEN)
            if tokens and machine.standing.state is State.GENERATING:
                machine.handle(COMMITTED)  # a stream commits at its first token
            if tokens and data.draw(st.booleans(), label="the first token told again"):
                with pytest.raises(InvalidTransition):  # one first token, one commit point
                    machine.handle(FIRST_TOKEN)
                with pytest.raises(InvalidTransition):
                    machine.handle(COMMITTED)
            if machine.kept is not None:
                machine.kept.ids.extend(
                    range(len(machine.kept.ids), len(machine.kept.ids) + tokens)
                )
            ending = data.draw(st.sampled_from(["done", "fault", "client"]), label="leg ends")
            if ending == "client":
                machine.handle(CLIENT_LEFT)
                _end(machine, life, "cancelled")
                return
            if ending == "fault" or not machine.standing.output_seen:
                raise _fault(
                    data, Phase.STREAM if machine.standing.output_seen else phase, leg_engine
                )
            machine.handle(FINISHED)
            _end(machine, life, "completed")
            return
        except RequestFault as fault:
            output = machine.standing.output_seen
            if after is None:  # a leg's fault; the machine's own came answered
                after = machine.handle(LegFailed(fault, now, VIEW))
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
                machine.handle(GAVE_UP)
                _end(machine, life, outcome_of(fault))
                return
        finally:
            if handoff is not None:
                orphan = machine.handle(LEGS_DONE)
                if decode_taken and handoff.result is not None and orphan is None:
                    life.saw(handoff.fate is Fate.DECODED, "a taken descriptor is decoded")
                else:
                    life.saw(orphan is handoff, "invariant 7: to the reclaim queue")
                    life.orphans.append(handoff)
            if not machine.standing.finished:
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
    body = data.draw(st.sampled_from([BODY, ECHO]), label="body")
    machine = _machine(max_attempts, resume_streams, credits, body)
    budget = machine._budget
    life = Life()
    _live(data, machine, life, kept=resume_streams > 0)
    assert life.broken == []  # every step's rule held (invariants 3, 4, 6 and 7 as it went)
    assert len(life.ends) == 1  # invariant 1
    assert machine.standing.finished
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
    machine = _machine(max_attempts, 0, credits)
    machine.handle(DISPATCHED)
    machine.handle(NEXT_ATTEMPT)
    return machine


def test_a_retry_goes_to_engines_that_have_not_failed() -> None:
    machine = _attempting(max_attempts=3, credits=5)
    machine.handle(ProducerPlaced("e0", "e1", None, 1, 0.0))
    fault = PrefillTimeout("slow", phase=Phase.PREFILL, engine_id="e0")
    after = machine.handle(LegFailed(fault, 1.0, VIEW))
    assert type(after) is Retry
    assert after.fault is fault
    assert machine.failed_engines == ("e0",)
    assert machine.attempts[0].retry == "retry"
    assert machine.attempts[0].error == "slow"


def test_a_handoff_to_its_own_producer_runs_alone_unless_it_needs_the_prefill() -> None:
    route = _attempting(max_attempts=1, credits=0).handle(ProducerPlaced("e0", None, "e0", 1, 0))
    assert type(route) is GoLocal
    assert route.decision == "local_one_engine"
    echo = _machine(1, 0, 0, ECHO)
    echo.handle(DISPATCHED)
    echo.handle(NEXT_ATTEMPT)
    both = echo.handle(ProducerPlaced("e0", None, "e0", 1, 0.0))
    assert type(both) is Prefill
    assert not both.asks_descriptor  # its producer decodes too: no descriptor, no blocks held
    alone = _attempting(max_attempts=1, credits=0).handle(ProducerPlaced("e0", None, None, 0, 0))
    assert type(alone) is End  # no consumer: refused now rather than pin KV nobody reads
    assert type(alone.fault) is NoCapacity


def test_a_descriptor_past_the_lease_is_never_handed_off() -> None:
    machine = _attempting(max_attempts=1, credits=0)
    machine.handle(ProducerPlaced("e0", "e1", None, 1, 0.0))
    handoff = machine.handle(PrefillAnswered("r", "e0", _result(), started=0.0))
    assert handoff is not None
    after = machine.handle(DecodeDue("e1", LEASE_S + 1, VIEW))
    assert type(after) is End  # the fault is returned, answered: here, no attempt is left
    assert type(after.fault) is HandoffExpired
    assert "older than the producer's KV lease" in after.fault.message
    assert handoff.fate is Fate.EXPIRED
    assert machine.handle(LEGS_DONE) is handoff  # to the reclaim queue
    assert machine.attempts[0].handoff_fate == "expired"


# ---- any sequence of events -----------------------------------------------------------------

_ENGINE = st.sampled_from(ENGINES)
_NOW = st.floats(0, 2 * LEASE_S)
_FAULT = st.sampled_from(
    [
        PrefillTimeout("slow", phase=Phase.PREFILL, engine_id="e0"),
        EngineUnreachable("down", phase=Phase.DECODE, engine_id="e1"),
        StreamBroken("cut", phase=Phase.STREAM, engine_id="e2"),
        EngineStatusError(400, "bad", phase=Phase.DECODE, engine_id="e1"),
    ]
)
EVENTS = st.one_of(
    st.sampled_from(
        [
            DISPATCHED,
            NEXT_ATTEMPT,
            DECODE_TAKEN,
            LEGS_DONE,
            FIRST_TOKEN,
            COMMITTED,
            STREAM_ENDED,
            FINISHED,
            GAVE_UP,
            CLIENT_LEFT,
        ]
    ),
    st.builds(ConsumerPlaced, _ENGINE, st.sampled_from(["disaggregated", "local_short"])),
    st.builds(
        ProducerPlaced, _ENGINE, st.none() | _ENGINE, st.none() | _ENGINE, st.integers(0, 2), _NOW
    ),
    st.builds(
        ContinuationPlaced, _ENGINE, _ENGINE, st.sampled_from([None, 4, 4096]), _NOW, st.just(VIEW)
    ),
    st.builds(PrefillAnswered, st.just("r"), _ENGINE, st.just(_result()), _NOW),
    st.builds(DecodeDue, _ENGINE, _NOW, st.just(VIEW)),
    st.builds(DecodeFailed, _ENGINE, _FAULT),
    st.builds(LegFailed, _FAULT, _NOW, st.just(VIEW)),
)


def _next(machine: RequestMachine) -> st.SearchStrategy[Any]:
    """An event the request's state may well allow: the shell's way through a life."""
    step = machine.step
    if step == "closed":
        return st.sampled_from([DISPATCHED, NEXT_ATTEMPT, LEGS_DONE])
    if step == "placing":
        if machine.continuation is not None:
            return st.builds(
                ContinuationPlaced, _ENGINE, _ENGINE, st.just(4096), _NOW, st.just(VIEW)
            )
        return st.builds(ProducerPlaced, _ENGINE, st.none() | _ENGINE, st.none(), st.just(2), _NOW)
    if step == "prefilling":
        return st.builds(PrefillAnswered, st.just("r"), _ENGINE, st.just(_result()), _NOW)
    if step == "handing_off":
        return st.builds(DecodeDue, _ENGINE, _NOW, st.just(VIEW))
    if step == "decoding":
        if not machine.standing.output_seen:
            return st.sampled_from([DECODE_TAKEN, FIRST_TOKEN])
        if machine.standing.state is State.GENERATING:
            return st.just(COMMITTED)
        return st.sampled_from([FINISHED, LEGS_DONE]) | st.builds(
            LegFailed, _FAULT, _NOW, st.just(VIEW)
        )
    return st.just(GAVE_UP)


@settings(max_examples=500, deadline=None)
@given(
    data=st.data(),
    max_attempts=st.integers(1, 3),
    credits=st.integers(0, 3),
    resume_streams=st.integers(0, 2),
)
def test_any_sequence_of_events_keeps_the_rules(
    data: st.DataObject, max_attempts: int, credits: int, resume_streams: int
) -> None:
    """Events in any order, as a buggy or hostile shell could tell them (half of them drawn
    from what the request's state allows, to reach deep lives): each one the state allows
    is answered, any other raises ``InvalidTransition`` and changes nothing of where it
    stands; on every path the rules hold."""
    machine = _machine(max_attempts, resume_streams, credits)
    fresh = retries = resumes = 0
    decoded: list[Handoff] = []  # the descriptors decode legs were given
    reclaimed: list[Handoff] = []
    for _ in range(data.draw(st.integers(0, 40), label="events")):
        likely = data.draw(st.booleans(), label="an event the state allows")
        event = data.draw(_next(machine) if likely else EVENTS, label="event")
        state, output_seen, finished = (
            machine.standing.state,
            machine.standing.output_seen,
            machine.standing.finished,
        )
        try:
            answer = machine.handle(event)
        except InvalidTransition:
            assert machine.standing.state is state  # refused whole
            continue
        if finished:  # invariant 1: an ended request stays ended, once
            assert machine.standing.state is State.FINISHED
        event_note(type(answer).__name__)
        if type(answer) is Fresh:
            fresh += 1
        elif type(answer) is Retry:
            assert not output_seen  # invariant 3: no retry after output
            retries += 1
        elif type(answer) is Resume:
            assert output_seen
            assert machine.kept is not None
            resumes += 1
        elif isinstance(answer, Decode) and answer.handoff is not None:
            assert answer.handoff.age(event.now) <= LIMIT_S  # invariant 6: within the lease
            if answer.crossed:
                assert answer.handoff not in decoded  # invariant 6: one decode leg each
                decoded.append(answer.handoff)
        elif isinstance(answer, Handoff) and type(event) is type(LEGS_DONE):
            assert answer.fate is not Fate.DECODED  # invariant 7: only what nobody decoded
            assert answer not in reclaimed  # once
            reclaimed.append(answer)
        if machine.kept is not None and type(event) is type(FIRST_TOKEN):
            machine.kept.ids.append(len(machine.kept.ids))  # what the client got
    assert fresh <= max_attempts  # invariant 4: bounded, and paid for
    assert retries + resumes <= credits
    assert resumes <= resume_streams
