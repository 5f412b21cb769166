"""A request's ASGI receive queue keeps the rules of the memory channel it replaces: order,
the bound, cancellation that loses and duplicates nothing, a checkpoint at every call."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from narwhal.frontdoor.app_queue import AppQueue


async def test_events_come_out_in_order_and_a_put_past_the_limit_waits() -> None:
    queue = AppQueue(2)
    put_done: list[str] = []

    async def put(event: str) -> None:
        await queue.put(event)
        put_done.append(event)

    async with trio.open_nursery() as nursery:
        for event in ("a", "b", "c", "d"):
            nursery.start_soon(put, event)
            await trio.testing.wait_all_tasks_blocked()
        assert put_done == ["a", "b"]  # c and d wait for room
        assert [await queue.get() for _ in range(4)] == ["a", "b", "c", "d"]
    assert put_done == ["a", "b", "c", "d"]


async def test_a_waiting_get_takes_the_next_event() -> None:
    queue = AppQueue(10)
    got: list[str] = []

    async def get() -> None:
        got.append(await queue.get())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(get)
        nursery.start_soon(get)
        await trio.testing.wait_all_tasks_blocked()
        await queue.put("body")
        await queue.put("disconnect")
    assert got == ["body", "disconnect"]


async def test_cancelled_calls_lose_and_duplicate_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    queue = AppQueue(1)
    await queue.put("first")
    with trio.move_on_after(1):  # the queue is full: this one waits and is cancelled
        await queue.put("never")
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await queue.get()  # a checkpoint, even with an event there
    assert await queue.get() == "first"
    with trio.move_on_after(1):
        await queue.get()  # nothing left: waits, cancelled
    await queue.put("second")
    assert await queue.get() == "second"


async def test_every_call_is_a_schedule_point() -> None:
    queue = AppQueue(4)
    with trio.testing.assert_checkpoints():
        await queue.put("a")
    with trio.testing.assert_checkpoints():
        assert await queue.get() == "a"
