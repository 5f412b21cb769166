"""The most of the last few samples: what an engine has run at once, learned from its
reports so that a report that lied (a garbage ``vllm:num_requests_running``, an infinity)
or a passing high is forgotten once it leaves the window, instead of setting the
engine's capacity for good. A monotonic queue: each sample enters and leaves once."""

from __future__ import annotations

from collections import deque


class RecentMax:
    """The maximum of the last ``window`` samples, each clamped to ``[0, ceiling]`` (a
    finite ceiling; a sample that is not a number counts as 0)."""

    __slots__ = ("ceiling", "count", "kept", "window")

    def __init__(self, window: int, ceiling: float) -> None:
        self.window = window
        self.ceiling = ceiling
        self.count = 0  # samples taken, ever: each kept one is numbered
        # (number, value), values decreasing: a sample below a later one can never be
        # the maximum again
        self.kept: deque[tuple[int, float]] = deque()

    def add(self, value: float) -> float:
        """Take ``value``; the maximum of the window it ends."""
        value = min(value, self.ceiling) if value > 0 else 0.0  # NaN is not > 0; inf clamps
        kept = self.kept
        while kept and kept[-1][1] <= value:
            kept.pop()
        kept.append((self.count, value))
        self.count += 1
        while kept[0][0] <= self.count - 1 - self.window:
            kept.popleft()
        return kept[0][1]
