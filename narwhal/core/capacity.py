"""How many requests an engine runs at once, learned from its reports (contract 4.5: the
most it ran while some waited).

An engine that held some of its requests back showed its capacity: the most it ran over
its recent reports. One that never held any back has shown only a lower bound, and the
admission queue, which lets through what the bound allows, keeps it there: a consumer
bound by its KV cache rather than a sequence limit ran what it was let run, its room was
its waiting limit, and requests in prefill (each holding a consumer's room) filled that.
So while none of its recent reports showed a queue and it runs near the bound, the bound
grows by the share of it the engine may queue anyway (``waiting_share``): a guess too high
by that share is a queue within its waiting limit, which its next report shows, and the
growth stops there. An engine whose bound is under ``1 / waiting_share`` never grows: a
sequence limit of two is never guessed at three.
"""

from __future__ import annotations

import math

from narwhal.core.recent_max import RecentMax


class Capacity:
    """The requests an engine runs at once: ``value`` (None before its first report)."""

    __slots__ = ("ceiling", "grown", "quiet", "seen", "value", "waiting_share", "window")

    def __init__(self, window: int, ceiling: float, waiting_share: float) -> None:
        self.window = window
        self.ceiling = ceiling
        self.waiting_share = waiting_share
        self.seen = RecentMax(window, ceiling)  # the most it ran, over the window
        self.grown = 0.0  # the bound grown past what it ran (0: none)
        self.quiet = 0  # reports in a row that showed nothing of others waiting
        self.value: float | None = None

    def note(self, running: float, others_waiting: float) -> float:
        """One report: it ran ``running`` and held ``others_waiting`` back that were not
        our legs sent before it went out; the capacity it leaves."""
        seen = self.seen.add(running)
        if not others_waiting > 0:  # NaN is no queue shown
            self.quiet = min(self.quiet + 1, self.window)
        else:
            self.quiet, self.grown = 0, 0.0  # it showed its capacity: what it runs
        value = max(seen, self.grown)
        step = math.floor(value * self.waiting_share)
        none_held_back = self.quiet >= min(self.window, self.seen.count)
        if none_held_back and step >= 1 and running >= value - step:
            value = min(value + step, self.ceiling)
            self.grown = value
        self.value = value
        return value
