"""A request's named clocks, and the fault each becomes when it runs out (``ran_out``):
the deadline, the drain, a prompt-side leg's prefill budget, the first token's budget and
the silence between tokens. The trio shells hold each clock in a cancel scope; this module
only names them and says what their running out means to the client."""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

from narwhal.core.faults import (
    DeadlineExpired,
    FirstTokenTimeout,
    Phase,
    PrefillTimeout,
    RequestFault,
    ShuttingDown,
    SilenceTimeout,
)


class Clock(StrEnum):
    """A request's named timeouts (docs/architecture.md, the life-cycle table)."""

    DEADLINE = "deadline"  # serving.request_timeout_s, from arrival
    DRAIN = "drain"  # serving.graceful_timeout_s, once a graceful shutdown began
    PREFILL = "prefill"  # serving.prefill_timeout_s over one prompt-side leg
    FIRST_TOKEN = "first_token"  # engine.first_token_timeout_s, until the first token
    SILENCE = "silence"  # engine.decode_read_timeout_s between an engine's reads


class Caught(Protocol):
    """A cancel scope once it has ended, as ``trio.CancelScope`` (core imports no trio)."""

    @property
    def cancelled_caught(self) -> bool: ...


def ran_out(
    clock: Clock,
    budget_s: float,
    *,
    phase: Phase,
    engine_id: str | None = None,
    leg: str = "prefill",
    scope: Caught | None = None,
) -> RequestFault:
    """The fault of ``clock`` having run out after ``budget_s`` (of engine ``engine_id``,
    for an engine's clock; ``leg`` names a prompt-side leg, the path of a pass-through).
    ``scope``: the cancel scope that held the clock, when the caller has one; it must
    have caught its cancellation (an ended scope that did not is a bug, raised as one)."""
    if scope is not None and not scope.cancelled_caught:
        raise ValueError(f"the {clock} clock did not run out")
    engine = f"engine {engine_id}"
    match clock:
        case Clock.DEADLINE:
            return DeadlineExpired(budget_s, phase=phase)
        case Clock.DRAIN:
            message = f"the request outlived the graceful timeout ({budget_s:g}s)"
            return ShuttingDown(f"router shutting down: {message}", phase=phase)
        case Clock.PREFILL:
            message = f"{leg} on {engine} took longer than {budget_s:g}s"
            return PrefillTimeout(message, phase=phase, engine_id=engine_id)
        case Clock.FIRST_TOKEN:
            message = f"no first token within {budget_s:g}s from {engine}"
            return FirstTokenTimeout(message, phase=phase, engine_id=engine_id)
        case Clock.SILENCE:
            message = f"engine went silent between tokens: nothing from {engine} for {budget_s:g}s"
            return SilenceTimeout(message, phase=phase, engine_id=engine_id)
