"""Admission: who gets in, how many are in, and who waits (contract 3's 429 and 503 rows, 4.5,
8 invariants 1 and 11).

One object owns the check a request passes before it is admitted (the router is not
draining nor in maintenance, and this process is under its share of
``serving.max_inflight``, plus ``admission.max_queued`` with the queue on), the count of
admitted requests that check reads, and the queue in front of the engines: with
``admission.queue`` a request is *dispatched* only while the fleet has room
(``headroom``) and fewer than ``max_inflight`` are dispatched; otherwise it waits here,
holding no engine resource. The order is ``narwhal.core.flow.FlowQueue``'s; the check,
the shares and the room are ``narwhal.core.limits``'.

A queued request waits in its own task, on its own event, under a cancel scope that ends
at the time the queue would shed it: waiting costs no other task and no timer. Room is
looked for (``pump``) when it may have freed: a leg started or ended, a scrape came in, an
engine joined or was readmitted, a request ended. With nothing queued ``pump`` returns at
once, so the queue costs nothing while there is room. Requests to a completion endpoint
are counted on arrival too (``received``): each one, admitted or not, ends in exactly one
journal line.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import trio

from narwhal.core.config import AdmissionConfig, FleetConfig, ServingConfig
from narwhal.core.flow import (
    Displaced,
    Entry,
    Exit,
    FlowQueue,
    Priority,
    Refused,
    shed_fault,
)
from narwhal.core.limits import Limits, dispatchable, refusal


class Ticket:
    """A queued request's place: set ``exit`` and the event to let it go."""

    __slots__ = ("entry", "exit", "woken")

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.exit: Exit | None = None
        self.woken = trio.Event()


def _no_limit(local: bool = False, pool: str | None = None) -> int | None:
    return None


class Admission:
    def __init__(self, metrics: Any = None) -> None:
        self.received = 0  # requests to a completion endpoint, admitted or not
        self.admitted = 0  # in this process: queued, dispatched, or passed through
        self.dispatched = 0  # sent on to the engines (bounded by max_inflight)
        # serve --workers N: this process is worker ``worker_index`` of ``worker_count``
        # and admits its share of max_inflight (``limit``)
        self.worker_index, self.worker_count = 0, 1
        self._metrics = metrics  # Prometheus, when exported
        self._drained = trio.Event()
        self._drained.set()
        # the fleet's room (``Fleet.headroom``, bound by the router): how many more
        # requests it takes; None, a role with no placeable engine (the run answers 503)
        # (``local``: for a request its consumer serves alone, only the consumers' room;
        # ``pool``: of the engines serving that model)
        self.headroom: Callable[[bool, str | None], int | None] = _no_limit
        self._serving = ServingConfig()
        self._flow = AdmissionConfig()
        self._queue = FlowQueue(self._flow.max_queued, self._flow.max_queue_wait_s)
        self._tickets: dict[Hashable, Ticket] = {}
        self._handed = 0  # dispatched from the queue, not yet running: they take room too
        self._seq = 0

    def configure(self, config: FleetConfig) -> None:
        """Limits for what comes next (start, reload); queued requests keep their place."""
        self._serving, self._flow = config.serving, config.admission
        self._queue.max_queue_wait_s = config.admission.max_queue_wait_s
        self.pump()

    def limits(self, serving: ServingConfig) -> Limits:
        """This process's limits: its share of ``serving``'s and the queue's."""
        flow = self._flow
        return Limits(
            serving.max_inflight, flow.max_queued, flow.queue, self.worker_index, self.worker_count
        )

    def limit(self, serving: ServingConfig) -> int:
        """The dispatched requests this process runs at once."""
        return self.limits(serving).inflight()

    def queue_limit(self) -> int:
        """The requests this process holds queued at once: its share of ``max_queued``."""
        return self.limits(self._serving).queued()

    def check(
        self, serving: ServingConfig, *, draining: bool, maintenance: bool, queues: bool = True
    ) -> None:
        """Raise the fault that refuses a request now (``narwhal.core.limits.refusal``);
        return when it may be admitted. ``queues``: False for a request that never waits
        (``/tokenize``)."""
        fault = refusal(
            self.limits(serving),
            self.admitted,
            self.dispatched,
            draining=draining,
            maintenance=maintenance,
            queues=queues,
        )
        if fault is not None:
            raise fault

    def admit(self) -> None:
        if not self.admitted:
            self._drained = trio.Event()
        self.admitted += 1
        if self._metrics is not None:
            self._metrics.in_flight.inc()

    def release(self) -> None:
        self.admitted -= 1
        if self._metrics is not None:
            self._metrics.in_flight.dec()
        if not self.admitted:
            self._drained.set()

    async def wait_drained(self) -> None:
        """Return once no admitted request is left."""
        await self._drained.wait()

    # ---- the queue -----------------------------------------------------------------------

    async def dispatch(
        self,
        cls: Priority,
        tenant: str,
        arrival: float,
        deadline: float,
        *,
        local: bool = False,
        pool: str | None = None,
        due: float | None = None,
    ) -> float:
        """Return when the request may go on to the engines, with the seconds it waited;
        raise ``NotDispatched`` (429, or 503 on SIGTERM) when it leaves the queue another
        way. A dispatched request calls ``done`` when it ends. The caller's cancellation
        (its client left, its deadline) takes it out of the queue at once. ``local``: its
        consumer may serve it alone, so busy producers do not hold it back (in the queue
        too, where it keeps its place in the queue's order). ``pool``: the served name it
        asked for; the room it needs is its engines'. ``due``: the latest dispatch that
        meets its class's TTFT target (its place among its tenant's queued requests)."""
        if not self._flow.queue or (not self._tickets and self._room(local, pool)):
            self._went(cls, pool, 0.0)
            return 0.0
        self._seq += 1
        entry = Entry(self._seq, cls, tenant, arrival, deadline, local, pool, due)
        now = trio.current_time()
        self._queue.max_queued = self.queue_limit()  # the worker count is known by now
        verdict = self._queue.offer(entry, now)
        if isinstance(verdict, Refused):
            self._count_shed(entry, verdict.exit, now)
            raise shed_fault(self._queue, entry, verdict.exit)
        if isinstance(verdict, Displaced):
            self._let_go(verdict.victim, Exit.DISPLACED)
        ticket = self._tickets[entry.id] = Ticket(entry)
        self._depth(entry, +1)
        self.pump()  # the fleet may have room and only order kept it: not for long
        return await self._wait(ticket)

    def take_slot(self) -> None:
        """A request that goes on without queueing (``/tokenize``) takes its slot."""
        self.dispatched += 1

    def done(self) -> None:
        """A dispatched request ended: its ``max_inflight`` slot is free."""
        self.dispatched -= 1
        self.pump()

    def pump(self) -> None:
        """Let queued requests go while the fleet has room, in the queue's order; shed the
        ones whose time came. Synchronous and cheap: called wherever room may free."""
        if not self._tickets:
            return
        now = trio.current_time()
        for entry, exit in self._queue.expire(now):
            self._let_go(entry, exit)
        while (taken := self._queue.next_with_room(now, self._room)) is not None:
            self.dispatched += 1
            self._handed += 1
            self._let_go(taken, Exit.DISPATCHED)

    def drain_queue(self) -> None:
        """SIGTERM: every queued request is answered 503 at once (it never started)."""
        for entry in self._queue.drain():
            self._let_go(entry, Exit.DRAINED)

    def queued(self) -> int:
        return len(self._queue)

    async def _wait(self, ticket: Ticket) -> float:
        entry = ticket.entry
        try:
            with trio.move_on_at(self._queue.leave_by(entry)):
                await ticket.woken.wait()
        except BaseException:  # cancelled: the client left, or its deadline or drain came
            self._abandon(ticket, Exit.CANCELLED)
            raise
        now = trio.current_time()
        if ticket.exit is None:  # its own timer: the queue sheds it now
            self._abandon(ticket, self._queue.timed_out(entry))
        if ticket.exit is Exit.DISPATCHED:
            self._handed -= 1
            waited = now - entry.arrival
            self._observe(entry.cls, entry.pool, waited)
            return waited
        assert ticket.exit is not None
        raise shed_fault(self._queue, entry, ticket.exit)

    def _abandon(self, ticket: Ticket, exit: Exit) -> None:
        """Its task leaves before the queue let it go (or just after: undone)."""
        if ticket.exit is Exit.DISPATCHED:  # let go, but cancelled before it ran
            self._handed -= 1
            self.done()
            return
        if ticket.exit is None and self._queue.remove(ticket.entry.id):
            self._let_go(ticket.entry, exit)

    def _let_go(self, entry: Entry, exit: Exit) -> None:
        ticket = self._tickets.pop(entry.id)
        ticket.exit = exit
        ticket.woken.set()
        self._depth(entry, -1)
        if exit is not Exit.DISPATCHED:  # counted now: its task may be cancelled before it runs
            self._count_shed(entry, exit, trio.current_time())

    def _room(self, local: bool = False, pool: str | None = None) -> bool:
        limit = self.limit(self._serving)
        return dispatchable(
            self.dispatched, limit, self._handed, partial(self.headroom, local, pool)
        )

    def _went(self, cls: Priority, pool: str | None, waited: float) -> None:
        self.dispatched += 1
        self._observe(cls, pool, waited)

    def _model(self, pool: str | None) -> str:
        """The ``model`` label: the served name (the fleet's model when none was given)."""
        return pool if pool is not None else self._metrics.model

    def _observe(self, cls: Priority, pool: str | None, waited: float) -> None:
        if self._metrics is not None:
            model = self._model(pool)
            self._metrics.queue_dispatched_of(cls.value, model).inc()
            self._metrics.queue_wait_of(cls.value, model).observe(waited)

    def _depth(self, entry: Entry, change: int) -> None:
        if self._metrics is not None:
            self._metrics.queue_depth_of(entry.cls.value, self._model(entry.pool)).inc(change)

    def _count_shed(self, entry: Entry, exit: Exit, now: float) -> None:
        if self._metrics is not None:
            model = self._model(entry.pool)
            self._metrics.queue_shed_of(entry.cls.value, exit.value, model).inc()
            waited = max(0.0, now - entry.arrival)
            self._metrics.queue_wait_of(entry.cls.value, model).observe(waited)

    def view(self, serving: ServingConfig) -> dict[str, object]:
        """For ``/narwhal/engines``: the admitted count, the limit, the queue, per worker."""
        return {
            "admitted": self.admitted,
            "dispatched": self.dispatched,
            "queued": {cls.value: self._queue.depth(cls) for cls in Priority},
            "queue": self._flow.queue,
            "max_queued": {"router": self._flow.max_queued, "this_worker": self.queue_limit()},
            "max_inflight": {
                "router": serving.max_inflight,
                "this_worker": self.limit(serving),
                "workers": self.worker_count,
            },
        }
