"""One request's ASGI receive queue: what hypercorn's HTTPStream puts (the body's
``http.request`` events, then ``http.disconnect``) and the app's ``receive`` takes.

Hypercorn makes it a trio memory channel, for every request: the channel's state (a deque
whose first block alone is about 600 bytes), its two ends and their bookkeeping, about
1.5 KB held for as long as the request is open (``bench/held_stream_objects.py``). A
request has one writer (the connection's read loop) and, nearly always, one reader, so a
list and the tasks parked on it serve. Same rules as the channel: ``put`` waits while
``limit`` events are queued, each call is a checkpoint (cancellable while it waits, a
schedule point when it does not), and an event is taken by exactly one ``get``.
"""

from __future__ import annotations

from typing import Any

import outcome
import trio

Event = Any  # an ASGI receive event: a dict


class AppQueue:
    __slots__ = ("_events", "_getters", "_limit", "_putters")

    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._events: list[Event] = []
        # parked tasks, oldest first; a putter with the event it brings
        self._getters: list[trio.lowlevel.Task] = []
        self._putters: list[tuple[trio.lowlevel.Task, Event]] = []

    async def put(self, event: Event) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._getters:  # a reader waits: the event is its own, at once
            trio.lowlevel.reschedule(self._getters.pop(0), outcome.Value(event))
        elif len(self._events) < self._limit:
            self._events.append(event)
        else:
            task = trio.lowlevel.current_task()
            waiting = (task, event)
            self._putters.append(waiting)

            def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
                self._putters.remove(waiting)  # cancelled: its event was never queued
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
            return
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def get(self) -> Event:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._events:
            event = self._events.pop(0)
            if self._putters:  # room for a waiting writer's event, in its order
                task, waiting = self._putters.pop(0)
                self._events.append(waiting)
                trio.lowlevel.reschedule(task)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return event
        task = trio.lowlevel.current_task()  # no writer waits either: it waits on a full list
        self._getters.append(task)

        def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
            self._getters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        return await trio.lowlevel.wait_task_rescheduled(abort)
