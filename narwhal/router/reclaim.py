"""Reclaim legs (contract 5, invariant 7): a consumer is handed an orphaned descriptor so the
producer frees its KV blocks now, not when its lease runs out.

The request is the connector's ``reclaim_body``: one the consumer refuses before admission,
which makes vLLM (since vllm#41269) tell the producer to free the blocks, with no transfer
and no compute. The queue and its workers belong to the server's background nursery, never
to the request that left the orphan behind: that request is gone (its client left, its
deadline passed, its attempt failed), and its cancellation must not reach the reclaim.
``submit`` never blocks and never raises, so a request's ``finally`` can call it while
being cancelled. Each leg is bounded by ``engine.first_token_timeout_s``, goes to a
placeable consumer with room other than the producer and the consumer whose leg failed
(one that already moved KV from that producer first), never feeds the breaker or the client
metrics, and runs at most once per descriptor: a consumer whose connection fails before the
request was sent never saw it, so it goes once more to another consumer (counted), never a
third time. Where it goes, or why it is dropped, is ``narwhal.core.handoff``'s
``reclaim_plan``.
"""

from __future__ import annotations

import logging
from typing import Protocol

import trio

from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import ConnectTimeout, EngineFault, EngineUnreachable, HandoffExpired
from narwhal.core.fleet import Fleet
from narwhal.core.handoff import Fate, Handoff, reclaim_plan
from narwhal.engines.client import EngineClient
from narwhal.observe.logs import log_event
from narwhal.observe.metrics import Metrics

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
        """One orphan: its reclaim leg (and at most one more after a refused connection),
        or the reason it is dropped unsent."""
        host = self.host
        bound_s = host.config.engine.first_token_timeout_s
        start = trio.current_time()
        consumer = self._target(handoff, ())
        if isinstance(consumer, str):
            return self._drop(handoff, consumer)
        self.inflight += 1
        try:
            fate, reached = await self._leg(handoff, consumer, bound_s)
            if not reached:  # the request never left: another consumer may still take it
                second = self._target(handoff, (consumer.id,))
                if not isinstance(second, str):
                    host.metrics.reclaim_retries.inc()
                    fate, _ = await self._leg(handoff, second, bound_s)
        finally:
            self.inflight -= 1
        host.metrics.handoffs.labels(fate.value).inc()
        host.metrics.reclaim_seconds.observe(trio.current_time() - start)
        return fate

    def _target(self, handoff: Handoff, tried: tuple[str, ...]) -> EngineState | str:
        """``reclaim_plan`` over the fleet as it stands now: a consumer, or a drop reason."""
        host = self.host
        now = trio.current_time()
        # held-in consumers too: a breaker open for bad decodes says nothing of a refusal
        # before admission, and the last consumers of a fleet are still the only ones left
        consumers, _ = host.fleet.placeable("decode", now)
        return reclaim_plan(
            handoff,
            now,
            limit_s=host.config.engine.lease_limit_s,
            consumers=consumers,
            has_room=lambda e: host.client.limiter(e.url).available_tokens > 0,
            paired=host.fleet.paired,
            tried=tried,
        )

    async def _leg(
        self, handoff: Handoff, consumer: EngineState, bound_s: float
    ) -> tuple[Fate, bool]:
        """The consumer refuses the reclaim request before admission and, doing so, tells
        the producer to free the blocks (``NixlConnector.reclaim_body``): any answer below
        500 is that refusal (or, from an engine that served it, a decode that read them).
        Also whether the request may have reached the consumer: False only when the
        connection failed before it was sent (refused, or the connect timed out)."""
        problem = f"no answer within {bound_s:g}s"
        reached = True
        with trio.move_on_after(bound_s):
            try:
                status = await self.host.client.reclaim(
                    consumer.url,
                    handoff.result,
                    request_id=handoff.backend_id,
                    send_by=handoff.send_by(self.host.config.engine.lease_limit_s),
                )
            except HandoffExpired:  # its handoff clock fired before the request was sent
                self.host.metrics.reclaim_dropped.labels("lease").inc()
                return Fate.RECLAIM_DROPPED, True
            except EngineFault as fault:
                problem = fault.message
                reached = not isinstance(fault, EngineUnreachable | ConnectTimeout)
            else:
                if status < 500:
                    return Fate.RECLAIMED, True
                problem = f"consumer answered HTTP {status}"
        log_event(
            log,
            logging.WARNING,
            "reclaim leg failed",
            {"request_id": handoff.backend_id, "consumer": consumer.id, "error": problem},
        )
        return Fate.RECLAIM_FAILED, reached

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
