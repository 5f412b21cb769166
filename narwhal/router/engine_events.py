"""Engine events (ejections, probes, readmissions, joins and leaves, discovery changes):
journaled, logged and kept (the newest ``KEEP``) for ``wait_event``, which tests and
operators' tooling use to wait for one without polling."""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from narwhal.observe.logs import log_event
from narwhal.router.journal import Journal

log = logging.getLogger("narwhal.health")
KEEP = 1000
# routine events are INFO; the rest (an ejection, a failed discovery...) WARNING
ROUTINE = frozenset({"probe", "readmitted", "held_in_ended", "joined", "models"})


class EngineEvents:
    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.events: list[dict[str, Any]] = []  # recent engine events, newest last
        self._changed = trio.Event()

    def record(self, kind: str, engine: str | None, **fields: Any) -> None:
        """Journal, log and announce one event (``engine``: its id, None: the fleet's)."""
        line = {"event": kind, "at": round(time.time(), 3), **fields}
        if engine is not None:
            line["engine"] = engine
        self.journal.event(line)
        level = logging.INFO if kind in ROUTINE else logging.WARNING
        log_event(log, level, f"engine event: {kind}", line)
        self.events.append(line)
        del self.events[:-KEEP]
        self._changed.set()
        self._changed = trio.Event()

    async def wait_event(
        self, kind: str, engine: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        """The first recorded event matching; waits for it."""
        seen = 0
        while True:
            for line in self.events[seen:]:
                if (
                    line["event"] == kind
                    and engine in (None, line.get("engine"))
                    and all(line.get(k) == v for k, v in fields.items())
                ):
                    return line
            seen = len(self.events)
            await self._changed.wait()
