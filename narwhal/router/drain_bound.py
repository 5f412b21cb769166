"""A scope that ends at its own deadline or at a graceful shutdown's, whichever is first,
for work before a request is admitted (its body still arriving)."""

from __future__ import annotations

from typing import Any

import trio


class DrainBound:
    """A cancel scope registered with the router's running ones while it is open, so that
    a drain that begins later brings its deadline forward too (``Router.begin_drain``).

    A class, not a generator: it runs once per request, and its one scope serves both
    limits, the body's timeout and the drain (a cancel scope's entry and exit are a fair
    share of a request's router CPU: bench/results/request-machine-events/)."""

    __slots__ = ("_running", "scope")

    def __init__(
        self, running: set[trio.CancelScope], deadline: float, drain_deadline: float
    ) -> None:
        self._running = running
        self.scope = trio.CancelScope(deadline=min(deadline, drain_deadline))

    def __enter__(self) -> DrainBound:
        self.scope.__enter__()
        self._running.add(self.scope)
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._running.discard(self.scope)
        return self.scope.__exit__(*exc)

    def drained(self, drain_deadline: float) -> bool:
        """Whether the drain (its deadline now ``drain_deadline``), not the scope's own
        deadline, ended the scope."""
        return self.scope.cancelled_caught and trio.current_time() >= drain_deadline
