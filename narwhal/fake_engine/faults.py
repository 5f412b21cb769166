"""Scripted faults for the fake engine: a queue, each fault consumed by the next matching leg.

Set from tests (``engine.faults.push(Fault(...))``) or over HTTP (``POST /fake/faults`` with
a JSON list of faults; ``DELETE /fake/faults`` clears the queue). A stopped engine
(connection refused) is ``await engine.stop()``, not a queued fault: nothing answers then.

Kinds, by the leg they break:

* either leg: ``status`` (answer HTTP ``status`` with a vLLM error body), ``hang`` (accept the
  request and never answer);
* prefill: ``no_descriptor``, ``bad_engine_id`` (``value`` replaces ``remote_engine_id``;
  default ``""``), ``bad_block_ids`` (``value`` replaces ``remote_block_ids``),
  ``close_mid_body`` (send half the response, then close the connection);
* decode: ``headers_then_silence``; ``metadata_then_silence`` (a comment, the role delta on
  chat, a usage chunk, then nothing); ``tokens_then_silence`` and ``tokens_then_close``
  (``tokens`` tokens first; with ``keepalive_s``, one ``: keep-alive`` comment that long
  after the last token before the silence); ``done_first`` (``[DONE]`` before any token);
  ``stream_error`` (``tokens`` tokens, then an error object with ``code``, then ``[DONE]``,
  as vLLM does); ``malformed_chunk`` and ``oversized_event`` (``tokens`` tokens, then a
  ``data:`` line that is not JSON, or a 2 MiB line with no end); ``slow_drip`` (every
  token ``interval_s`` apart); ``script`` (``value`` is a list of steps played as the
  whole decode response: ``("sleep", s)``, ``("headers", None)``, ``("write", bytes)``,
  ``("end", None)``, ``("close", None)``, ``("hang", None)``; the stream models in
  ``fuzz/`` generate them).

A router's reclaim legs (backend id ``...-reclaim``) meet only faults queued with
``leg="reclaim"``: a fault scripted for the next client leg is never spent on them.
Likewise ``/tokenize`` and ``/detokenize`` meet only faults queued with
``leg="tokenize"``, and ``/metrics`` only those with ``leg="metrics"`` (an engine whose
metrics stop while it serves), of the kinds ``status`` and ``hang``.

A fault with ``rate`` > 0 stays armed and strikes every matching leg with that probability
until the queue is cleared.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Literal, get_args

import msgspec

Leg = Literal["prefill", "decode", "reclaim", "tokenize", "metrics", "any"]
FaultKind = Literal[
    "status",
    "hang",
    "no_descriptor",
    "bad_engine_id",
    "bad_block_ids",
    "close_mid_body",
    "headers_then_silence",
    "metadata_then_silence",
    "tokens_then_silence",
    "tokens_then_close",
    "done_first",
    "stream_error",
    "slow_drip",
    "malformed_chunk",
    "oversized_event",
    "script",
]
PREFILL_ONLY = frozenset({"no_descriptor", "bad_engine_id", "bad_block_ids", "close_mid_body"})
ANY_LEG = frozenset({"status", "hang"})
DECODE_ONLY = frozenset(get_args(FaultKind)) - PREFILL_ONLY - ANY_LEG


class Fault(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    kind: FaultKind
    leg: Leg = "any"
    status: int = 500
    message: str = "scripted fault"
    tokens: int = 0
    code: int | str | None = 503
    interval_s: float = 0.0
    keepalive_s: float = 0.0
    value: Any = ""
    # 0: strike once (queued). > 0: stay armed and strike each matching leg with this
    # probability (the fault matrix and the soak break engines at a rate, not once)
    rate: float = 0.0

    def __post_init__(self) -> None:
        if self.kind in PREFILL_ONLY and self.leg == "decode":
            raise ValueError(f"fault {self.kind} breaks a prefill leg, not a decode leg")
        if self.kind in DECODE_ONLY and self.leg == "prefill":
            raise ValueError(f"fault {self.kind} breaks a decode leg, not a prefill leg")
        if self.kind in PREFILL_ONLY and self.leg == "reclaim":
            raise ValueError(f"fault {self.kind} breaks a prefill leg, not a reclaim leg")
        if self.leg in ("tokenize", "metrics") and self.kind not in ANY_LEG:
            raise ValueError(f"fault {self.kind} breaks a leg, not /{self.leg}")

    @property
    def target(self) -> Leg:
        if self.kind in PREFILL_ONLY:
            return "prefill"
        if self.kind in DECODE_ONLY and self.leg != "reclaim":
            return "decode"
        return self.leg


class FaultQueue:
    def __init__(self, seed: int = 0) -> None:
        self._queue: deque[Fault] = deque()
        self.armed: list[Fault] = []  # faults with a rate: they stay until cleared
        self._random = random.Random(seed)  # deterministic: a run can be replayed

    def push(self, *faults: Fault) -> None:
        for fault in faults:
            (self.armed.append if fault.rate > 0 else self._queue.append)(fault)

    def take(
        self, leg: Literal["prefill", "decode", "reclaim", "tokenize", "metrics"]
    ) -> Fault | None:
        """The first queued fault for ``leg`` (or for any client leg), removed from the
        queue; else an armed one, drawn at its rate."""
        targets = (leg,) if leg in ("reclaim", "tokenize", "metrics") else (leg, "any")
        for i, fault in enumerate(self._queue):
            if fault.target in targets:
                del self._queue[i]
                return fault
        for fault in self.armed:
            if fault.target in targets and self._random.random() < fault.rate:
                return fault
        return None

    def __len__(self) -> int:
        return len(self._queue) + len(self.armed)

    def clear(self) -> None:
        self._queue.clear()
        self.armed.clear()
