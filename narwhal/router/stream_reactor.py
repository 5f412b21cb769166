"""One task that reads every parked decode stream (issue 19): the relay's per-token work
without a task switch per token.

A decode leg that waits in its own task pays, per token, trio's readiness registration
(an ``epoll_ctl`` re-arm), a reschedule, a run-loop turn and the coroutine frames between
``wait_readable`` and the relay. ``bench/relay_floor.py`` (256 streams, 50 ms apart, no
parsing) measured the bare relay from one task over a private level-triggered epoll at
0.60x the CPU per chunk of one trio task per stream, and 0.47x of that relay under the
router's former layering (three coroutine layers, a deadline moved per chunk).

So a streaming request whose next steps need no waiting *parks* here: its task waits in
``park`` (cancellable as any checkpoint: its deadline, its client's disconnect) while this
task, on its socket's readiness, runs the request's ``on_ready`` callback, which reads,
applies the relay's rules and writes to the client without waiting. Whatever does need
waiting (the first output, a slow client's rest, the end, an error) is handed back: the
request's task wakes with it and goes on in its own nursery, deadlines, reservations and
``finally`` blocks as before. The reactor owns no request state; a request owns its fd's
registration, which ends before its task runs again (hand-back or abort).
"""

from __future__ import annotations

import select
from collections.abc import Callable

import outcome
import trio

wait_readable = trio.lowlevel.wait_readable

RESUME = object()  # handed back when the reactor stops: go on reading in the request task


class StreamReactor:
    """The parked streams' sockets in one epoll, served by ``run`` (the server's background
    nursery). ``running`` is False outside a server (tests of the core): nothing parks."""

    def __init__(self) -> None:
        self._epoll: select.epoll | None = None
        self._parked: dict[int, tuple[trio.lowlevel.Task, Callable[[], object]]] = {}

    @property
    def running(self) -> bool:
        return self._epoll is not None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        epoll = self._epoll = select.epoll()
        parked = self._parked
        try:
            task_status.started()
            poll, fd = epoll.poll, epoll.fileno()
            while True:
                await wait_readable(fd)
                # level-triggered: a socket with bytes left after one read is ready again
                for ready, _ in poll(0):
                    entry = parked.get(ready)
                    if entry is not None:
                        self._serve(epoll, ready, entry[1])
        finally:
            self._epoll = None
            for ready in list(parked):
                self._hand_back(epoll, ready, outcome.Value(RESUME))
            epoll.close()

    async def park(self, fd: int, on_ready: Callable[[], object]) -> object:
        """Wait here while ``on_ready`` (called on each readiness of ``fd``, in the reactor's
        task) returns None; return what it returned otherwise, raise what it raised.
        Cancellation ends the wait as any checkpoint's; the fd is unregistered before this
        returns or raises, so the caller may close it."""
        epoll = self._epoll
        if epoll is None:
            await trio.lowlevel.checkpoint()
            return RESUME
        epoll.register(fd, select.EPOLLIN)
        self._parked[fd] = (trio.lowlevel.current_task(), on_ready)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            del self._parked[fd]
            epoll.unregister(fd)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)

    def _serve(self, epoll: select.epoll, fd: int, on_ready: Callable[[], object]) -> None:
        try:
            result = on_ready()
        except Exception as exc:  # the transport's error, or a bug: the request raises it
            self._hand_back(epoll, fd, outcome.Error(exc))
            return
        if result is not None:
            self._hand_back(epoll, fd, outcome.Value(result))

    def _hand_back(self, epoll: select.epoll, fd: int, result: outcome.Outcome[object]) -> None:
        task, _ = self._parked.pop(fd)
        epoll.unregister(fd)
        trio.lowlevel.reschedule(task, result)
