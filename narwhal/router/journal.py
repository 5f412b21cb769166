"""The request journal: exactly one JSON line per finished request (SPEC 5, invariant 1),
and one line per engine event (ejection, probe and its outcome, readmission).

Lines are written with one unbuffered ``write`` each, so a crash loses at most the line
being written and concurrent workers appending to one file do not interleave.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

Outcome = Literal["completed", "failed", "expired", "cancelled", "rejected"]


class AttemptLine(msgspec.Struct, omit_defaults=True):
    number: int
    producer: str | None = None
    consumer: str | None = None
    error: str | None = None  # the fault's message
    phase: str | None = None
    retry: str | None = None  # the retry decision taken after this attempt failed


class JournalLine(msgspec.Struct):
    request_id: str
    endpoint: str
    stream: bool
    outcome: Outcome
    status: int | None
    phase: str | None
    message: str | None
    attempts: list[AttemptLine]
    ttft_s: float | None
    first_byte_s: float | None
    tokens: int
    duration_s: float


class Journal:
    """Append-only; ``path`` None keeps the lines in memory only (``lines``, bounded)."""

    def __init__(self, path: str | None = None, *, keep: int = 0) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.keep = keep
        self.lines: list[JournalLine] = []
        self.events: list[dict[str, Any]] = []
        self.written = 0  # request lines (one per finished request); events are apart
        self._encode = msgspec.json.Encoder().encode

    def write(self, line: JournalLine) -> None:
        self.written += 1
        if self.keep:
            self.lines.append(line)
            del self.lines[: -self.keep]
        if self._fd is not None:
            os.write(self._fd, self._encode(line) + b"\n")

    def event(self, line: dict[str, Any]) -> None:
        """An engine event (ejection, probe, readmission): its own line, ``"event"`` first."""
        if self.keep:
            self.events.append(line)
            del self.events[: -self.keep]
        if self._fd is not None:
            os.write(self._fd, self._encode(line) + b"\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
