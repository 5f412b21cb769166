"""Every series the router exports (``GET /metrics``), defined once: its name, its help,
its labels, its buckets and, for a gauge, how workers' values combine under
``--workers N`` (prometheus-client's multiprocess mode). ``narwhal.observe.metrics.Metrics`` is
these with the label sets it keeps and its rendering.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from narwhal.observe.batched_histogram import BatchedHistogram

# Buckets for LLM serving: handoffs are milliseconds to tens of seconds (KV stalls of
# 15-30 s are real), inter-token gaps milliseconds to seconds, requests up to minutes.
# FROM_ARRIVAL_BUCKETS: the arrival to the prefill's answer, and to the first token
FROM_ARRIVAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# observed over predicted: a median near 1 and its spread are what an operator reads
RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
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


class MetricSeries:
    """The series, registered in ``registry`` in the order they are defined here (the
    order of the exposition)."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
        # contract 5's two measurements, named as the ecosystem reads them: vLLM's and Dynamo's
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
        self.prediction_error = histogram(
            "narwhal_prediction_error_ratio",
            'Observed over predicted, policy "predicted": figure "ttft" (a plan\'s start to its '
            'first token) per engine that computed the prompt, "tpot" per consumer.',
            RATIO_BUCKETS,
            ("engine", "figure"),
        )
        self.slo = counter(
            "narwhal_slo_total",
            "Requests of a class with a latency target, by target (ttft, tpot) and whether "
            "it was met (a request that failed missed its TTFT target).",
            ("class", "target", "met"),
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
        # placement (contract 4.4): each decision by its reason; each engine's own report
        self.placements = counter(
            "narwhal_placement_decisions",
            "Legs placed, by leg and by why that engine: only, room (the one candidate "
            "with room, the others saturated), adapter, prefix_match, affinity, spill, "
            "least_loaded, round_robin.",
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
        # stream resume (contract 6.4)
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
        # flow control (contract 4.5), by class: interactive, default, batch
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
