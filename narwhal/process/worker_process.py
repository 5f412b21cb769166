"""One worker of ``serve --workers N``: ``narwhal.router.serving.serve`` in its own process,
exactly as a single router, with its link to the parent (``ParentLink``: the parent's
orders, reloads that reach every worker) over the control channel
(``narwhal.process.worker_channel``). The parent's side is ``narwhal.process.workers``.
"""

from __future__ import annotations

import logging
import os
import socket
from functools import partial
from typing import Any

import msgspec
import trio
from hypercorn.config import Sockets

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.faults import InvalidFleetFile, ReloadNotApplied, ReloadUnanswered
from narwhal.core.limits import check_workers
from narwhal.process.config_files import load_config
from narwhal.process.worker_channel import (
    RELOAD_BOUND_S,
    SEND_BOUND_S,
    Channel,
    Message,
    WorkerSpec,
)
from narwhal.router.service import Router
from narwhal.router.serving import serve

log = logging.getLogger("narwhal.workers")
_encode = msgspec.json.Encoder().encode
GAUGE_REFRESH_S = 5.0  # a worker's clock-driven gauges, for scrapes answered by another


class ParentLink:
    """A worker's view of the group (``narwhal.router.app.WorkerGroup``): its index, the
    parent's orders, and reloads that reach every worker."""

    def __init__(self, spec: WorkerSpec, router: Router, channel: Channel) -> None:
        self.index = spec.index
        self.count = spec.count
        self.router = router
        self.channel = channel
        self.stop = trio.Event()  # the parent said stop, or is gone
        self._asked = 0
        self._answers: dict[int, list[dict[str, Any]]] = {}
        self._answered: dict[int, trio.Event] = {}

    async def run(self) -> None:
        """Follow the parent's orders until it says stop or is gone (then drain)."""
        while (message := await self.channel.receive()) is not None:
            if message.op == "stop":
                self.stop.set()
            elif message.op == "reload":
                result = self.reload_here(reopen_journal=message.journal)
                await self.channel.send(Message("reloaded", id=message.id, results=[result]))
            elif message.op == "reload-done":
                event = self._answered.get(message.id)
                if event is not None:  # else its POST gave up waiting (504)
                    self._answers[message.id] = message.results
                    event.set()
        if not self.stop.is_set():
            log.warning("worker %d: the parent is gone; draining", self.index)
            self.stop.set()

    def reload_here(self, *, reopen_journal: bool) -> dict[str, Any]:
        mine: dict[str, Any] = {"worker": self.index, "pid": os.getpid()}
        if reopen_journal:
            self.router.journal.reopen()
        try:
            return mine | self.router.reload_file()
        except ConfigError as exc:
            return mine | {"error": exc.render(), "problems": exc.problems}

    async def reload_everywhere(self) -> tuple[int, bytes]:
        """``POST /narwhal/reload``: (status, body). A file that does not load is refused
        here and changes nothing anywhere; else every worker reloads it and the answer
        comes once every worker has answered."""
        path = self.router.config_path
        try:
            if path is None:
                raise ConfigError("<none>", ["the router was not started from a fleet file"])
            check_workers(load_config(path), self.count, path)  # refused here, not by each
        except ConfigError as exc:
            return InvalidFleetFile(exc).answer()
        self._asked += 1
        asked = self._asked
        self._answered[asked] = answered = trio.Event()
        try:
            if await self.channel.send(Message("reload", id=asked)):
                with trio.move_on_after(RELOAD_BOUND_S + SEND_BOUND_S + 1.0):
                    await answered.wait()
        finally:
            del self._answered[asked]
        results = self._answers.pop(asked, None)
        if results is None:
            return ReloadUnanswered().answer()
        failed = [r["worker"] for r in results if "error" in r]
        if failed:
            return ReloadNotApplied(failed, results).answer()
        mine = next((r for r in results if r.get("worker") == self.index), results[0])
        change = {k: mine[k] for k in ("engines", "added", "removed") if k in mine}
        return 200, _encode({**change, "workers": results})


def run_worker(spec: WorkerSpec, fleet: FleetConfig, router: Router) -> int:
    """Serve as worker ``spec.index`` until the parent says stop (or is gone); 0 once
    drained."""
    listener = socket.socket(fileno=spec.listen_fd)
    control = socket.socket(fileno=spec.control_fd)
    tls = spec.certfile is not None and spec.keyfile is not None
    sockets = Sockets([listener], [], []) if tls else Sockets([], [listener], [])
    trio.run(_serve_worker, spec, fleet, router, sockets, control)
    return 0


async def _serve_worker(
    spec: WorkerSpec, fleet: FleetConfig, router: Router, sockets: Sockets, control: socket.socket
) -> None:
    link = ParentLink(spec, router, Channel(control))
    router.kv_subscriber.relay = spec.kv_relay
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_refresh_gauges, router)
        async with trio.open_nursery() as server:
            await server.start(
                partial(
                    serve,
                    fleet,
                    host=spec.host,
                    port=spec.port,
                    router=router,
                    shutdown_trigger=link.stop.wait,
                    certfile=spec.certfile,
                    keyfile=spec.keyfile,
                    sockets=sockets,
                    workers=link,
                )
            )
            await link.channel.send(Message("serving"))
        nursery.cancel_scope.cancel()  # drained: stop following the parent


async def _refresh_gauges(router: Router) -> None:
    """Clock-driven gauges are brought up to date when a worker answers a scrape; the
    scrape sums every worker's, so each worker refreshes its own now and then too."""
    while True:
        await trio.sleep(GAUGE_REFRESH_S)
        router.health.refresh_gauges()
