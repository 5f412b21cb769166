"""One request's ASGI receive queue: what hypercorn's HTTPStream puts (the body's
``http.request`` events, then ``http.disconnect``) and the app's ``receive`` takes.

Hypercorn makes it a trio memory channel, for every request: the channel's state (a deque
whose first block alone is about 600 bytes), its two ends and their bookkeeping, about
1.5 KB held for as long as the request is open (``bench/held_stream_objects.py``). A
request has one writer (the connection's read loop) and, nearly always, one reader, so a
list and the tasks parked on it serve. Same rules as the channel: ``put`` waits while
``limit`` events are queued, each call is a checkpoint (cancellable while it waits, a
schedule point when it does not), and an event is taken by exactly one ``get``.

``AppTaskGroup`` is the connection's task group (hypercorn's ``TaskGroup`` interface,
``hypercorn.typing.TaskGroup``): each request's app task takes its events from an
``AppQueue``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
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


class AppTaskGroup:
    """Hypercorn's trio ``TaskGroup`` (0.18), written again: the same nursery and the same
    app task (``run_app``), whose receive queue is an ``AppQueue`` rather than a trio
    memory channel (about 1.3 KB less for each open request)."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None
        self._opened: Any = None  # the nursery's context manager, while open

    async def spawn_app(
        self, app: Any, config: Any, scope: Any, send: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        queue = AppQueue(config.max_app_queue_size)
        self.spawn(run_app, app, config, scope, queue.get, send)
        return queue.put

    def spawn(self, func: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(func, *args)

    async def __aenter__(self) -> AppTaskGroup:
        self._opened = trio.open_nursery()
        self._nursery = await self._opened.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self._opened.__aexit__(exc_type, exc_value, tb)
        finally:
            self._opened = self._nursery = None


async def run_app(
    app: Any,
    config: Any,
    scope: Any,
    receive: Callable[[], Awaitable[Any]],
    send: Callable[[Any], Awaitable[None]],
) -> None:
    """One request's app, as hypercorn's task group runs it: an exception the app lets out
    is logged, and ``send(None)`` then tells the stream the app is done (a response never
    begun is answered 500). Cancellation passes."""
    try:
        await app(scope, receive, send, trio.to_thread.run_sync, trio.from_thread.run)
    except trio.Cancelled:
        raise
    except BaseExceptionGroup as error:
        _, other_errors = error.split(trio.Cancelled)
        if other_errors is not None:
            await config.log.exception("Error in ASGI Framework")
            await send(None)
        else:
            raise
    except Exception:
        await config.log.exception("Error in ASGI Framework")
    finally:
        await send(None)
