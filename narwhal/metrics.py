"""Prometheus metrics (``GET /metrics``), with prometheus-client.

Every label value is bounded: endpoints, outcomes and HTTP statuses, engine ids from the
fleet file, phases, breaker classes, probe outcomes, retry-denial reasons. No request ids,
no raw messages. Series that may stay at zero are created at start, so dashboards and
alerts see them before the first incident.

With ``--workers N`` each worker writes to the directory named by
``PROMETHEUS_MULTIPROC_DIR`` and a scrape of any worker sums them all (prometheus-client's
multiprocess mode); gauges then say how they combine across workers, always over live
workers only (``live*`` modes: the parent, ``narwhal.workers``, marks a worker dead when
it exits, and its gauges stop counting at once).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString

from narwhal.core.breaker import ProbeOutcome
from narwhal.core.disaggregation import DECISIONS
from narwhal.core.engine_state import LEGS
from narwhal.core.faults import BreakerClass, Phase
from narwhal.core.flow import SATURATIONS, Exit, Priority
from narwhal.core.handoff import DROP_REASONS, FATES
from narwhal.core.placement import REASONS
from narwhal.core.precise_index import REJECTS as KV_REJECTS
from narwhal.core.resume import OUTCOMES as RESUME_OUTCOMES
from narwhal.core.retry import Denial

# Buckets for LLM serving: handoffs are milliseconds to tens of seconds (KV stalls of
# 15-30 s are real), inter-token gaps milliseconds to seconds, requests up to minutes.
# FROM_ARRIVAL_BUCKETS: the arrival to the prefill's answer, and to the first token
FROM_ARRIVAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    15.0,
    30.0,
)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)
QUEUE_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

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


class BatchedHistogram(Collector):
    """An unlabelled histogram whose observations come in batches (``RequestBuckets``),
    through prometheus-client's public API: its counts are the children of a counter (one
    per bucket, and ``le="sum"`` for the sum) kept out of every registry, and as a
    collector it exports them as the histogram family a ``Histogram`` exports, the same
    bytes (``_bucket``, ``_count``, ``_sum``, ``_created``). Under multiprocess mode the
    counts are in the workers' files as every value is, and ``Metrics.render`` turns the
    summed counter into the same histogram family (``histogram_of``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        # the upper bounds, +Inf last, as a Histogram makes them
        self.bounds = [*map(float, buckets), *([] if buckets[-1] == INF else [INF])]
        self._les = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]
        self._counter = Counter(name, documentation, ("le",), registry=None)
        self._per_bucket = [self._counter.labels(le) for le in self._les]
        self._total = self._counter.labels("sum")
        self._since = time.time()  # the family's _created, as a Histogram's
        if registry is not None:
            registry.register(self)

    def add(self, counts: Sequence[int], total: float) -> None:
        """``counts[i]`` observations in the bucket of ``bounds[i]``, summing ``total``."""
        for bucket, count in zip(self._per_bucket, counts, strict=True):
            if count:
                bucket.inc(count)
        self._total.inc(total)

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        values: dict[str, float] = {}
        created = False  # whether the counter says _created series are exported
        for metric in self._counter.collect():
            for sample in metric.samples:
                if sample.name == self.name + "_total":
                    values[sample.labels["le"]] = sample.value
                else:
                    created = True
        family = self.histogram_of(values)
        if created:
            family.add_sample(self.name + "_created", {}, self._since)
        return [family]

    def histogram_of(self, values: dict[str, float], *, sum_first: bool = False) -> Metric:
        """The histogram family of the counts ``values`` (by ``le``; the sum at
        ``"sum"``): as a ``Histogram`` collects it, or with ``sum_first``, as prometheus-
        client's multiprocess collector merges a histogram's files (its order)."""
        total = values.get("sum", 0.0)
        cumulative, count = [], 0.0
        for le in self._les:
            count += values.get(le, 0.0)
            cumulative.append((le, count))
        if not sum_first:
            return HistogramMetricFamily(
                self.name, self.documentation, buckets=cumulative, sum_value=total
            )
        family = Metric(self.name, self.documentation, "histogram")
        family.add_sample(self.name + "_sum", {}, total)
        for le, value in cumulative:
            family.add_sample(self.name + "_bucket", {"le": le}, value)
        family.add_sample(self.name + "_count", {}, count)
        return family


class RequestBuckets:
    """One request's observations of a histogram, counted here and added to it once
    (``flush``): the per-token path takes no lock and calls no metric
    (``bench/results/relay-reactor.md``). Each observation lands in the bucket
    prometheus-client's ``observe`` would pick (the first
    upper bound it does not exceed)."""

    __slots__ = ("_bounds", "_counts", "_histogram", "_sum")

    def __init__(self, histogram: BatchedHistogram) -> None:
        self._histogram = histogram
        self._bounds = histogram.bounds
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def add(self, total: float, k: int = 1) -> None:
        """``k`` observations of ``total / k`` each (tokens that came in one read)."""
        self._counts[bisect_left(self._bounds, total / k)] += k
        self._sum += total

    def flush(self) -> None:
        """Add the counts to the histogram (nothing when nothing was observed); idempotent."""
        counts = self._counts
        if not any(counts):
            return
        self._histogram.add(counts, self._sum)
        self._counts = [0] * len(counts)
        self._sum = 0.0


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


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class Metrics:
    def __init__(self, engine_ids: Iterable[str], model: str = "") -> None:
        self.model = model  # the one model a router serves: a bounded label
        self.engines: set[str] = set()  # the fleet's engines: their series are exported
        self.registry = registry = CollectorRegistry()
        # process_cpu_seconds_total, process_resident_memory_bytes, open fds (one process;
        # with --workers each worker's own, which a multiprocess scrape cannot sum)
        ProcessCollector(registry=registry)
        engine_ids = list(engine_ids)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...], mode: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode)  # type: ignore[arg-type]

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
        ) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets)

        self.requests = counter(
            "narwhal_requests",
            "Finished client requests.",
            ("model", "endpoint", "outcome", "status"),
        )
        # SPEC 5's two measurements, named as the ecosystem reads them: vLLM's and Dynamo's
        # "time to first token" is the client's first token (the journal's first_byte_s);
        # the producer's answer (the journal's prefill_s) is the prefill's completion
        self.prefill_completion = histogram(
            "narwhal_prefill_completion_seconds",
            "Arrival to the producer's answer (prefill done): the journal's prefill_s.",
            FROM_ARRIVAL_BUCKETS,
            ("model",),
        )
        self.time_to_first_token = histogram(
            "narwhal_time_to_first_token_seconds",
            "Arrival to the first generated token relayed to the client (vLLM's and Dynamo's "
            "time to first token): the journal's first_byte_s.",
            FROM_ARRIVAL_BUCKETS,
            ("model",),
        )
        self.kv_transfer = histogram(
            "narwhal_kv_transfer_seconds",
            "Time to first token less prefill completion: KV transfer plus decode queueing.",
            TRANSFER_BUCKETS,
            ("model",),
        )
        self.in_flight = gauge(
            "narwhal_requests_in_flight",
            "Admitted client requests not yet finished.",
            (),
            "livesum",
        )
        self.generation_tokens = counter(
            "narwhal_generation_tokens",
            "Generated tokens relayed to clients (the consumers' own count, their usage).",
            ("model",),
        )
        self.prompt_tokens = counter(
            "narwhal_prompt_tokens",
            "Prompt tokens computed for requests: by producers, or by a consumer serving "
            "a request alone (the engines' own count).",
            ("model",),
        )
        self.reloads = counter(
            "narwhal_config_reloads", "Fleet file reloads, by result.", ("result",)
        )
        self.reloaded_at = gauge(
            "narwhal_config_last_reload_success_timestamp_seconds",
            "When the fleet file was last applied (start or reload), Unix seconds.",
            (),
            "livemax",
        )
        self.build_info = gauge(
            "narwhal_build_info",
            "1, labelled with the versions running.",
            ("version", "python", "trio", "hypercorn"),
            "livemax",
        )
        # observed per token, added per request (RequestBuckets)
        self.token_gap = BatchedHistogram(
            "narwhal_inter_token_latency_seconds",
            "Time between generated tokens, per token (vLLM's inter-token latency): a read "
            "that brings k tokens after a gap counts k tokens a k-th of it apart.",
            GAP_BUCKETS,
            registry,
        )
        self.duration = histogram(
            "narwhal_request_duration_seconds",
            "Arrival to the end of the response.",
            DURATION_BUCKETS,
        )
        self.attempts = counter("narwhal_attempts", "Prefill/decode attempts started.")
        self.retries = counter("narwhal_retries", "Fresh attempts after a transient fault.")
        self.retries_denied = counter(
            "narwhal_retries_denied", "Faults not retried, by the rule that refused.", ("reason",)
        )
        self.retry_credits = gauge(
            "narwhal_retry_credits", "Router-wide retry credits left.", (), "livemin"
        )
        self.disconnects = counter(
            "narwhal_client_disconnects", "Clients gone before the end, by phase.", ("phase",)
        )
        self.handoffs = counter(
            "narwhal_handoffs",
            "KV descriptors: produced, then each by its fate: decoded (a consumer accepted "
            "the decode leg), expired (too old for the producer's lease, never sent), "
            "orphaned (no decode will read it); an orphan then reclaimed, reclaim_failed or "
            "reclaim_dropped (left to the lease).",
            ("fate",),
        )
        self.reclaim_dropped = counter(
            "narwhal_reclaim_dropped",
            "Orphaned handoffs left to the producer's lease, by why no reclaim leg was sent.",
            ("reason",),
        )
        self.reclaim_retries = counter(
            "narwhal_reclaim_retries",
            "Reclaim legs sent to a second consumer after the first one's connection failed "
            "before the request was sent (at most one per orphan).",
        )
        self.reclaim_seconds = histogram(
            "narwhal_reclaim_seconds",
            "Reclaim legs: orphan taken from the queue to the consumer's answer.",
            TRANSFER_BUCKETS,
        )
        self.handoff_held = histogram(
            "narwhal_handoff_held_seconds",
            "Producer completion to dispatch or abandonment of its descriptor.",
            TRANSFER_BUCKETS,
        )
        engine = ("engine",)
        self.legs_inflight = gauge(
            "narwhal_engine_legs_inflight", "Legs in flight.", ("engine", "phase"), "livesum"
        )
        self.leg_failures = counter(
            "narwhal_engine_leg_failures",
            "Engine-side leg failures by breaker class.",
            ("engine", "class"),
        )
        self.streak = gauge(
            "narwhal_engine_breaker_streak", "Consecutive engine-side failures.", engine, "livemax"
        )
        self.up = gauge(
            "narwhal_engine_up",
            "1 while the engine answers its active /health checks (placeable only then).",
            engine,
            "livemax",
        )
        self.ejected = gauge(
            "narwhal_engine_ejected", "1 while the engine is out of placement.", engine, "livemax"
        )
        self.quarantined = gauge(
            "narwhal_engine_quarantined", "1 while the engine is quarantined.", engine, "livemax"
        )
        self.held_in = gauge(
            "narwhal_engine_held_in",
            "1 while an unhealthy engine stays placeable as the last of its role.",
            engine,
            "livemax",
        )
        # placement (SPEC 4.4): each decision by its reason; each engine's own report
        self.placements = counter(
            "narwhal_placement_decisions",
            "Legs placed, by leg and by why that engine: only, prefix_match, affinity, "
            "spill, least_loaded, round_robin.",
            ("leg", "reason"),
        )
        self.disaggregation = counter(
            "narwhal_disaggregation_decisions",
            "Attempts placed decode first, by what was decided: local_short (the part of "
            "the prompt its consumer does not hold was short), local_busy (every producer "
            "was saturated), local_one_engine (the only engine that could decode was the "
            "producer chosen, in any placement), disaggregated.",
            ("decision",),
        )
        # stream resume (SPEC 6.4)
        self.resumes = counter(
            "narwhal_stream_resumes",
            "Streams that failed after output with resume on, by what followed: resumed (a "
            "continuation started), refused (the terminal event: its reason in the "
            "journal), completed, failed and cancelled (how a resumed stream ended).",
            ("outcome",),
        )
        self.resume_gap = histogram(
            "narwhal_stream_resume_gap_seconds",
            "What a resumed stream's client waited between the last token before the "
            "failure and the first token of the continuation.",
            DURATION_BUCKETS,
        )
        self.engine_requests = gauge(
            "narwhal_engine_requests",
            "The engine's own queue from its last scrape: running and waiting requests.",
            ("engine", "state"),
            "livemax",
        )
        self.engine_kv_usage = gauge(
            "narwhal_engine_kv_cache_usage_ratio",
            "The engine's KV cache usage (0..1) from its last scrape.",
            engine,
            "livemax",
        )
        self.engine_prefix_hit_ratio = gauge(
            "narwhal_engine_prefix_cache_hit_ratio",
            "The engine's prefix cache hits over queries (tokens, since it started).",
            engine,
            "livemax",
        )
        self.model_lists_refused = counter(
            "narwhal_engine_model_lists_refused",
            "Model lists (GET /v1/models) the engine answered that were refused: not a "
            "list, too large, or with names out of bounds; its last good list stays.",
            engine,
        )
        self.scrape_failures = counter(
            "narwhal_engine_scrape_failures",
            "Scrapes of the engine's /metrics that failed or timed out (placement then "
            "weighs this router's legs alone; the breaker never hears of it).",
            engine,
        )
        # the precise prefix index: each engine's KV-event stream (with --workers, each
        # worker reads every batch, so the counters sum over workers; the gauges do not)
        self.kv_event_batches = counter(
            "narwhal_kv_event_batches", "KV-event batches read from the engine.", engine
        )
        self.kv_events = counter(
            "narwhal_kv_events", "KV events applied to the engine's precise index.", engine
        )
        self.kv_events_rejected = counter(
            "narwhal_kv_events_rejected",
            "KV-event messages, batches or events refused (malformed, unknown parent, over "
            "the engine's capacity, seen twice), by reason; never fatal.",
            ("engine", "why"),
        )
        self.kv_events_skipped = counter(
            "narwhal_kv_events_skipped",
            "KV events of a type the router does not know (a newer engine), skipped.",
            engine,
        )
        self.kv_event_gaps = counter(
            "narwhal_kv_event_gaps",
            "Sequence gaps in the engine's KV-event stream, by outcome (repaired by replay, "
            "or unrepaired: the engine's entries were dropped).",
            ("engine", "outcome"),
        )
        self.kv_event_replays = counter(
            "narwhal_kv_event_replays", "Replays asked of the engine's replay socket.", engine
        )
        self.kv_event_restarts = counter(
            "narwhal_kv_event_restarts",
            "Engine restarts seen in its KV-event stream (its sequence went back).",
            engine,
        )
        self.kv_blocks = gauge(
            "narwhal_kv_blocks",
            "Blocks the engine's KV events say it holds (the precise index).",
            engine,
            "livemax",
        )
        self.kv_stream_live = gauge(
            "narwhal_kv_event_stream_live",
            "1 while the engine's KV-event stream is live (placement reads its events), "
            "0 while it is unknown or repairing (placement falls back to its estimate).",
            engine,
            "livemax",
        )
        self.tasks = gauge(
            "narwhal_tasks",
            "Live trio tasks in the worker; back to its idle level once traffic stops.",
            (),
            "livesum",
        )
        self.ejections = counter("narwhal_engine_ejections", "Ejections.", engine)
        self.probes = counter("narwhal_engine_probes", "Readmission probes.", ("engine", "outcome"))
        self.readmissions = counter("narwhal_engine_readmissions", "Readmissions.", engine)
        self.journal_dropped = counter(
            "narwhal_journal_dropped",
            "Journal lines never written: the writer was behind, or the disk or pipe failed.",
        )
        self.log_dropped = counter(
            "narwhal_log_dropped",
            "Log lines never written: stderr blocked, or its writer was behind.",
        )
        # DNS discovery ([[discover]]), by block name (from the fleet file)
        self.discovery_engines = gauge(
            "narwhal_discovery_engines",
            "Engines a [[discover]] name stands for: its last good set of addresses.",
            ("name",),
            "livemax",
        )
        self.discovery_failures = counter(
            "narwhal_discovery_failures",
            "Resolutions of a [[discover]] name that failed (the last good set was kept).",
            ("name",),
        )
        self.discovery_last_success = gauge(
            "narwhal_discovery_last_success_timestamp_seconds",
            "Unix time of the latest resolution of a [[discover]] name that fully answered.",
            ("name",),
            "livemax",
        )
        self.connection_errors = counter(
            "narwhal_connection_errors",
            "Client connections closed by their error boundary: an exception inside the "
            "server (protocol or codec) that ended that connection only.",
        )
        # flow control (SPEC 4.5), by class: interactive, default, batch
        self.queue_depth = gauge(
            "narwhal_queue_depth",
            "Requests waiting in the admission queue for the fleet to have room.",
            ("class", "model"),
            "livesum",
        )
        self.queue_wait = histogram(
            "narwhal_queue_wait_seconds",
            "Time a request waited in the admission queue before it was dispatched or shed "
            "(0 for one dispatched on arrival).",
            QUEUE_WAIT_BUCKETS,
            ("class", "model"),
        )
        self.queue_dispatched = counter(
            "narwhal_queue_dispatched",
            "Requests that went on to the engines, on arrival or from the queue.",
            ("class", "model"),
        )
        self.queue_shed = counter(
            "narwhal_queue_shed",
            "Requests that left the admission queue without being dispatched, by why: "
            "queue_full, displaced, max_queue_wait, deadline (429), drained (503), "
            "cancelled (the client left).",
            ("class", "reason", "model"),
        )
        self.engine_saturated = gauge(
            "narwhal_engine_saturated",
            "1 while the engine is saturated for the admission queue, by why: waiting "
            "(its waiting queue reached engine_waiting_limit) or kv_usage.",
            ("engine", "reason"),
            "livemax",
        )
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
        directory = multiprocess_dir()
        if directory is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        collector = multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        # the workers' files cannot forget a label set: an engine that left the fleet is
        # dropped here, as remove_engine drops it from a single process's registry
        registry.unregister(collector)
        histograms = _AsHistograms(collector, [self.token_gap])
        registry.register(_CurrentEngines(histograms, frozenset(self.engines)))
        return generate_latest(registry)


class _CurrentEngines:
    """A collector's metrics without the samples of engines no longer in the fleet."""

    def __init__(self, inner: Any, engines: frozenset[str]) -> None:
        self.inner = inner
        self.engines = engines

    def collect(self) -> Iterable[Any]:
        for metric in self.inner.collect():
            metric.samples = [
                sample
                for sample in metric.samples
                if "engine" not in sample.labels or sample.labels["engine"] in self.engines
            ]
            yield metric


class _AsHistograms:
    """A collector's metrics with each batched histogram's summed counter (its name, type
    counter) as that histogram's family."""

    def __init__(self, inner: Any, batched: Iterable[BatchedHistogram]) -> None:
        self.inner = inner
        self.batched = {histogram.name: histogram for histogram in batched}

    def collect(self) -> Iterator[Any]:
        for metric in self.inner.collect():
            histogram = self.batched.get(metric.name)
            if histogram is None or metric.type != "counter":
                yield metric
                continue
            values = {sample.labels["le"]: sample.value for sample in metric.samples}
            yield histogram.histogram_of(values, sum_first=True)


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
