"""The server's background: one nursery for work no request owns (health checks and
probes, reclaim legs, scrapes, discovery, the stream reactor, idle connection sweeps), and
the small engine client that checks and scrapes use. The server opens it at start-up (the
app's lifespan) and cancels it at shutdown; a request never starts anything in it but a
reclaim (``Reclaimer.submit`` queues, the reclaimer's own task runs the leg).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from narwhal.engines.client import EngineClient

log = logging.getLogger("narwhal.background")
Service = Callable[..., Awaitable[None]]  # started with ``nursery.start``: it reports ready


class BackgroundUnavailable(RuntimeError):
    """Background work was asked for while the server's nursery is not running."""


class Background:
    def __init__(self, data_client: EngineClient) -> None:
        self._data = data_client
        self._nursery: trio.Nursery | None = None
        self._checks: EngineClient | None = None

    @property
    def running(self) -> bool:
        return self._nursery is not None

    async def run(
        self,
        services: Sequence[Service],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Open the nursery, start each service in it (in order: each is ready before the
        next starts), report started, and live until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for service in services:
                    await nursery.start(service)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self._checks is not None:
                await self._checks.aclose()  # shielded and bounded inside

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn`` in the server-owned nursery (never in a request's); raise
        ``BackgroundUnavailable`` when that nursery was never started: a probe that silently
        never starts would leave an engine ejected for good. Once the server is shutting
        down, nothing new starts (said in the log)."""
        name = getattr(fn, "__name__", fn)
        if self._nursery is None:
            raise BackgroundUnavailable(
                f"{name} cannot start: the server's background nursery is not running "
                "(serve the router, or run Background.run)"
            )
        try:
            self._nursery.start_soon(fn, *args)
        except RuntimeError:  # closed to new arrivals: the server is shutting down
            log.warning("%s not started: the server is shutting down", name)

    def checks_client(self) -> EngineClient:
        """Active checks and scrapes have their own small pool: they never take a data
        leg's connection slot, and a data leg never rides on a connection a check opened (a
        stale one would hide an engine that no longer accepts connections)."""
        if self._checks is None:
            data = self._data
            self._checks = EngineClient(
                connector=data.connector,
                max_connections=2,
                connect_timeout_s=data.connect_timeout_s,
                api_key=data.api_key,
                ca_file=data.ca_file,  # https:// engines verified as the data legs verify
                connect=data.connect,
            )
        return self._checks
