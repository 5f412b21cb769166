"""The engines' own load, scraped from their ``/metrics`` off the request path (contract 4.4).

One loop per engine in the server's background nursery, every
``placement.metrics_interval_s`` (jittered, so routers do not scrape in step), each scrape
bounded by ``engine.health_timeout_s``, on the small pool of the active health checks (a
scrape never takes a data leg's connection). A loop ends when its engine leaves the fleet.
A failed scrape leaves the last report to go stale (placement ignores it after three
intervals) and is counted; it never moves the breaker: an engine that cannot report its
queue may still serve.
"""

from __future__ import annotations

import random
from typing import Protocol

import trio

from narwhal.core.config import FleetConfig
from narwhal.core.engine_report import ReportError, parse_report
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import RequestFault
from narwhal.core.fleet import Fleet
from narwhal.observe.metrics import Metrics
from narwhal.router.background import Background

IDLE_RECHECK_S = 1.0  # scraping off: how often to look whether a reload turned it on


class ScrapeHost(Protocol):
    config: FleetConfig
    fleet: Fleet
    background: Background
    metrics: Metrics


class Scraper:
    def __init__(self, router: ScrapeHost) -> None:
        self.router = router
        self._jitter = random.Random()
        self._scraped: set[int] = set()  # id() of the EngineStates with a loop running

    @property
    def interval_s(self) -> float:
        return self.router.config.placement.metrics_interval_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start a loop for every engine of the fleet, and for each one added later."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                if self.interval_s > 0:
                    for engine in self.router.fleet.engines:
                        if id(engine) not in self._scraped:
                            self._scraped.add(id(engine))
                            nursery.start_soon(self._loop, engine)
                await trio.sleep(min(self.interval_s or IDLE_RECHECK_S, IDLE_RECHECK_S))

    async def _loop(self, engine: EngineState) -> None:
        try:
            while self.router.fleet.by_id.get(engine.id) is engine and self.interval_s > 0:
                await self.scrape(engine)
                await trio.sleep(self.interval_s * self._jitter.uniform(0.8, 1.2))
        finally:
            self._scraped.discard(id(engine))
            engine.note_report(None)  # scraping stopped: nothing of it may steer placement

    async def scrape(self, engine: EngineState) -> bool:
        """One scrape of ``engine``; whether it gave a report."""
        client = self.router.background.checks_client()
        mark = engine.scrape_mark()  # legs sent from here on are not in what it answers
        with trio.move_on_after(self.router.config.engine.health_timeout_s):
            try:
                status, body = await client.get(engine.url, "/metrics")
                if status != 200:
                    raise ReportError(f"/metrics answered {status}")
                text = body.decode("utf-8", "replace")
                # our legs as the engine answered: its queue counts them too
                report = parse_report(text, trio.current_time(), ours=engine.load)
            except (RequestFault, ReportError):
                pass
            else:
                engine.note_report(report, mark)
                stream = self.router.fleet.precise.streams.get(engine.id)
                if stream is not None and report.kv_blocks:  # what its events can describe
                    stream.set_capacity(report.kv_blocks)
                engine.scrape_failures = 0
                self._export(engine)
                self.router.fleet.on_change()  # it may show room the queue waits for
                return True
        engine.scrape_failures += 1
        if engine.id in self.router.metrics.engines:
            self.router.metrics.scrape_failures.labels(engine.id).inc()
        self.router.fleet.on_change()  # its last report may have gone stale: look again
        return False

    def _export(self, engine: EngineState) -> None:
        metrics, report = self.router.metrics, engine.report
        if report is None or engine.id not in metrics.engines:
            return
        metrics.engine_requests.labels(engine.id, "running").set(report.running)
        metrics.engine_requests.labels(engine.id, "waiting").set(report.waiting)
        metrics.engine_kv_usage.labels(engine.id).set(report.kv_usage)
        ratio = report.prefix_hit_ratio
        if ratio is not None:
            metrics.engine_prefix_hit_ratio.labels(engine.id).set(ratio)
