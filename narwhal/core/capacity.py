"""How many requests an engine runs at once, learned from its reports (contract 4.5: the
most it ran while some waited).

An engine that held some of its requests back showed its capacity: the most it ran over
its recent reports. One that never held any back has shown only a lower bound, and the
admission queue, which lets through what the bound allows, keeps it there: a consumer
bound by its KV cache rather than a sequence limit ran what it was let run, its room was
its waiting limit, and requests in prefill (each holding a consumer's room) filled that.
So while none of its recent reports showed a queue as it ran near the bound, and it runs
near the bound with none now, the bound grows by the share of it the engine may queue
anyway (``waiting_share``): a guess too high by that share is a queue within its waiting
limit, which its next report shows, and the growth stops there. Any queue counts, ours
too: a router alone in front of a fleet sees only its own requests wait. A queue while it
runs far below the bound (a consumer's requests pulling their KV) shows no capacity. An
engine whose bound is under ``1 / waiting_share`` never grows: a sequence limit of two is
never guessed at three.
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
        self.quiet = 0  # reports in a row that showed no queue while it ran near its bound

        self.value: float | None = None

    @property
    def shown(self) -> bool:
        """It held requests back at its bound within the window: its capacity is known."""
        return self.quiet < min(self.window, self.seen.count)

    def ours(self, running: int) -> float | None:
        """Our streams it runs at once, past their first token, while its capacity is not
        shown: a bound on it known at once. Once shown, ours are not trusted over it: a
        stream that ended there is still ours until we read its end, and the engine may
        have started the next one meanwhile (a sequence limit of two seen as three)."""
        if self.value is not None and not self.shown and running > self.value:
            self.value = float(running)
        return self.value

    def note(self, running: float, waiting: float, ours_peak: int = 0) -> float:
        """One report: it ran ``running`` and held ``waiting`` back (ours among them: a
        router alone in front of a fleet sees only its own requests queue), and the most of
        our streams it ran at once since the last (``ours_peak``); the capacity it leaves.
        A queue while it ran near its bound is its capacity shown; a queue while it ran far
        below it (a consumer's requests pulling their KV) is not, and is no reason to grow
        either."""
        before = self.value if self.value is not None else 0.0
        near = running >= before - self._step(before)
        queue = waiting > 0  # NaN is no queue shown
        if queue and near:
            self.quiet, self.grown = 0, 0.0  # it showed its capacity: what it runs
        else:
            self.quiet = min(self.quiet + 1, self.window)
        if not self.shown:
            running = max(running, ours_peak)
        seen = self.seen.add(running)
        value = max(seen, self.grown)
        step = self._step(value)
        if not self.shown and not queue and step >= 1 and running >= value - step:
            value = min(value + step, self.ceiling)
            self.grown = value
        self.value = value
        return value

    def _step(self, value: float) -> int:
        return math.floor(value * self.waiting_share)
