"""Requests sent straight to ``Router.handle`` of a ``MemoryFleet`` (trio's MockClock, in
memory), each with its id, class and tenant: the admission queue's shell tests."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from narwhal.core.classify import Flow
from narwhal.core.flow import Priority
from narwhal.core.requests import parse_request
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, RecordingSink


class Clients:
    """Requests sent straight to ``Router.handle``, each with its id, class and tenant."""

    def __init__(self, fleet: MemoryFleet, nursery: trio.Nursery) -> None:
        self.fleet = fleet
        self.nursery = nursery
        self.sinks: dict[str, RecordingSink] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.ended: dict[str, trio.Event] = {}

    async def send(
        self,
        rid: str,
        cls: Priority = Priority.DEFAULT,
        tenant: str = "t",
        *,
        stream: bool = False,
        body: dict[str, Any] | None = None,
    ) -> None:
        """Start the request and return once it is queued or on its engine (``body``: the
        request's own, else a one-word completion of two tokens)."""
        body = body or {"model": MODEL, "prompt": "word", "max_tokens": 2, "stream": stream}
        req = parse_request(msgspec.json.encode(body), endpoint="/v1/completions", model=MODEL)
        sink = self.sinks[rid] = RecordingSink()
        scope = self.scopes[rid] = trio.CancelScope()
        ended = self.ended[rid] = trio.Event()

        async def run() -> None:
            with scope:
                await self.fleet.router.handle(
                    req, rid, sink, trio.sleep_forever, flow=Flow(cls, tenant)
                )
            ended.set()

        self.nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()

    async def hold_the_producer(self) -> None:
        """A request ("held") whose prefill hangs: the producer is full until it ends."""
        self.fleet.producer.faults.push(Fault(kind="hang", leg="prefill"))
        await self.send("held")

    async def wait_ended(self, rid: str) -> None:
        with trio.fail_after(60):
            await self.ended[rid].wait()

    def status(self, rid: str) -> int:
        what, data = self.sinks[rid].events[-1][1:]
        return data[0] if what == "json" else 200

    def line(self, rid: str) -> Any:
        return next(line for line in self.fleet.router.journal.lines if line.request_id == rid)


def prefill_order(fleet: MemoryFleet) -> list[str]:
    """The client request ids in the order their prefill legs reached the producer."""
    return [
        entry["request_id"].split("-a")[0]
        for entry in fleet.producer.log
        if entry["request_id"].endswith("-prefill")
    ]


async def drained(fleet: MemoryFleet) -> None:
    with trio.fail_after(120):
        await fleet.router.wait_drained()
