"""Flow control at the router, pure (contract 4.5): which queued request goes next, which
ones leave, and why. The shell holds the clock and the sockets: it offers a request the
fleet cannot take now, sheds what ``expire(now)`` returns (on the timer ``next_expiry()``
sets, and before dispatching), asks ``next_with_room(now, room)`` (or ``next(now)``) while
``room_left`` says the fleet has room, removes a request whose client left, and drains the
queue on SIGTERM; ``shed_fault`` is the answer to a request that left unsent.

Rules the queue keeps:
* strict priority between classes: interactive, then default, then batch;
* within a class, round-robin between fairness keys (tenants): the key just served goes to
  the back of the rotation, a key with nothing queued leaves it, and a key that comes back
  joins at the back; so a tenant sending ten times more gets an equal share, no more;
* within a key, the order of ``offer`` (the shell offers requests as they arrive), or, for
  requests that carry a ``due`` (a class with a TTFT target, contract 4.8), earliest due
  first: the latest dispatch that still meets the target, so a long prompt that needs its
  time goes before a short one that arrived just before it;
* a request leaves by ``min(arrival + max_queue_wait_s, deadline)`` at the latest (one that
  cannot wait at all is refused on arrival); the shell may pass a deadline less a margin
  when a request dispatched at its very deadline is not worth sending;
* a request whose room is not the head's (its consumer serves it alone, another model's
  engines) is not held back by the head: with one kind of room queued the head goes first
  or none does, with more the first in this order whose kind has room goes;
* when the queue is full, an arrival displaces the newest queued request of the lowest
  class below its own; with nothing below it, the arrival is refused;
* every offered request leaves exactly once, by one of the ``Exit``s.

Cost, with n requests queued: ``offer`` O(log n) (one push on the expiry heap), ``next``
O(1) plus the heap's amortized clean-up, ``remove`` O(1), ``expire`` O(log n) for each
request it sheds, ``next_expiry`` amortized O(1), ``depth`` and ``len`` O(1), ``drain``
O(n). Requests that leave another way stay on the expiry heap until they reach its top,
or until dead ones outnumber live ones and the heap is rebuilt (amortized O(1)), so the
heap stays within about twice the queue.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import StrEnum
from typing import Literal

from msgspec import Struct

from narwhal.core.faults import NotDispatched, Phase, QueueDrained


class Priority(StrEnum):
    INTERACTIVE = "interactive"
    DEFAULT = "default"
    BATCH = "batch"


# higher rank first; ``BY_RANK`` is the order of service
RANK: dict[Priority, int] = {Priority.INTERACTIVE: 2, Priority.DEFAULT: 1, Priority.BATCH: 0}
BY_RANK: tuple[Priority, ...] = tuple(sorted(Priority, key=RANK.__getitem__, reverse=True))


class Exit(StrEnum):
    """How a queued (or offered) request leaves; also the label of the shed metrics."""

    DISPATCHED = "dispatched"  # the fleet had room: it goes on to the engines
    QUEUE_FULL = "queue_full"  # refused on arrival: full, and nothing lower to displace
    DISPLACED = "displaced"  # pushed out by an arrival of a higher class
    WAIT = "max_queue_wait"  # waited max_queue_wait_s
    DEADLINE = "deadline"  # its deadline came before capacity did
    CANCELLED = "cancelled"  # its client left
    DRAINED = "drained"  # SIGTERM: it never started, so a load balancer may retry it


# What the shell answers for each exit (status, message; the 429s and the 503 carry
# Retry-After). Absent: no answer from the queue (a dispatched request goes on, a
# cancelled one has no client left).
ANSWERS: dict[Exit, tuple[int, str]] = {
    Exit.QUEUE_FULL: (429, "queue full"),
    Exit.DISPLACED: (429, "queue full"),
    Exit.WAIT: (429, "no capacity within {allowed}s"),
    Exit.DEADLINE: (429, "no capacity within {allowed}s"),
    Exit.DRAINED: (503, "the router is shutting down"),
}


class Entry(Struct, frozen=True):
    """One request in the queue; times are the shell's monotonic clock, in seconds."""

    id: Hashable
    cls: Priority
    key: str  # its fairness key (tenant)
    arrival: float
    deadline: float  # absolute
    # its consumer may serve it alone (decode first): a consumer's room is enough for it
    local: bool = False
    # the served name it asked for: the room it needs is that of the engines serving it
    pool: str | None = None
    # the latest dispatch that meets its class's TTFT target (None: no target): its place
    # among its key's requests (earliest first), never when it leaves
    due: float | None = None

    def __post_init__(self) -> None:
        # a NaN would compare false with everything and never leave the expiry heap
        if math.isnan(self.arrival) or math.isnan(self.deadline):
            raise ValueError(f"request {self.id!r}: arrival and deadline must be numbers")
        if self.due is not None and math.isnan(self.due):
            raise ValueError(f"request {self.id!r}: due must be a number")


Kind = tuple[bool, str | None]  # the room a request needs: (its consumer alone, its model)


class Offered(Struct, frozen=True):
    """Queued."""


class Refused(Struct, frozen=True):
    """Not queued: answered at once (``exit`` is QUEUE_FULL, WAIT or DEADLINE)."""

    exit: Exit


class Displaced(Struct, frozen=True):
    """Queued, and ``victim`` left to make room (``Exit.DISPLACED``)."""

    victim: Entry


def _later(queued: Entry, arriving: Entry) -> bool:
    """Whether ``arriving`` goes before ``queued``: both have a due, and its is earlier (one
    without a due keeps the place its arrival gave it)."""
    return queued.due is not None and arriving.due is not None and queued.due > arriving.due


class _Band:
    """One class's queued requests."""

    __slots__ = ("by_key", "order")

    def __init__(self) -> None:
        # the rotation: the key at the front is served next; each key's requests in order
        self.by_key: OrderedDict[str, OrderedDict[Hashable, Entry]] = OrderedDict()
        # the whole class in order of arrival: its newest is the one a displacement takes
        self.order: OrderedDict[Hashable, Entry] = OrderedDict()

    def add(self, entry: Entry) -> None:
        self.order[entry.id] = entry
        queue = self.by_key.setdefault(entry.key, OrderedDict())
        later: list[tuple[Hashable, Entry]] = []  # those it goes before (a later due)
        while entry.due is not None and queue and _later(next(reversed(queue.values())), entry):
            later.append(queue.popitem())
        queue[entry.id] = entry
        for id, other in reversed(later):
            queue[id] = other

    def take(self, entry: Entry) -> None:
        del self.order[entry.id]
        queue = self.by_key[entry.key]
        del queue[entry.id]
        if not queue:
            del self.by_key[entry.key]

    def pop_next(self) -> Entry:
        key, queue = next(iter(self.by_key.items()))
        _, entry = queue.popitem(last=False)
        del self.order[entry.id]
        if queue:
            self.by_key.move_to_end(key)
        else:
            del self.by_key[key]
        return entry

    def newest(self) -> Entry:
        return next(reversed(self.order.values()))


class FlowQueue:
    """The admission queue's state table."""

    __slots__ = ("_bands", "_due", "_kinds", "_queued", "_seq", "max_queue_wait_s", "max_queued")

    def __init__(self, max_queued: int, max_queue_wait_s: float) -> None:
        if max_queued < 1 or not max_queue_wait_s >= 0:
            raise ValueError("max_queued must be >= 1 and max_queue_wait_s >= 0")
        self.max_queued = max_queued
        self.max_queue_wait_s = max_queue_wait_s
        self._bands = {cls: _Band() for cls in Priority}
        # id -> (the sequence number of its offer, the entry): a heap item is alive only
        # while its number matches, so an id offered again never revives a stale item
        self._queued: dict[Hashable, tuple[int, Entry]] = {}
        self._due: list[tuple[float, int, Hashable]] = []  # heap of (leave_by, seq, id)
        self._seq = 0
        # queued requests by the room they need, (local, pool): while one kind is queued,
        # ``next_with_room`` asks the head's room alone and scans nothing
        self._kinds: dict[Kind, int] = {}

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, id: Hashable) -> bool:
        return id in self._queued

    def depth(self, cls: Priority) -> int:
        return len(self._bands[cls].order)

    def leave_by(self, entry: Entry) -> float:
        """The time ``entry`` leaves at the latest."""
        return min(entry.arrival + self.max_queue_wait_s, entry.deadline)

    def answer(self, entry: Entry, exit: Exit) -> tuple[int, str]:
        """The status and message for a request that left by ``exit`` (one in ANSWERS)."""
        status, text = ANSWERS[exit]
        allowed = max(0.0, self.leave_by(entry) - entry.arrival)
        return status, text.format(allowed=f"{round(allowed, 1):g}")

    def offer(self, entry: Entry, now: float) -> Offered | Refused | Displaced:
        if entry.id in self._queued:
            raise ValueError(f"request {entry.id!r} is already queued")
        if self.leave_by(entry) <= now:
            return Refused(self.timed_out(entry))
        if len(self) < self.max_queued:
            self._add(entry)
            return Offered()
        victim = self._lowest_below(entry.cls)
        if victim is None:
            return Refused(Exit.QUEUE_FULL)
        self._left(victim)
        self._add(entry)
        return Displaced(victim)

    def next(self, now: float) -> Entry | None:
        """Dispatch: the next request, removed from the queue; None when it is empty.

        A request due to leave is shed, never dispatched: the shell calls ``expire(now)``
        first, and a call that forgot to is refused rather than answered wrongly.
        """
        due = self.next_expiry()
        if due is not None and due <= now:
            raise ValueError("a queued request is due to leave: call expire(now) first")
        for cls in BY_RANK:
            band = self._bands[cls]
            if band.order:
                entry = band.pop_next()
                self._forget(entry.id)
                return entry
        return None

    def next_where(self, now: float, ok: Callable[[Entry], bool]) -> Entry | None:
        """Dispatch: the first request in the queue's order that ``ok`` lets go, removed
        from the queue (requests before it stay, in their places); None when none may.
        For requests whose room is not all one (another model's engines, a consumer alone):
        one whose engines are full holds back no other."""
        due = self.next_expiry()
        if due is not None and due <= now:
            raise ValueError("a queued request is due to leave: call expire(now) first")
        for cls in BY_RANK:
            band = self._bands[cls]
            for key, queue in band.by_key.items():
                for entry in queue.values():
                    if ok(entry):
                        band.take(entry)  # then leave the loops: they were changed
                        if key in band.by_key:
                            band.by_key.move_to_end(key)
                        self._forget(entry.id)
                        return entry
        return None

    def next_with_room(self, now: float, room: Callable[[bool, str | None], bool]) -> Entry | None:
        """Dispatch: the next request whose engines have room (``room(local, pool)``, asked
        at most once per kind of room), removed from the queue; None when none may go.
        With one kind of room queued the head goes first or none does; with more, a kind
        without room holds back no other (``next_where``)."""
        if len(self._kinds) <= 1:
            head = self.peek()
            if head is None or not room(head.local, head.pool):
                return None
            return self.next(now)
        known: dict[Kind, bool] = {}  # each kind's room, asked once

        def ok(entry: Entry) -> bool:
            kind = (entry.local, entry.pool)
            found = known.get(kind)
            if found is None:
                found = known[kind] = room(*kind)
            return found

        return self.next_where(now, ok)

    def peek(self) -> Entry | None:
        """The request ``next`` would dispatch, left in the queue."""
        for cls in BY_RANK:
            band = self._bands[cls]
            if band.order:
                return next(iter(next(iter(band.by_key.values())).values()))
        return None

    def expire(self, now: float) -> list[tuple[Entry, Exit]]:
        """Shed every request whose time has come (WAIT or DEADLINE), earliest first."""
        shed: list[tuple[Entry, Exit]] = []
        while self._due and self._due[0][0] <= now:
            _, seq, id = heapq.heappop(self._due)
            if self._alive(seq, id):
                entry = self._queued.pop(id)[1]
                self._bands[entry.cls].take(entry)
                self._kind(entry, -1)
                shed.append((entry, self.timed_out(entry)))
        return shed

    def next_expiry(self) -> float | None:
        """When ``expire`` next has something to shed (exact), or None."""
        while self._due and not self._alive(self._due[0][1], self._due[0][2]):
            heapq.heappop(self._due)
        return self._due[0][0] if self._due else None

    def remove(self, id: Hashable) -> bool:
        """A client left while queued (``Exit.CANCELLED``); False when it was not here."""
        slot = self._queued.get(id)
        if slot is None:
            return False
        self._left(slot[1])
        return True

    def drain(self) -> list[Entry]:
        """SIGTERM: every queued request leaves (``Exit.DRAINED``), in order of service
        class, then arrival."""
        gone = [entry for cls in BY_RANK for entry in self._bands[cls].order.values()]
        self._bands = {cls: _Band() for cls in Priority}
        self._queued.clear()
        self._due.clear()
        self._kinds.clear()
        return gone

    def _add(self, entry: Entry) -> None:
        self._seq += 1
        self._queued[entry.id] = (self._seq, entry)
        self._bands[entry.cls].add(entry)
        self._kind(entry, +1)
        heapq.heappush(self._due, (self.leave_by(entry), self._seq, entry.id))

    def _lowest_below(self, cls: Priority) -> Entry | None:
        """The newest request of the lowest class with any, below ``cls``."""
        for lower in reversed(BY_RANK):
            if RANK[lower] >= RANK[cls]:
                return None
            if self._bands[lower].order:
                return self._bands[lower].newest()
        return None

    def _left(self, entry: Entry) -> None:
        self._bands[entry.cls].take(entry)
        self._forget(entry.id)

    def _forget(self, id: Hashable) -> None:
        self._kind(self._queued.pop(id)[1], -1)
        # its heap item stays until it surfaces; rebuild once dead items dominate
        if len(self._due) > 2 * len(self._queued) + 64:
            self._due = [item for item in self._due if self._alive(item[1], item[2])]
            heapq.heapify(self._due)

    def _kind(self, entry: Entry, change: int) -> None:
        kind = (entry.local, entry.pool)
        left = self._kinds.get(kind, 0) + change
        if left:
            self._kinds[kind] = left
        else:
            del self._kinds[kind]

    def _alive(self, seq: int, id: Hashable) -> bool:
        slot = self._queued.get(id)
        return slot is not None and slot[0] == seq

    def timed_out(self, entry: Entry) -> Literal[Exit.WAIT, Exit.DEADLINE]:
        # whichever bound came first names the reason
        if entry.arrival + self.max_queue_wait_s <= entry.deadline:
            return Exit.WAIT
        return Exit.DEADLINE


def shed_fault(queue: FlowQueue, entry: Entry, exit: Exit) -> NotDispatched:
    """The fault that answers a request the queue let go unsent (``exit`` one in ANSWERS):
    503 on SIGTERM (``QueueDrained``: it never started, a load balancer may retry it),
    else 429."""
    status, message = queue.answer(entry, exit)
    fault = QueueDrained if status == 503 else NotDispatched
    return fault(message, phase=Phase.ADMISSION)


Saturation = Literal["waiting", "kv_usage"]
SATURATIONS: tuple[Saturation, ...] = ("waiting", "kv_usage")


def room_left(
    waiting_scraped: float | None,
    sent_since_scrape: int,
    kv_usage: float | None,
    *,
    waiting_limit: int,
    kv_limit: float,
    consumer: bool,
    free: float = 0.0,
) -> tuple[int, Saturation | None]:
    """How many more legs an engine takes before it is saturated, and why it is when that
    is 0 (contract 4.5).

    ``waiting_scraped``: its ``vllm:num_requests_waiting`` as last scraped, None without a
    usable scrape; ``sent_since_scrape``: this router's legs sent to it since that scrape
    and not yet started (without scrapes, the router's own legs are all that counts);
    ``kv_usage``: its ``vllm:kv_cache_usage_perc`` (0..1), which only saturates a consumer;
    ``free``: the room it had free at that scrape (the requests it runs at once, learned from
    its reports, less those it ran): legs sent since start there rather than wait.
    """
    # below 0 while it has free room: the room counts its free slots too
    waiting = math.ceil(waiting_scraped or 0) + sent_since_scrape - math.floor(free)
    if waiting >= waiting_limit:
        return 0, "waiting"
    if consumer and kv_usage is not None and kv_usage >= kv_limit:
        return 0, "kv_usage"
    return waiting_limit - waiting, None
