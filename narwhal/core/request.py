"""One request's life as a pure machine, h11's way: the shell tells it what happened, it
answers what to do next, and it keeps the record of where the request stands (the
lifecycle table of ``narwhal.core.lifecycle``) and of each attempt (the journal's lines).

It does no I/O and reads no clock: every time comes with the event that needs it. The trio
shell (``narwhal.router.request_run``) places legs (``narwhal.router.placer``), runs the
legs the machine asks for, and feeds it what they did; the machine decides what an attempt
does with the engines placement named, whether a descriptor may still be decoded, and what
follows a fault.

Events in, actions out (the actions' classes: ``narwhal.core.request_actions``):

* ``dispatched()``: the admission queue let the request go (it leaves the queue once);
* ``attempt()``: the next attempt's record; ``Fresh``, or a stream's ``Continue``;
* ``consumer_placed(consumer, decision)``, ``producer_placed(producer, ...)``: the route,
  ``GoLocal`` (one leg to the consumer, which computes the prompt itself) or ``Prefill``
  (a producer leg, then a handoff);
* ``prefill_answered(...)``: the descriptor, as a ``Handoff`` whose age counts from the
  prefill's start;
* ``handing_off(consumer, now)``: ``Decode`` (the consumer, with the descriptor, or
  without it when one engine runs both legs) or the ``HandoffExpired`` fault;
* ``decode_taken()``: the consumer took the descriptor: reading its blocks is its job;
* ``first_token()``: the decode leg's first output (no retry from here); ``commit()``: the
  200 headers went out (the commit point);
* ``leg_done()``: the descriptor nobody decoded, for the reclaim queue (or None);
* ``failed(fault, ...)``: ``Resume`` (a continuation of the stream), ``Retry`` (after its
  delay) or ``End`` (the fault is the request's answer);
* ``finish()``: the answer is complete; ``cancelled()``: the client left, or the deadline
  or the drain ended it (the shell's cancel scopes have cancelled its legs).

Rules it keeps, on every path (``tests/unit/core/test_request_machine.py`` walks them with
hypothesis; the invariants are those of docs/contract.md section 8):

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
from typing import Any, Protocol

from narwhal.core import resume
from narwhal.core.config import FleetConfig
from narwhal.core.connector import PrefillResult
from narwhal.core.disaggregation import Decision, wants_prompt_side
from narwhal.core.faults import (
    BreakerClass,
    DeadlineExpired,
    HandoffExpired,
    NoCapacity,
    NotDispatched,
    Phase,
    RequestFault,
)
from narwhal.core.handoff import Fate, Handoff, age_limit, too_old
from narwhal.core.lifecycle import Input, InvalidTransition, Lifecycle, State
from narwhal.core.records import AttemptLine, Outcome
from narwhal.core.request_actions import (
    CONTINUE,
    FRESH,
    RESUME,
    AfterFault,
    Continue,
    Decode,
    End,
    Fresh,
    GoLocal,
    Prefill,
    Retry,
)
from narwhal.core.retry import RetryBudget, RetryDecision, retry_decision

PHASE_OF = {
    State.ADMITTED: Phase.ADMISSION,
    State.PREFILLING: Phase.PREFILL,
    State.HANDOFF: Phase.HANDOFF,
    State.DECODING: Phase.DECODE,
    State.GENERATING: Phase.STREAM,
    State.COMMITTED: Phase.STREAM,
    State.FINISHED: Phase.STREAM,
}


def outcome_of(fault: RequestFault) -> Outcome:
    """How a request that ends with ``fault`` is recorded: a request the queue never let
    go to an engine was rejected, one past its deadline expired, any other failed."""
    if isinstance(fault, DeadlineExpired):
        return "expired"
    return "rejected" if isinstance(fault, NotDispatched) else "failed"


class KeptStream(Protocol):
    """What a stream kept for a resume (``narwhal.stream.continuation.Kept``)."""

    @property
    def prompt_ids(self) -> list[int] | None: ...
    @property
    def ids(self) -> list[int]: ...
    def sent(self) -> list[int]: ...
    def refusal(self) -> str | None: ...


# ---- the machine ---------------------------------------------------------------------------


class RequestMachine:
    """One prefill/decode chain of a client request (a fan-out runs one per choice)."""

    __slots__ = (
        "_asks_descriptor",
        "_budget",
        "_config",
        "_counted",
        "_handoff",
        "_new_kept",
        "_queued",
        "_rng",
        "attempts",
        "continuation",
        "deadline",
        "failed_engines",
        "fanout_index",
        "kept",
        "lifecycle",
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
        new_kept: Callable[[], KeptStream] | None = None,
        refused: str | None = None,
        fanout_index: int | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self._config = config  # taken once, at admission: a reload applies to new requests
        self._budget = budget
        self._rng = rng
        self.deadline = deadline
        self.lifecycle = lifecycle or Lifecycle()
        self.fanout_index = fanout_index  # a fan-out's sub-request: the choice it answers
        self.attempts: list[AttemptLine] = []
        self.failed_engines: set[str] = set()
        # stream resume: what the stream keeps to continue (None: resume off), why it may
        # not, the continuation's body once one is decided, and how many were made
        self._new_kept = new_kept
        self.kept = None if new_kept is None else new_kept()
        self.refused = refused
        self.continuation: dict[str, Any] | None = None
        self.resumes = 0
        self._counted = False  # how a resumed stream ended is counted once
        self._handoff: Handoff | None = None  # the running attempt's descriptor
        self._asks_descriptor = True  # the running attempt's prefill asked for one
        self._queued = True

    # ---- the queue -------------------------------------------------------------------------

    def dispatched(self) -> None:
        """The admission queue let it go: it leaves the queue once."""
        if not self._queued:
            raise InvalidTransition("dispatched twice")
        self._queued = False

    # ---- attempts --------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return PHASE_OF[self.lifecycle.state]

    @property
    def attempt_line(self) -> AttemptLine:
        return self.attempts[-1]

    def attempt(self) -> Fresh | Continue:
        """The next attempt's record; a continuation when a resume was decided."""
        if self._queued or self.lifecycle.finished:
            raise InvalidTransition("an attempt outside a dispatched, unfinished request")
        line = AttemptLine(number=len(self.attempts) + 1, fanout_index=self.fanout_index)
        self.attempts.append(line)
        if self.continuation is None:
            if self._new_kept is not None and line.number > 1:
                # a retry: nothing of the failed attempt reached the client, whose stream
                # will have this attempt's id
                self.kept = self._new_kept()
            return FRESH
        assert self.kept is not None  # a continuation is decided only with resume on
        line.resumed_at_token = len(self.kept.ids)
        return CONTINUE

    def usable(self, candidates: Sequence[str]) -> list[str]:
        """The candidates this request has not seen fail, or all of them if none is left."""
        return [e for e in candidates if e not in self.failed_engines] or list(candidates)

    def only_engine(self, candidates: Sequence[str]) -> str | None:
        """The one engine this request may still use among ``candidates``, if one."""
        usable = self.usable(candidates)
        return usable[0] if len(usable) == 1 else None

    def may_go_local(self, body: Mapping[str, Any]) -> bool:
        """Whether this attempt may run as one leg: not a continuation, which is built for
        a producer, and not an answer that needs the producer's prompt side."""
        return self.continuation is None and not wants_prompt_side(body)

    def wants_other_consumer(
        self, consumer: str, decision: Decision, producers: Callable[[], Sequence[str]]
    ) -> bool:
        """Decode first chose ``consumer`` for a disaggregated attempt, but the one producer
        left (of ``producers``, asked only then) is that engine itself: another consumer, if
        there is one, makes it a handoff instead of a local attempt on the producer."""
        return decision == "disaggregated" and self.only_engine(producers()) == consumer

    def consumer_placed(self, consumer: str, decision: Decision) -> GoLocal | None:
        """Decode first: the consumer is placed, and ``decision`` says whether it computes
        the prompt alone. None: place a producer apart from it (``producer_placed``)."""
        return None if decision == "disaggregated" else GoLocal(consumer, decision)

    def producer_placed(
        self,
        producer: str,
        *,
        consumer: str | None,
        only_consumer: str | None,
        consumers: int,
        body: Mapping[str, Any],
    ) -> GoLocal | Prefill:
        """The route once a producer is placed (``consumer``: the one decode first chose;
        ``only_consumer``: the one engine left that may decode, if one). Two legs go to two
        engines: when the only engine that may decode is the producer, it runs alone, as a
        handoff to itself would leave the prefill's blocks held for the lease; an answer
        that needs the prefill leg takes both legs there, its prefill asking for no
        descriptor."""
        if consumer is None and consumers == 0:
            # no consumer to decode: refuse now rather than pin KV nobody will read
            raise NoCapacity("no placeable consumer engine", phase=Phase.ADMISSION)
        alone = consumer if consumer is not None else only_consumer
        if producer != alone:
            return Prefill(producer, consumer)
        if self.may_go_local(body):
            return GoLocal(producer, "local_one_engine")
        return Prefill(producer, consumer, asks_descriptor=False)

    def continuation_prefill(self, producer: str, consumer: str) -> Prefill:
        """A continuation's legs: a handoff between two engines, or both legs on one
        (the consumer is the only producer left) with no descriptor asked for."""
        return Prefill(producer, consumer, asks_descriptor=producer != consumer)

    def resume_consumer(self, consumer: str) -> None:
        """A continuation decodes on a consumer that has not failed this request."""
        if consumer in self.failed_engines:
            raise NoCapacity("no placeable consumer engine but the failed", phase=Phase.STREAM)

    def within_context(self, consumer: str, context: int | None) -> None:
        """A continuation must fit the consumer's context (None: unknown, not checked)."""
        assert self.continuation is not None
        try:
            resume.within_context(self.continuation, context)
        except ValueError as exc:
            message = f"no continuation on engine {consumer}: {exc}"
            raise NoCapacity(message, phase=Phase.STREAM) from None

    # ---- the legs --------------------------------------------------------------------------

    def going_local(self, consumer: str) -> None:
        """A local attempt's one leg is sent: the lifecycle passes the prefill and the
        handoff at once."""
        line = self.attempt_line
        line.consumer, line.local = consumer, True
        for step in (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH):
            self.lifecycle.advance(step)

    def prefill_sent(self, producer: str, *, asks_descriptor: bool = True) -> None:
        """The prefill leg goes to ``producer``; ``asks_descriptor``: it asks for one."""
        self.attempt_line.producer = producer
        self._asks_descriptor = asks_descriptor
        if self.continuation is None:  # a continuation's client stream is committed
            self.lifecycle.advance(Input.PREFILL)

    @property
    def asks_descriptor(self) -> bool:
        """Whether the running attempt's prefill asks for a descriptor."""
        return self._asks_descriptor

    def prefill_answered(
        self, rid: str, producer: str, result: PrefillResult, started: float
    ) -> Handoff | None:
        """The producer's answer is in hand, and its descriptor, if one was asked for (its
        age counts from the prefill's start); None: no descriptor, nothing to hand off."""
        if self.continuation is None:
            self.lifecycle.advance(Input.DESCRIPTOR)
        if not self._asks_descriptor:
            self._handoff = None
            return None
        handoff = Handoff(rid, self.attempt_line.number, producer, result, started)
        self._handoff = handoff
        return handoff

    def handing_off(self, consumer: str, now: float) -> Decode:
        """The descriptor's way to ``consumer``, or the fault that it is too old for it
        (past the lease the producer may have freed the blocks: a read gives garbage). A
        prefill that asked for none decodes where it is, with nothing to hand off."""
        handoff = self._handoff
        self.attempt_line.consumer = consumer
        if handoff is None:
            if self.continuation is None:
                self.lifecycle.advance(Input.DISPATCH)
            return Decode(consumer, None, crossed=False)
        age = handoff.age(now)
        bounds = {
            "handoff_timeout_s": self._config.serving.handoff_timeout_s,
            "lease_limit_s": self._config.engine.lease_limit_s,
        }
        reason = too_old(age, **bounds)
        if reason is not None:
            handoff.fate = Fate.EXPIRED
            raise HandoffExpired(
                f"KV handoff expired: descriptor is {age:.3f}s old, {reason}",
                phase=Phase.HANDOFF,
            )
        if self.continuation is None:
            self.lifecycle.advance(Input.DISPATCH)
        send_by = handoff.send_by(age_limit(**bounds))
        return Decode(consumer, handoff, consumer != handoff.producer, send_by)

    def decode_taken(self, decode: Decode) -> None:
        """The consumer took the decode leg: reading the blocks is its job now."""
        if decode.crossed and decode.handoff is not None:
            decode.handoff.fate = Fate.DECODED

    def decode_failed(self, consumer: str, fault: RequestFault) -> None:
        """Its reclaim goes elsewhere: a consumer that just failed this descriptor would
        most likely fail the reclaim too. A handoff clock that fired before the decode
        request was sent (``HandoffExpired``) left the descriptor unsent: expired."""
        handoff = self._handoff
        if handoff is not None:
            handoff.failed_consumer = consumer
            if isinstance(fault, HandoffExpired):
                handoff.fate = Fate.EXPIRED

    def leg_done(self) -> Handoff | None:
        """The attempt's handoff is over: its fate goes to the journal; one no consumer
        decoded is returned for the reclaim queue (invariant 7)."""
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return None
        self.attempt_line.handoff_fate = handoff.fate.value
        return None if handoff.fate is Fate.DECODED else handoff

    def first_token(self) -> None:
        """The decode leg produced its first output: from here no retry (contract 6.1)."""
        self.lifecycle.advance(Input.FIRST_TOKEN)

    def commit(self) -> None:
        """The 200 headers went out with the first output (the commit point, contract 1)."""
        self.lifecycle.advance(Input.COMMIT)

    # ---- what follows a fault --------------------------------------------------------------

    def failed(
        self,
        fault: RequestFault,
        *,
        now: float,
        body: Mapping[str, Any],
        chat: bool,
        consumers: Callable[[], Sequence[str]],
        needed_s: float,
    ) -> AfterFault:
        """A resume for a stream that failed after output (when allowed), else a retry
        before output (when every rule allows one), else the end. ``consumers``: the
        placeable consumers, asked only for a resume (a continuation goes to one this
        request has not failed on);
        ``needed_s``: the time its first output took (a continuation needs as much)."""
        if self._resumable():
            reason = self._resume_refusal(fault, now, body, chat, consumers, needed_s)
            self.attempt_line.resume = reason or "resumed"
            if reason is None:
                self.attempt_line.error, self.attempt_line.phase = fault.message, fault.phase
                self.resumes += 1
                return RESUME
        else:
            reason = None
        decision = self._retry(fault, now)
        if not decision.retry:
            return End(fault, decision.reason if fault.transient else None, reason)
        self.lifecycle.advance(Input.RETRY)
        return Retry(decision.delay_s)

    def _resumable(self) -> bool:
        if self.kept is None or not self.lifecycle.output_seen or self.lifecycle.finished:
            return False
        consumer = self.attempt_line.consumer
        if consumer is not None:  # the continuation decodes elsewhere
            self.failed_engines.add(consumer)
        return True

    def _resume_refusal(
        self,
        fault: RequestFault,
        now: float,
        body: Mapping[str, Any],
        chat: bool,
        consumers: Callable[[], Sequence[str]],
        needed_s: float,
    ) -> str | None:
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
                body, chat=chat, prompt_ids=kept.prompt_ids, sent_ids=kept.sent()
            )
        except ValueError as exc:  # the limit was reached, or there is none to give
            return str(exc)
        if all(c in self.failed_engines for c in consumers()):
            return "no other consumer"
        reason = resume.after(
            fault,
            resumes=self.resumes,
            allowed=allowed,
            remaining_s=self.deadline - now,
            needed_s=needed_s,
            budget=self._budget,
        )
        if reason is None:
            self.continuation = continuation
        return reason

    def _retry(self, fault: RequestFault, now: float) -> RetryDecision:
        """The retry decision, written into the attempt's record."""
        if fault.engine_id is not None and fault.breaker is not BreakerClass.NONE:
            self.failed_engines.add(fault.engine_id)
        serving = self._config.serving
        decision = retry_decision(
            fault,
            attempt=len(self.attempts),
            max_attempts=serving.max_attempts,
            output_seen=self.lifecycle.output_seen,
            remaining_s=self.deadline - now,
            backoff_base_s=serving.retry_backoff_s,
            budget=self._budget,
            rng=self._rng,
        )
        line = self.attempt_line
        line.error, line.phase, line.retry = fault.message, fault.phase, decision.reason
        return decision

    def stream_ended(self) -> bool:
        """A resumed stream ended (completed, failed, cancelled): True the first time it is
        told, when its outcome is counted."""
        if not self.resumes or self._counted:
            return False
        self._counted = True
        return True

    # ---- the end ---------------------------------------------------------------------------

    def cancelled(self) -> Phase:
        """The client left, or the deadline or the drain ended the request before its end
        (the shell's cancel scopes cancelled its legs): the phase it was in."""
        phase = self.phase
        self.lifecycle.advance(Input.CANCEL)
        return phase

    def give_up(self) -> bool:
        """A fault ends the request, told to its client; True when it was committed before
        (the fault goes as a terminal event, not as JSON)."""
        committed = self.lifecycle.committed
        self.lifecycle.advance(Input.FAIL)
        return committed

    def finish(self) -> bool:
        """The answer is complete; True when it was committed before (a stream's end)."""
        committed = self.lifecycle.committed
        if not committed:  # a JSON answer, or the first output and [DONE] in one read
            self.lifecycle.advance(Input.COMMIT)
        self.lifecycle.advance(Input.DONE)
        return committed
