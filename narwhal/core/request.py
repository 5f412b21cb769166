"""One request's life as a pure machine, h11's way: the shell tells it what happened, as
one event at a time to its one entry point, ``handle``, and it answers what to do next. It
alone keeps the record of where the request stands (the lifecycle table of
``narwhal.core.lifecycle``, private to it) and of each attempt (the journal's lines).

It does no I/O and reads no clock: every time comes with the event that needs it. The trio
shell (``narwhal.router.request_run``) places legs (``narwhal.router.placer``), runs the
legs the machine asks for, and tells it what they did; the machine decides the route an
attempt takes with the engines placement named, whether a descriptor may still be decoded,
and what follows a fault, whether a leg raised it or the machine found it.

Events in (``narwhal.core.request_events``), actions out (``narwhal.core.request_actions``);
``handle``'s overloads say which event is answered with which: the attempt to make, its
route (one local leg, or a prefill and a handoff, every engine named), the descriptor's way
to its consumer, the descriptor left for the reclaim queue, and what follows a fault
(``Resume``, ``Retry`` after its delay, or ``End``: the fault is the request's answer).

A fault is returned, never raised: the machine answers the fault it finds as it answers a
leg's.

Rules it keeps, on every path (``tests/unit/core/test_request_machine.py`` drives event
sequences with hypothesis; the invariants are those of docs/contract.md section 8):

1. a request ends once, with one outcome;
3. no retry after output; a resume continues from exactly the tokens the client got;
4. a retry spends the router's budget and avoids the engines that failed the request;
6. a descriptor goes to at most one decode leg, and never once older than the lease allows;
7. a descriptor no decode leg took goes to the reclaim queue;
11. a queued request leaves the queue once.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from narwhal.core import request_events as ev
from narwhal.core import resume
from narwhal.core.config import FleetConfig
from narwhal.core.disaggregation import Decision, wants_prompt_side
from narwhal.core.faults import (
    BreakerClass,
    HandoffExpired,
    NoCapacity,
    Phase,
    RequestFault,
)
from narwhal.core.handoff import Fate, Handoff, age_limit, too_old
from narwhal.core.lifecycle import Input, InvalidTransition, Lifecycle, Standing
from narwhal.core.records import AttemptLine
from narwhal.core.request_actions import (
    CONTINUE,
    FRESH,
    AfterFault,
    Continue,
    Decode,
    End,
    Fresh,
    GoLocal,
    PlaceProducer,
    Prefill,
    Resume,
    Retry,
)
from narwhal.core.request_owner import PHASE_OF
from narwhal.core.retry import RetryBudget, RetryDecision, retry_decision


class RequestMachine:
    """One prefill/decode chain of a client request (a fan-out runs one per choice)."""

    __slots__ = (
        "_asks_descriptor",
        "_at",
        "_budget",
        "_chat",
        "_config",
        "_counted",
        "_crossed",
        "_handoff",
        "_life",
        "_new_kept",
        "_queued",
        "_rng",
        "attempts",
        "body",
        "continuation",
        "deadline",
        "failed_engines",
        "fanout_index",
        "kept",
        "refused",
        "resumes",
    )

    def __init__(
        self,
        config: FleetConfig,
        *,
        deadline: float,
        budget: RetryBudget,
        rng: random.Random,
        body: Mapping[str, Any],
        chat: bool,
        new_kept: Callable[[], ev.KeptStream] | None = None,
        fanout_index: int | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self._config = config  # taken once, at admission: a reload applies to new requests
        self._budget = budget
        self._rng = rng
        self.body, self._chat = body, chat
        self.deadline = deadline
        self._life = lifecycle or Lifecycle()
        self.fanout_index = fanout_index  # a fan-out's sub-request: the choice it answers
        self.attempts: list[AttemptLine] = []
        # a tuple: most requests see none fail, and an empty set is 216 bytes held a stream
        self.failed_engines: tuple[str, ...] = ()
        # stream resume: what the stream keeps to continue (None: resume off), why it may
        # not, the continuation's body once one is decided, and how many were made
        self._new_kept = new_kept
        self.kept = None if new_kept is None else new_kept()
        self.refused = None if new_kept is None else resume.refusal(body, chat=chat)
        self.continuation: dict[str, Any] | None = None
        self.resumes = 0
        self._counted = False  # how a resumed stream ended is counted once
        self._handoff: Handoff | None = None  # the running attempt's descriptor
        self._asks_descriptor = True  # the running attempt's prefill asked for one
        self._crossed = False  # the running attempt's decode leg carries the descriptor
        self._queued = True
        self._at: ev.Step = "closed"

    # ---- the one entry point ---------------------------------------------------------------

    @overload
    def handle(self, event: ev.Told) -> None: ...
    @overload
    def handle(self, event: ev.NextAttempt) -> Fresh | Continue: ...
    @overload
    def handle(self, event: ev.ConsumerPlaced) -> GoLocal | PlaceProducer: ...
    @overload
    def handle(self, event: ev.ProducerPlaced) -> GoLocal | Prefill | AfterFault: ...
    @overload
    def handle(self, event: ev.ContinuationPlaced) -> Prefill | AfterFault: ...
    @overload
    def handle(self, event: ev.PrefillAnswered) -> Handoff | None: ...
    @overload
    def handle(self, event: ev.DecodeDue) -> Decode | AfterFault: ...
    @overload
    def handle(self, event: ev.LegsDone) -> Handoff | None: ...
    @overload
    def handle(self, event: ev.LegFailed) -> AfterFault: ...
    @overload
    def handle(self, event: ev.Ending | ev.StreamEnded) -> bool: ...
    @overload
    def handle(self, event: ev.ClientLeft) -> Phase: ...
    def handle(self, event: ev.Event) -> object:
        """What happened, answered with what to do next. An event the request's state does
        not allow raises ``InvalidTransition``: a bug of the shell, not the request's."""
        kind = type(event)
        allowed = ev.STEPS.get(kind)
        if allowed is not None and self._at not in allowed:
            raise InvalidTransition(f"{kind.__name__} while the attempt is {self._at}")
        if self._life.finished and kind is not ev.LegsDone and kind is not ev.StreamEnded:
            raise InvalidTransition(f"{kind.__name__} after the request ended")
        if kind is ev.FirstToken:  # the per-token path's two, first
            self._life.advance(Input.FIRST_TOKEN)
        elif kind is ev.Committed:
            self._life.advance(Input.COMMIT)
        elif kind is ev.NextAttempt:
            return self._attempt()
        elif kind is ev.Dispatched:
            if not self._queued:
                raise InvalidTransition("dispatched twice")
            self._queued = False
        elif isinstance(event, ev.ConsumerPlaced):
            self._fresh(True)
            if event.decision == "disaggregated":
                return PlaceProducer(event.consumer)
            return self._go_local(event.consumer, event.decision)
        elif isinstance(event, ev.ProducerPlaced):
            self._fresh(True)
            return self._producer_placed(event)
        elif isinstance(event, ev.ContinuationPlaced):
            self._fresh(False)
            return self._continuation_placed(event)
        elif isinstance(event, ev.PrefillAnswered):
            return self._prefill_answered(event)
        elif isinstance(event, ev.DecodeDue):
            return self._decode_due(event)
        elif kind is ev.DecodeTaken:
            if self._crossed and self._handoff is not None:
                self._handoff.fate = Fate.DECODED
        elif isinstance(event, ev.DecodeFailed):
            self._decode_failed(event.consumer, event.fault)
        elif kind is ev.LegsDone:
            return self._legs_done()
        elif isinstance(event, ev.LegFailed):
            return self._failed(event.fault, event.now, event.view)
        elif kind is ev.StreamEnded:
            return self._stream_ended()
        elif kind is ev.Finished:
            committed = self._finish()
            self._at = "closed"
            return committed
        elif kind is ev.GaveUp:
            committed = self._life.committed
            self._life.advance(Input.FAIL)
            return committed
        else:
            assert kind is ev.ClientLeft, kind
            phase = self.phase
            self._life.advance(Input.CANCEL)
            return phase
        return None

    # ---- where it stands (read only) -------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return PHASE_OF[self._life.state]

    @property
    def standing(self) -> Standing:
        """Where it stands, to read (``Lifecycle``, as its read-only ``Standing``)."""
        return self._life

    @property
    def step(self) -> ev.Step:
        return self._at

    @property
    def attempt_line(self) -> AttemptLine:
        return self.attempts[-1]

    def only_engine(self, candidates: Sequence[str]) -> str | None:
        """The one of ``candidates`` it has not seen fail (or of all, if none), if one."""
        usable = [e for e in candidates if e not in self.failed_engines] or candidates
        return usable[0] if len(usable) == 1 else None

    def wants_other_consumer(
        self, consumer: str, decision: Decision, producers: Callable[[], Sequence[str]]
    ) -> bool:
        """Decode first chose ``consumer`` for a disaggregated attempt, but the one producer
        left (of ``producers``, asked only then) is that engine itself: another consumer, if
        there is one, makes it a handoff instead of a local attempt on the producer."""
        return decision == "disaggregated" and self.only_engine(producers()) == consumer

    def _fresh(self, fresh: bool) -> None:
        if (self.continuation is None) != fresh:
            raise InvalidTransition("a fresh attempt's placement for a continuation, or back")

    # ---- attempts --------------------------------------------------------------------------

    def _attempt(self) -> Fresh | Continue:
        """The next attempt's record; a continuation when a resume was decided."""
        if self._queued or self._handoff is not None:  # a descriptor is never dropped
            raise InvalidTransition("an attempt before dispatch, or before LegsDone")
        line = AttemptLine(number=len(self.attempts) + 1, fanout_index=self.fanout_index)
        self.attempts.append(line)
        self._at, self._crossed = "placing", False
        if self.continuation is None:
            if self._new_kept is not None and line.number > 1:
                # a retry: nothing of the failed attempt reached the client, whose stream
                # will have this attempt's id
                self.kept = self._new_kept()
            return FRESH
        assert self.kept is not None  # a continuation is decided only with resume on
        line.resumed_at_token = len(self.kept.ids)
        return CONTINUE

    def _may_go_local(self) -> bool:
        """Whether this attempt may run as one leg: not a continuation, which is built for
        a producer, and not an answer that needs the producer's prompt side."""
        return self.continuation is None and not wants_prompt_side(self.body)

    def _go_local(self, consumer: str, decision: Decision) -> GoLocal:
        """One leg, sent now: the lifecycle passes the prefill and the handoff at once."""
        for step in (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH):
            self._life.advance(step)
        line = self.attempt_line
        line.consumer, line.local = consumer, True
        self._at = "decoding"
        return GoLocal(consumer, decision)

    def _prefill(self, producer: str, consumer: str | None, asks_descriptor: bool) -> Prefill:
        """The prefill leg, sent now; ``asks_descriptor``: it asks for one."""
        self._life.advance(Input.PREFILL)
        self.attempt_line.producer = producer
        self._asks_descriptor = asks_descriptor
        self._at = "prefilling"
        return Prefill(producer, consumer, asks_descriptor=asks_descriptor)

    def _producer_placed(self, placed: ev.ProducerPlaced) -> GoLocal | Prefill | AfterFault:
        """The route once a producer is placed. Two legs go to two engines: when the only
        engine that may decode is the producer, it runs alone, as a handoff to itself
        would leave the prefill's blocks held for the lease; an answer that needs the
        prefill leg takes both legs there, its prefill asking for no descriptor."""
        producer, consumer = placed.producer, placed.consumer
        if consumer is None and placed.consumers == 0:
            # no consumer to decode: refuse now rather than pin KV nobody will read
            fault = NoCapacity("no placeable consumer engine", phase=Phase.ADMISSION)
            return self._failed(fault, placed.now, None)  # before output: no resume
        alone = consumer if consumer is not None else placed.only_consumer
        if producer != alone:
            return self._prefill(producer, consumer, True)
        if self._may_go_local():
            return self._go_local(producer, "local_one_engine")
        return self._prefill(producer, consumer, False)

    def _continuation_placed(self, placed: ev.ContinuationPlaced) -> Prefill | AfterFault:
        """A continuation decodes on a consumer that has not failed this request, within
        its context: a handoff between two engines, or both legs on one (the consumer is
        the only producer left) with no descriptor asked for."""
        consumer = placed.consumer
        if consumer in self.failed_engines:
            message = "no placeable consumer engine but the failed"
            return self._failed(NoCapacity(message, phase=Phase.STREAM), placed.now, placed.view)
        assert self.continuation is not None
        try:
            resume.within_context(self.continuation, placed.context)
        except ValueError as exc:
            message = f"no continuation on engine {consumer}: {exc}"
            return self._failed(NoCapacity(message, phase=Phase.STREAM), placed.now, placed.view)
        return self._prefill(placed.producer, consumer, placed.producer != consumer)

    # ---- the legs --------------------------------------------------------------------------

    def _prefill_answered(self, answer: ev.PrefillAnswered) -> Handoff | None:
        """The producer's answer is in hand, and its descriptor, if one was asked for (its
        age counts from the prefill's start); None: no descriptor, nothing to hand off."""
        self._life.advance(Input.DESCRIPTOR)
        self._at = "handing_off"
        if not self._asks_descriptor:
            return None
        number = self.attempt_line.number
        handoff = Handoff(answer.rid, number, answer.producer, answer.result, answer.started)
        self._handoff = handoff
        return handoff

    def _decode_due(self, due: ev.DecodeDue) -> Decode | AfterFault:
        """The descriptor's way to ``consumer``, or what follows the fault that it is too
        old for it (past the lease the producer may have freed the blocks: a read gives
        garbage). A prefill that asked for none decodes where it is, with nothing to hand
        off."""
        handoff, consumer, now = self._handoff, due.consumer, due.now
        self.attempt_line.consumer = consumer
        if handoff is None:
            self._life.advance(Input.DISPATCH)
            self._at = "decoding"
            return Decode(consumer, None, crossed=False)
        age = handoff.age(now)
        bounds = {
            "handoff_timeout_s": self._config.serving.handoff_timeout_s,
            "lease_limit_s": self._config.engine.lease_limit_s,
        }
        reason = too_old(age, **bounds)
        if reason is not None:
            handoff.fate = Fate.EXPIRED
            message = f"KV handoff expired: descriptor is {age:.3f}s old, {reason}"
            return self._failed(HandoffExpired(message, phase=Phase.HANDOFF), now, due.view)
        self._life.advance(Input.DISPATCH)
        self._at = "decoding"
        self._crossed = consumer != handoff.producer
        return Decode(consumer, handoff, self._crossed, handoff.send_by(age_limit(**bounds)))

    def _decode_failed(self, consumer: str, fault: RequestFault) -> None:
        """Its reclaim goes elsewhere: a consumer that just failed this descriptor would
        most likely fail the reclaim too. A handoff clock that fired before the decode
        request was sent (``HandoffExpired``) left the descriptor unsent: expired."""
        handoff = self._handoff
        if handoff is not None:
            handoff.failed_consumer = consumer
            if isinstance(fault, HandoffExpired):
                handoff.fate = Fate.EXPIRED

    def _legs_done(self) -> Handoff | None:
        """The handoff is over: its fate to the journal, and one nobody decoded returned
        for the reclaim queue (invariant 7)."""
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return None
        self.attempt_line.handoff_fate = handoff.fate.value
        return None if handoff.fate is Fate.DECODED else handoff

    # ---- what follows a fault --------------------------------------------------------------

    def _failed(self, fault: RequestFault, now: float, view: ev.RunView | None) -> AfterFault:
        """A resume for a stream that failed after output (when allowed), else a retry
        before output (when every rule allows one), else the end."""
        self._at = "closed"
        if self._resumable():
            assert view is not None  # told with every event that may follow output
            reason = self._resume_refusal(fault, now, view)
            self.attempt_line.resume = reason or "resumed"
            if reason is None:
                self.attempt_line.error, self.attempt_line.phase = fault.message, fault.phase
                self.resumes += 1
                self._life.advance(Input.RESUME)
                return Resume(fault)
        else:
            reason = None
        decision = self._retry(fault, now)
        if not decision.retry:
            self._at = "ended"  # no attempt after it: the shell tells the client
            return End(fault, decision.reason if fault.transient else None, reason)
        self._life.advance(Input.RETRY)
        return Retry(fault, decision.delay_s)

    def _resumable(self) -> bool:
        if self.kept is None or not self._life.output_seen or self._life.finished:
            return False
        consumer = self.attempt_line.consumer
        if consumer is not None:  # the continuation decodes elsewhere
            self._failed_on(consumer)
        return True

    def _resume_refusal(self, fault: RequestFault, now: float, view: ev.RunView) -> str | None:
        kept = self.kept
        assert kept is not None
        refusal = self.refused or kept.refusal()
        if refusal is not None:
            return refusal
        allowed = self._config.recovery.resume_streams
        if self.resumes >= allowed:
            return "resumes spent"
        try:
            assert kept.prompt_ids is not None  # kept.refusal() says so
            continuation = resume.continuation(
                self.body, chat=self._chat, prompt_ids=kept.prompt_ids, sent_ids=kept.sent()
            )
        except ValueError as exc:  # the limit was reached, or there is none to give
            return str(exc)
        if all(c in self.failed_engines for c in view.consumers()):
            return "no other consumer"
        reason = resume.after(
            fault,
            resumes=self.resumes,
            allowed=allowed,
            remaining_s=self.deadline - now,
            needed_s=view.needed_s,
            budget=self._budget,
        )
        if reason is None:
            self.continuation = continuation
        return reason

    def _retry(self, fault: RequestFault, now: float) -> RetryDecision:
        """The retry decision, written into the attempt's record."""
        if fault.engine_id is not None and fault.breaker is not BreakerClass.NONE:
            self._failed_on(fault.engine_id)
        serving = self._config.serving
        decision = retry_decision(
            fault,
            attempt=len(self.attempts),
            max_attempts=serving.max_attempts,
            output_seen=self._life.output_seen,
            remaining_s=self.deadline - now,
            backoff_base_s=serving.retry_backoff_s,
            budget=self._budget,
            rng=self._rng,
        )
        line = self.attempt_line
        line.error, line.phase, line.retry = fault.message, fault.phase, decision.reason
        return decision

    def _failed_on(self, engine: str) -> None:
        if engine not in self.failed_engines:
            self.failed_engines += (engine,)

    def _stream_ended(self) -> bool:
        """A resumed stream ended: True the first time (its outcome is counted once)."""
        if not self.resumes or self._counted:
            return False
        self._counted = True
        return True

    def _finish(self) -> bool:
        """The answer is complete; True when it was committed before (a stream's end)."""
        life = self._life
        committed = life.committed
        if not committed:  # a JSON answer, or the first output and [DONE] in one read
            life.advance(Input.COMMIT)
        life.advance(Input.DONE)
        return committed
