"""Reclaim legs (SPEC 5, invariant 7): a consumer is handed an orphaned descriptor so the
producer frees its KV blocks now, not when its lease runs out.

The request is the connector's ``reclaim_body``: one the consumer refuses before admission,
which makes vLLM (since vllm#41269) tell the producer to free the blocks, with no transfer
and no compute. The queue and its workers belong to the server's background nursery, never
to the request that left the orphan behind: that request is gone (its client left, its
deadline passed, its attempt failed), and its cancellation must not reach the reclaim.
``submit`` never blocks and never raises, so a request's ``finally`` can call it while
being cancelled. Each leg is bounded by ``engine.first_token_timeout_s``, goes to a healthy
consumer with room (one that already moved KV from that producer first), never feeds the
breaker or the client metrics, and runs at most once per descriptor. The verdicts are
``narwhal.core.handoff``'s.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from narwhal.core.config import FleetConfig
from narwhal.core.faults import EngineFault
from narwhal.core.fleet import EngineState, Fleet
from narwhal.core.handoff import Fate, Handoff, reclaim_verdict
from narwhal.engines.client import EngineClient
from narwhal.logs import log_event
from narwhal.metrics import Metrics

log = logging.getLogger("narwhal.reclaim")
QUEUE_SIZE = 4096  # orphans waiting; past it they are dropped (and counted), never awaited
CONCURRENCY = 8  # reclaim legs at once across the fleet (each a refused request)


class ReclaimHost(Protocol):
    config: FleetConfig
    client: EngineClient
    fleet: Fleet
    metrics: Metrics


class Reclaimer:
    def __init__(self, host: ReclaimHost) -> None:
        self.host = host
        self._send, self._receive = trio.open_memory_channel[Handoff](QUEUE_SIZE)
        self.running = False
        self.inflight = 0  # reclaim legs in flight
        self.pending = 0  # orphans queued or in flight
        self._idle = trio.Event()
        self._idle.set()

    def submit(self, handoff: Handoff) -> None:
        """Queue an orphan for its reclaim leg, or count why it is left to the lease."""
        if not self.host.config.engine.reclaim_orphans:
            return  # counted as orphaned only: left to the producer's lease, as configured
        try:
            self._send.send_nowait(handoff)
        except trio.WouldBlock:
            self._drop(handoff, "queue_full")
            return
        except trio.ClosedResourceError:
            self._drop(handoff, "shutdown")
            return
        if not self.pending:
            self._idle = trio.Event()
        self.pending += 1

    async def wait_idle(self) -> None:
        """Return once every queued orphan is reclaimed or dropped."""
        await self._idle.wait()

    def _settled(self) -> None:
        self.pending -= 1
        if not self.pending:
            self._idle.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The workers, for the server's background nursery; on shutdown what is still
        queued is dropped and counted."""
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(CONCURRENCY):
                    nursery.start_soon(self._worker, self._receive.clone())
                self.running = True
                task_status.started()
        finally:
            self.running = False
            self._send.close()
            while True:
                try:
                    self._drop(self._receive.receive_nowait(), "shutdown")
                    self._settled()
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break

    async def _worker(self, receive: trio.MemoryReceiveChannel[Handoff]) -> None:
        async with receive:
            async for handoff in receive:
                try:
                    await self.reclaim(handoff)
                finally:
                    self._settled()

    async def reclaim(self, handoff: Handoff) -> Fate:
        """One orphan: its reclaim leg, or the reason it is dropped unsent."""
        host = self.host
        engine_cfg = host.config.engine
        now = trio.current_time()
        healthy, held_in = host.fleet.placeable("decode", now)
        candidates = [] if held_in else [e for e in healthy if e.id != handoff.producer]
        free = [e for e in candidates if host.client.limiter(e.url).available_tokens > 0]
        reason = reclaim_verdict(
            handoff,
            now,
            limit_s=engine_cfg.lease_limit_s,
            placeable=len(candidates),
            free=len(free),
        )
        if reason is not None:
            return self._drop(handoff, reason)
        # a consumer that already moved KV from this producer sends the release at once; a
        # cold one first opens its NIXL handshake, and an idle one may sit on the notice
        paired = host.fleet.paired
        # ties: the first in fleet order (min keeps the first of equals)
        consumer = min(free, key=lambda e: ((handoff.producer, e.id) not in paired, e.load))
        self.inflight += 1
        try:
            fate = await self._leg(handoff, consumer, engine_cfg.first_token_timeout_s)
        finally:
            self.inflight -= 1
        host.metrics.handoffs.labels(fate.value).inc()
        host.metrics.reclaim_seconds.observe(trio.current_time() - now)
        return fate

    async def _leg(self, handoff: Handoff, consumer: EngineState, bound_s: float) -> Fate:
        """The consumer refuses the reclaim request before admission and, doing so, tells
        the producer to free the blocks (``NixlConnector.reclaim_body``): any answer below
        500 is that refusal (or, from an engine that served it, a decode that read them)."""
        problem = f"no answer within {bound_s:g}s"
        with trio.move_on_after(bound_s):
            try:
                status = await self.host.client.reclaim(
                    consumer.url, handoff.result, request_id=handoff.backend_id
                )
            except EngineFault as fault:
                problem = fault.message
            else:
                if status < 500:
                    return Fate.RECLAIMED
                problem = f"consumer answered HTTP {status}"
        log_event(
            log,
            logging.WARNING,
            "reclaim leg failed",
            {"request_id": handoff.backend_id, "consumer": consumer.id, "error": problem},
        )
        return Fate.RECLAIM_FAILED

    def _drop(self, handoff: Handoff, reason: str) -> Fate:
        metrics = self.host.metrics
        metrics.handoffs.labels(Fate.RECLAIM_DROPPED.value).inc()
        metrics.reclaim_dropped.labels(reason).inc()
        log_event(
            log,
            logging.INFO,
            "orphaned handoff left to its lease",
            {"request_id": handoff.backend_id, "producer": handoff.producer, "reason": reason},
        )
        return Fate.RECLAIM_DROPPED
