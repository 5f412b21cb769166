"""Retry decisions (contract 6.1), pure: the trio shell only sleeps the delay it is given.

A fresh attempt is made only when every rule allows it, checked in this order (the first
that refuses names the reason, which the journal records):

1. the fault is transient (connect errors, timeouts, 408/429/5xx, invalid descriptor,
   stream failures before the first token, handoff expiry); a client error never is;
2. no generated token was observed yet (no visible output, no bytes of two attempts mixed);
3. the request has attempts left (``serving.max_attempts``);
4. the request deadline is still ahead after the full-jitter backoff;
5. the router-wide budget has a credit (``retry_budget``, earning ``retry_replenish`` per
   completed request, capped at the budget).
"""

from __future__ import annotations

import random
from enum import StrEnum

import msgspec

from narwhal.core.faults import RequestFault


class RetryBudget:
    """Router-wide retry credits: a retry spends one, a completed request earns a little."""

    __slots__ = ("cap", "credits", "replenish")

    def __init__(self, cap: float, replenish: float) -> None:
        self.cap = cap
        self.credits = cap
        self.replenish = replenish

    def spend(self) -> bool:
        if self.credits < 1.0:
            return False
        self.credits -= 1.0
        return True

    def earn(self) -> None:
        self.credits = min(self.cap, self.credits + self.replenish)


class Denial(StrEnum):
    """Why a transient fault gets no fresh attempt (a metric label and a journal field)."""

    NOT_TRANSIENT = "not_transient"
    AFTER_OUTPUT = "after_output"
    ATTEMPTS = "attempts"
    DEADLINE = "deadline"
    BUDGET = "budget"


class RetryDecision(msgspec.Struct, frozen=True):
    retry: bool
    reason: str  # "retry", or a Denial
    delay_s: float = 0.0


def backoff(base_s: float, attempt: int, rng: random.Random) -> float:
    """Full jitter: uniform in [0, base * 2^(attempt-1)]."""
    return rng.uniform(0.0, base_s * 2 ** (attempt - 1))


def retry_decision(
    fault: RequestFault,
    *,
    attempt: int,
    max_attempts: int,
    output_seen: bool,
    remaining_s: float,
    backoff_base_s: float,
    budget: RetryBudget,
    rng: random.Random,
) -> RetryDecision:
    """Whether attempt ``attempt`` (1-based), which failed with ``fault``, gets a successor."""
    if not fault.transient:
        return RetryDecision(False, Denial.NOT_TRANSIENT)
    if output_seen:
        return RetryDecision(False, Denial.AFTER_OUTPUT)
    if attempt >= max_attempts:
        return RetryDecision(False, Denial.ATTEMPTS)
    delay = backoff(backoff_base_s, attempt, rng)
    if remaining_s <= delay:
        return RetryDecision(False, Denial.DEADLINE)
    if not budget.spend():
        return RetryDecision(False, Denial.BUDGET)
    return RetryDecision(True, "retry", delay)
