"""Prometheus metrics (``GET /metrics``), with prometheus-client: ``Metrics``, the series
(``narwhal.observe.metric_series``) with the label sets the router keeps, rendered by
``narwhal.observe.metrics_exposition``.

Every label value is bounded: endpoints, outcomes and HTTP statuses, engine ids from the
fleet file, phases, breaker classes, probe outcomes, retry-denial reasons. No request ids,
no raw messages. Series that may stay at zero are created at start, so dashboards and
alerts see them before the first incident.

With ``--workers N`` each worker writes to the directory named by
``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any worker sums them all (prometheus-client's
multiprocess mode); gauges then say how they combine across workers, always over live
workers only (``live*`` modes: the parent, ``narwhal.process.workers``, marks a worker dead when
it exits, and its gauges stop counting at once).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from typing import Any, Generic, TypeVar, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)

from narwhal.core.breaker import ProbeOutcome
from narwhal.core.disaggregation import DECISIONS
from narwhal.core.engine_state import LEGS
from narwhal.core.faults import BreakerClass, Phase
from narwhal.core.flow import SATURATIONS, Exit, Priority
from narwhal.core.handoff import DROP_REASONS, FATES
from narwhal.core.placement import REASONS
from narwhal.core.precise_index import REJECTS as KV_REJECTS
from narwhal.core.records import JournalLine
from narwhal.core.resume import OUTCOMES as RESUME_OUTCOMES
from narwhal.core.retry import Denial
from narwhal.observe.metric_series import MetricSeries
from narwhal.observe.metrics_exposition import exposition

ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
M = TypeVar("M", Counter, Gauge, Histogram)
# label sets come from the enums that the code records, so a new value is never unexported
PHASES = tuple(p.value for p in Phase)
BREAKER_CLASSES = tuple(c.value for c in BreakerClass if c is not BreakerClass.NONE)
PROBE_OUTCOMES = get_args(ProbeOutcome)
DENIALS = tuple(d.value for d in Denial)
CLASSES = tuple(c.value for c in Priority)
SHEDS = tuple(e.value for e in Exit if e is not Exit.DISPATCHED)


class Children(Generic[M]):
    """A labelled metric's children, each made once by its label values: ``labels()``
    validates the values and takes the metric's lock on every call, and a request makes
    several. Only for metrics whose label sets are never removed (not the engines')."""

    __slots__ = ("_made", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._made: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._made.get(values)
        if child is None:
            child = self._made[values] = self._metric.labels(*values)
        return child


class Metrics(MetricSeries):
    def __init__(self, engine_ids: Iterable[str], model: str = "") -> None:
        self.model = model  # the one model a router serves: a bounded label
        self.engines: set[str] = set()  # the fleet's engines: their series are exported
        self.registry = registry = CollectorRegistry()
        # process_cpu_seconds_total, process_resident_memory_bytes, open fds (one process;
        # with --workers each worker's own, which a multiprocess scrape cannot sum)
        ProcessCollector(registry=registry)
        engine_ids = list(engine_ids)
        super().__init__(registry)  # every series, after the process's
        self._initialise(engine_ids)
        # per-request series, bound once: a label lookup per request is measurable on the hot path
        self.requests_of = Children(self.requests)
        self.handoffs_of = Children(self.handoffs)
        self.disconnects_of = Children(self.disconnects)
        self.placements_of = Children(self.placements)
        self.disaggregation_of = Children(self.disaggregation)
        self.resumes_of = Children(self.resumes)
        self.queue_dispatched_of = Children(self.queue_dispatched)
        self.queue_wait_of = Children(self.queue_wait)
        self.queue_depth_of = Children(self.queue_depth)
        self.queue_shed_of = Children(self.queue_shed)
        self.generation_tokens_of = Children(self.generation_tokens)
        self.prompt_tokens_of = Children(self.prompt_tokens)
        self.prefill_completion_of = Children(self.prefill_completion)
        self.time_to_first_token_of = Children(self.time_to_first_token)
        self.kv_transfer_of = Children(self.kv_transfer)
        self.slo_of = Children(self.slo)

    def _initialise(self, engine_ids: list[str]) -> None:
        for endpoint in ENDPOINTS.values():
            self.requests.labels(self.model, endpoint, "completed", "200")
        self.generation_tokens.labels(self.model)
        self.prompt_tokens.labels(self.model)
        self.prefill_completion.labels(self.model)
        self.time_to_first_token.labels(self.model)
        self.kv_transfer.labels(self.model)
        for reason in DENIALS:
            self.retries_denied.labels(reason)
        for phase in PHASES:
            self.disconnects.labels(phase)
        for result in ("success", "failure"):
            self.reloads.labels(result)
        self.reloaded_at.set_to_current_time()
        self.build_info.labels(*_versions()).set(1)
        for fate in FATES:
            self.handoffs.labels(fate)
        for reason in DROP_REASONS:
            self.reclaim_dropped.labels(reason)
        for leg in LEGS:
            for why in REASONS:
                self.placements.labels(leg, why)
        for cls in CLASSES:
            for target in ("ttft", "tpot"):
                for met in ("yes", "no"):
                    self.slo.labels(cls, target, met)
        for decision in DECISIONS:
            self.disaggregation.labels(decision)
        for outcome in RESUME_OUTCOMES:
            self.resumes.labels(outcome)
        for cls in CLASSES:
            self.queue_depth.labels(cls, self.model).set(0)
            self.queue_wait.labels(cls, self.model)
            self.queue_dispatched.labels(cls, self.model)
            for shed in SHEDS:
                self.queue_shed.labels(cls, shed, self.model)
        for engine in engine_ids:
            self.add_engine(engine)

    def record(self, line: JournalLine, ttft_slo_s: float | None = None) -> None:
        """A finished request's series, from its journal line; ``ttft_slo_s``: its class's
        TTFT target (a request that failed missed it)."""
        endpoint = ENDPOINTS.get(line.endpoint, "other")
        model = line.model or self.model  # a request refused before its name resolved: ours
        self.requests_of(model, endpoint, line.outcome, str(line.status or 0)).inc()
        self.duration.observe(line.duration_s)
        if line.tokens:
            self.generation_tokens_of(model).inc(line.tokens)
        if line.prompt_tokens:
            self.prompt_tokens_of(model).inc(line.prompt_tokens)
        if line.prefill_s is not None:
            self.prefill_completion_of(model).observe(line.prefill_s)
        first = line.first_byte_s
        if first is not None:
            self.time_to_first_token_of(model).observe(first)
            if line.prefill_s is not None:
                self.kv_transfer_of(model).observe(first - line.prefill_s)
        if ttft_slo_s is not None and line.cls is not None:
            met = line.status == 200 and first is not None and first <= ttft_slo_s
            self.slo_of(line.cls, "ttft", "yes" if met else "no").inc()
        if line.outcome == "cancelled" and line.phase:
            self.disconnects_of(line.phase).inc()

    def add_engine(self, engine: str) -> None:
        self.engines.add(engine)
        for leg in LEGS:
            self.legs_inflight.labels(engine, leg)
        for cls in BREAKER_CLASSES:
            self.leg_failures.labels(engine, cls)
        for outcome in PROBE_OUTCOMES:
            self.probes.labels(engine, outcome)
        for metric in (self.streak, self.ejected, self.quarantined, self.held_in, self.up):
            metric.labels(engine).set(0)
        self.ejections.labels(engine)
        self.readmissions.labels(engine)
        self.scrape_failures.labels(engine)
        self.model_lists_refused.labels(engine)
        self.kv_stream_live.labels(engine).set(0)
        for why in SATURATIONS:
            self.engine_saturated.labels(engine, why).set(0)

    def remove_engine(self, engine: str) -> None:
        """An engine left the fleet (reload, or gone from DNS): its series go with it, so
        pods that come and go leave no series behind and no alert firing for an engine
        that no longer exists. Its legs still in flight keep their gauge objects."""
        self.engines.discard(engine)
        labelled: list[tuple[Any, tuple[str, ...]]] = [
            *((self.legs_inflight, (engine, leg)) for leg in LEGS),
            *((self.leg_failures, (engine, cls)) for cls in BREAKER_CLASSES),
            *((self.probes, (engine, outcome)) for outcome in PROBE_OUTCOMES),
            *((self.engine_requests, (engine, state)) for state in ("running", "waiting")),
            *((self.engine_saturated, (engine, why)) for why in SATURATIONS),
            *((self.kv_event_gaps, (engine, o)) for o in ("repaired", "unrepaired")),
            *((self.kv_events_rejected, (engine, why)) for why in KV_REJECTS),
            *((self.prediction_error, (engine, figure)) for figure in ("ttft", "tpot")),
            *(
                (metric, (engine,))
                for metric in (
                    self.streak,
                    self.ejected,
                    self.quarantined,
                    self.held_in,
                    self.up,
                    self.ejections,
                    self.readmissions,
                    self.engine_kv_usage,
                    self.engine_prefix_hit_ratio,
                    self.scrape_failures,
                    self.model_lists_refused,
                    self.kv_event_batches,
                    self.kv_events,
                    self.kv_events_skipped,
                    self.kv_event_replays,
                    self.kv_event_restarts,
                    self.kv_blocks,
                    self.kv_stream_live,
                )
            ),
        ]
        for metric, labels in labelled:
            with contextlib.suppress(KeyError):  # never created
                metric.remove(*labels)

    def render(self) -> bytes:
        """The exposition text; under multiprocess mode, summed over every worker."""
        return exposition(self.registry, frozenset(self.engines), [self.token_gap])


def _versions() -> tuple[str, str, str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import narwhal

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"

    python = ".".join(map(str, sys.version_info[:3]))
    return narwhal.__version__, python, of("trio"), of("hypercorn")
