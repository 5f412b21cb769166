"""One task that reads every parked decode stream: the relay's per-token work
without a task switch per token.

A decode leg that waits in its own task pays, per token, trio's readiness registration
(an ``epoll_ctl`` re-arm), a reschedule, a run-loop turn and the coroutine frames between
``wait_readable`` and the relay. One task over a private level-triggered epoll pays none
of that per token (``bench/relay_floor.py`` measures both shapes; the figures are in
``bench/results/relay-reactor.md``).

So a streaming request whose next steps need no waiting *parks* here: its task waits in
``park`` (cancellable as any checkpoint: its deadline, its client's disconnect) while this
task, on its socket's readiness, runs the request's ``on_ready`` callback, which reads,
applies the relay's rules and writes to the client without waiting. Whatever does need
waiting (the first output, a slow client's rest, the end, an error) is handed back: the
request's task wakes with it and goes on in its own nursery, deadlines, reservations and
``finally`` blocks as before. The reactor owns no request state; a request owns its
socket's registration, which ends before its task runs again (hand-back or abort).

Registrations are by descriptor number (epoll knows no other key), so the reactor keeps the
rule of ``narwhal.lowlevel.fast_io`` by never letting a number outlive its socket here: whoever
closes a parked socket calls its ``before_close`` first, which hands the request back with
that error and ends the registration while the number is still the socket's; a socket
closed without a word leaves no readiness (the kernel ends its registration), and the
request's reads go through the socket object, which reads as closed. A park on a number
that a stale entry still holds hands that entry back closed.
"""

from __future__ import annotations

import heapq
import math
import select
import socket
from collections.abc import Callable

import outcome
import trio

from narwhal.lowlevel.fast_io import Parkable

wait_readable = trio.lowlevel.wait_readable


class HandBack:
    """Handed back when the reactor stops, or a read must wait (``HAND_BACK``: the request's
    task reads), or when ``on_due`` says the request's time is up (``TIME_UP``: its task's
    own clock ends it)."""

    __slots__ = ()


HAND_BACK, TIME_UP = HandBack(), HandBack()
NEVER = math.inf
# the dues heap is rebuilt from the parked streams when it holds more entries than this
# many per parked stream, plus the slack (each rebuild is one pass over the parked)
STALE_DUES_FACTOR = 4
STALE_DUES_SLACK = 1024


class _Parked:
    """One parked request: its socket and the number it was registered under, its task,
    its callbacks, and when ``on_due`` is next called (``seq``: its entry in the dues).
    It is its socket's ``before_close`` too (called, its request raises the error): one
    object a park, not a second one to bind the reactor (bench/results/request-machine-events)."""

    __slots__ = ("due", "fd", "on_due", "on_ready", "reactor", "seq", "sock", "task")

    def __init__(
        self,
        reactor: StreamReactor,
        sock: Parkable,
        fd: int,
        task: trio.lowlevel.Task,
        on_ready: Callable[[], object],
        on_due: Callable[[], float | None] | None,
    ) -> None:
        # descriptor kept: the registration's key, ended by ``before_close`` before any close
        self.reactor, self.sock, self.fd, self.task = reactor, sock, fd, task
        self.on_ready, self.on_due = on_ready, on_due
        self.due = NEVER
        self.seq = 0

    def registered(self) -> bool:
        """Its socket still holds the number it was registered under (not closed)."""
        return self.sock.fileno() == self.fd

    def __call__(self, error: BaseException) -> None:
        """The parked socket's ``before_close``: its request raises ``error``."""
        self.reactor.closing(self, error)


class StreamReactor:
    """The parked streams' sockets in one epoll, served by ``run`` (the server's background
    nursery). ``running`` is False outside a server (tests of the core): nothing parks.

    A parked request may also ask for a call at a time (``due``, ``set_due``): the expiry
    of its clock, which its task lifted to park. The call (``TokenPath.on_due``) names the
    expiry that reads since have moved it to, or hands the request back ``TIME_UP``; a read
    moves only a float of the request's, so the dues are pushed at most once per expiry,
    not per read. No task moves another's clock: a request's is its task's, and the
    reactor's timer (armed at the earliest due before each wait) is the reactor's; a park
    with a sooner due wakes the reactor, with a byte on a socketpair in its epoll, to arm
    it anew."""

    def __init__(self) -> None:
        self._epoll: select.epoll | None = None
        self._parked: dict[int, _Parked] = {}
        # a heap of (due, seq, fd); stale entries (unparked, or moved since: another seq)
        # are skipped. By descriptor, not entry: a stale entry must not keep a finished
        # request's objects alive until its due (at 3,000 requests a second, tens of MiB)
        self._dues: list[tuple[float, int, int]] = []
        self._seq = 0
        # the reactor's timer is a cancel scope of its own task, armed at the earliest due
        # before each wait; a park whose due comes sooner wakes it with a byte on this pair
        # to arm it anew, rather than move another task's clock
        self._armed = -math.inf  # the due the reactor waits until; -inf: it is not waiting
        self._wake: socket.socket | None = None  # the pair's end that wakes the reactor
        self.parks = 0  # streams parked here so far (a compiled class takes no wrapper)

    @property
    def running(self) -> bool:
        return self._epoll is not None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        epoll = self._epoll = select.epoll()
        woken, self._wake = socket.socketpair()
        woken.setblocking(False)
        self._wake.setblocking(False)
        epoll.register(woken, select.EPOLLIN)
        parked, dues = self._parked, self._dues
        try:
            task_status.started()
            poll = epoll.poll
            while True:
                # the timer: the earliest due (a sooner one parked meanwhile wakes it)
                armed = self._armed = dues[0][0] if dues else NEVER
                with trio.CancelScope(deadline=armed):
                    await wait_readable(epoll)
                self._armed = -math.inf  # it arms its timer anew before it waits again
                # level-triggered: a socket with bytes left after one read is ready again
                for ready, _ in poll(0):
                    entry = parked.get(ready)
                    if entry is not None:
                        self._serve(epoll, entry)
                    elif ready == woken.fileno():
                        woken.recv(64)
                if dues and dues[0][0] <= trio.current_time():
                    self._call_dues(epoll)
        finally:
            self._epoll = None
            dues.clear()
            for entry in list(parked.values()):
                self._hand_back(epoll, entry, outcome.Value(HAND_BACK))
            epoll.close()
            woken.close()
            self._wake.close()
            self._wake = None

    async def park(
        self,
        sock: Parkable,
        on_ready: Callable[[], object],
        due: float = NEVER,
        on_due: Callable[[], float | None] | None = None,
    ) -> object:
        """Wait here while ``on_ready`` (called on each readiness of ``sock``, in the
        reactor's task) returns None; return what it returned otherwise, raise what it
        raised (or what ``on_due`` raised, or what the socket's closer gave
        ``before_close``). ``on_due`` is called at ``due`` (in the reactor's task) and
        returns the next one, or None: return ``TIME_UP``. Cancellation ends the wait as
        any checkpoint's; the socket is unregistered before this returns or raises, so the
        caller may close it."""
        epoll = self._epoll
        if epoll is None or sock.fileno() < 0:  # no reactor, or closed: the task reads
            await trio.lowlevel.checkpoint()
            return HAND_BACK
        fd = sock.fileno()
        stale = self._parked.get(fd)
        if stale is not None:  # closed without a word, and this socket took its number
            self._hand_back(epoll, stale, outcome.Error(trio.ClosedResourceError()))
        entry = _Parked(self, sock, fd, trio.lowlevel.current_task(), on_ready, on_due)
        self.parks += 1
        epoll.register(fd, select.EPOLLIN)
        self._parked[fd] = entry
        sock.before_close = entry
        self.set_due(sock, due)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._unpark(epoll, entry)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def set_due(self, sock: Parkable, due: float) -> None:
        """Call the parked ``sock``'s ``on_due`` at ``due`` instead (NEVER: not at all)."""
        entry = self._parked[sock.fileno()]
        entry.due = due
        if due < NEVER:
            self._seq += 1
            entry.seq = self._seq
            heapq.heappush(self._dues, (due, self._seq, entry.fd))
            if len(self._dues) > STALE_DUES_FACTOR * len(self._parked) + STALE_DUES_SLACK:
                self._compact_dues()
            if due < self._armed:  # sooner than the reactor waits: wake it (once, it reads
                self._armed = -math.inf  # every due before it waits again)
                assert self._wake is not None
                self._wake.send(b"\0")

    def _compact_dues(self) -> None:
        """Drop the stale entries: a due brought forward, and requests that ended, leave
        one each until its time (the heap stays within a few per stream)."""
        dues = self._dues  # the same list: ``run`` holds it
        dues.clear()
        for seq, (fd, entry) in enumerate(self._parked.items(), 1):
            entry.seq = seq
            if entry.due < NEVER:
                dues.append((entry.due, seq, fd))
        heapq.heapify(dues)
        self._seq = len(self._parked)

    def _call_dues(self, epoll: select.epoll) -> None:
        dues, now = self._dues, trio.current_time()
        while dues and dues[0][0] <= now:
            _, seq, fd = heapq.heappop(dues)
            entry = self._parked.get(fd)
            if entry is None or entry.seq != seq:
                continue  # unparked, or its due moved since
            self._call_due(epoll, entry)

    def _serve(self, epoll: select.epoll, entry: _Parked) -> None:
        """``on_ready``, in the reactor's task: a result is handed back, as is an error."""
        try:
            result = entry.on_ready()
        except Exception as exc:  # the transport's error, or a bug: the request raises it
            self._hand_back(epoll, entry, outcome.Error(exc))
            return
        if result is not None:
            self._hand_back(epoll, entry, outcome.Value(result))

    def _call_due(self, epoll: select.epoll, entry: _Parked) -> None:
        """``on_due``, in the reactor's task: it names the next due, or None: the request
        is handed back ``TIME_UP``; an error is handed back."""
        assert entry.on_due is not None
        try:
            due = entry.on_due()
        except Exception as exc:
            self._hand_back(epoll, entry, outcome.Error(exc))
            return
        if due is None:
            self._hand_back(epoll, entry, outcome.Value(TIME_UP))
        else:
            self.set_due(entry.sock, due)

    def closing(self, entry: _Parked, error: BaseException) -> None:
        """``entry``'s socket is about to close: its request raises ``error``."""
        epoll = self._epoll
        if epoll is not None and self._parked.get(entry.fd) is entry:
            self._hand_back(epoll, entry, outcome.Error(error))

    def _hand_back(
        self, epoll: select.epoll, entry: _Parked, result: outcome.Outcome[object]
    ) -> None:
        self._unpark(epoll, entry)
        trio.lowlevel.reschedule(entry.task, result)

    def _unpark(self, epoll: select.epoll, entry: _Parked) -> None:
        del self._parked[entry.fd]
        entry.sock.before_close = None
        if entry.registered():  # a closed socket's registration ended with it
            epoll.unregister(entry.fd)
