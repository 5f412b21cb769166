"""What the journal says of a finished request (one line each; docs/operator-guide.md
lists the fields): its attempts, who sent it, how it ended. Plain data, kept in the core so
that the request's machine (``narwhal.core.request``) can write its attempts' records;
``narwhal.router.journal`` writes the lines."""

from __future__ import annotations

from typing import Literal

import msgspec

Outcome = Literal["completed", "failed", "expired", "cancelled", "rejected"]


class AttemptLine(msgspec.Struct, omit_defaults=True):
    number: int
    # a fan-out's sub-request: the index of the choice it answers (the journal's "choice")
    fanout_index: int | None = msgspec.field(default=None, name="choice")
    producer: str | None = None
    consumer: str | None = None
    error: str | None = None  # the fault's message
    phase: str | None = None
    retry: str | None = None  # the retry decision taken after this attempt failed
    # the KV descriptor's fate (narwhal.core.handoff.Fate; the journal's "handoff")
    handoff_fate: str | None = msgspec.field(default=None, name="handoff")
    local: bool = False  # served by its consumer alone: no producer leg, no KV transfer
    # a stream resume (contract 6.4): this attempt continued the stream after this many
    # generated tokens had been sent
    resumed_at_token: int | None = None
    resume: str | None = None  # after this attempt failed: "resumed", or why not
    # policy "predicted": the TTFT its plan predicted, from the attempt's start (contract 4.8)
    predicted_ttft_s: float | None = None


class Caller(msgspec.Struct, frozen=True):
    """Who sent a request: the peer's address and which API key, by a short hash."""

    client: str | None = None  # "host:port" of the TCP peer (a load balancer, maybe)
    key: str | None = None  # narwhal.router.auth.key_id: never the key itself


class JournalLine(msgspec.Struct, kw_only=True):
    """One finished request (docs/operator-guide.md, the journal). Keyword-only, so that
    required fields may follow ``ttft_s``, which is filled in rather than passed."""

    request_id: str
    endpoint: str
    stream: bool
    outcome: Outcome
    status: int | None
    phase: str | None
    message: str | None
    attempts: list[AttemptLine]
    prefill_s: float | None  # arrival to the producer's answer (None: no remote prefill)
    # prefill_s again, under the name the journal first gave it, for the tools that read
    # that name; not the time to first token, which is first_byte_s (__post_init__ sets it)
    ttft_s: float | None = None
    first_byte_s: float | None
    tokens: int
    duration_s: float
    prompt_tokens: int | None = None  # as the engine that computed them counted (None: not known)
    at: float = 0.0  # wall clock (Unix seconds) of the request's arrival
    client: str | None = None
    key: str | None = None
    queued_s: float = 0.0  # waited in the admission queue (part of prefill_s and first_byte_s)
    cls: str | None = msgspec.field(default=None, name="class")  # its class in that queue
    model: str | None = None  # the served name it asked for, after aliases (None: refused first)

    def __post_init__(self) -> None:
        self.ttft_s = self.prefill_s
