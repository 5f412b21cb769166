"""Prometheus metrics: present from start, moved by traffic and faults, bounded labels."""

from __future__ import annotations

import re

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import narwhal
from narwhal.core.config import EngineConfig, RecoveryConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from narwhal.observe.batched_histogram import BatchedHistogram, RequestBuckets
from narwhal.observe.metric_series import GAP_BUCKETS
from tests.support.fleet import MODEL, Harness, finish, start_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}


async def scrape(harness: Harness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = await harness.get("/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples[(name, tuple(sorted(labels.items())))]


def finished(samples: dict, endpoint: str, outcome: str, status: str) -> float:  # type: ignore[type-arg]
    return value(
        samples,
        "narwhal_requests_total",
        model=MODEL,
        endpoint=endpoint,
        outcome=outcome,
        status=status,
    )


async def test_series_exist_from_start(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    samples = await scrape(harness)
    assert (
        value(
            samples,
            "narwhal_requests_total",
            model=MODEL,
            endpoint="completions",
            outcome="completed",
            status="200",
        )
        == 0
    )
    for engine in ("p0", "d0"):
        assert value(samples, "narwhal_engine_legs_inflight", engine=engine, phase="decode") == 0
        assert value(samples, "narwhal_engine_ejected", engine=engine) == 0
        assert (
            value(
                samples, "narwhal_engine_leg_failures_total", engine=engine, **{"class": "stream"}
            )
            == 0
        )
        assert value(samples, "narwhal_engine_probes_total", engine=engine, outcome="pass") == 0
    for fate in ("produced", "decoded", "expired", "orphaned"):
        assert value(samples, "narwhal_handoffs_total", fate=fate) == 0
    for reason in ("not_transient", "after_output", "attempts", "deadline", "budget"):
        assert value(samples, "narwhal_retries_denied_total", reason=reason) == 0
    assert value(samples, "narwhal_prefill_completion_seconds_count", model=MODEL) == 0
    await finish(harness)


async def test_traffic_and_faults_move_the_right_series(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5, handoff_timeout_s=0.2),
        engine=EngineConfig(first_token_timeout_s=0.3),
        recovery=RecoveryConfig(eject_after=2, readmit_interval_s=60),
    )
    for _ in range(3):
        assert (await harness.post("/v1/completions", BODY)).status == 200
    harness.engines["d0"].faults.push(Fault(kind="hang", leg="decode"), Fault(kind="done_first"))
    assert (await harness.post("/v1/completions", BODY)).status == 504
    assert (
        await harness.post(
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
            },
        )
    ).status == 502
    harness.engines["p0"].faults.push(Fault(kind="status", status=400))
    assert (await harness.post("/v1/completions", BODY)).status == 400
    assert (await harness.post("/v1/completions", {"model": "nope", "prompt": "x"})).status == 404
    await harness.router.wait_drained()
    s = await scrape(harness)
    assert finished(s, "completions", "completed", "200") == 3
    assert finished(s, "completions", "failed", "504") == 1
    assert finished(s, "chat", "failed", "502") == 1
    assert finished(s, "completions", "rejected", "404") == 1
    assert value(s, "narwhal_prefill_completion_seconds_count", model=MODEL) == 5
    assert value(s, "narwhal_time_to_first_token_seconds_count", model=MODEL) == 3
    assert value(s, "narwhal_kv_transfer_seconds_count", model=MODEL) == 3
    assert value(s, "narwhal_inter_token_latency_seconds_count") >= 0
    tokens = sum(line.tokens for line in harness.router.journal.lines)
    assert value(s, "narwhal_generation_tokens_total", model=MODEL) == tokens > 0
    prompt = sum(line.prompt_tokens or 0 for line in harness.router.journal.lines)
    assert value(s, "narwhal_prompt_tokens_total", model=MODEL) == prompt > 0
    assert value(s, "narwhal_requests_in_flight") == 0
    assert value(s, "narwhal_config_reloads_total", result="failure") == 0
    assert value(s, "process_resident_memory_bytes") > 0
    versions = [labels for name, labels in s if name == "narwhal_build_info"]
    assert versions
    assert dict(versions[0])["version"] == narwhal.__version__
    assert value(s, "narwhal_handoffs_total", fate="produced") == 5
    # the hung decode never answered: its descriptor is an orphan, reclaimed at once
    assert value(s, "narwhal_handoffs_total", fate="decoded") == 4
    assert value(s, "narwhal_handoffs_total", fate="orphaned") == 1
    assert value(s, "narwhal_engine_leg_failures_total", engine="d0", **{"class": "stream"}) == 2
    assert value(s, "narwhal_engine_ejections_total", engine="d0") == 1
    assert value(s, "narwhal_engine_ejected", engine="d0") == 1
    assert value(s, "narwhal_engine_held_in", engine="d0") == 1  # the only consumer
    assert value(s, "narwhal_engine_breaker_streak", engine="d0") == 2
    assert value(s, "narwhal_retries_denied_total", reason="attempts") == 2
    assert value(s, "narwhal_attempts_total") == 6
    # no label carries a request id or a raw message
    for _, labels in s:
        for _, label_value in labels:
            assert not re.fullmatch(r"[0-9a-f]{16}", label_value)
            assert len(label_value) <= 24
    await finish(harness)


async def test_an_expired_handoff_is_counted(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine_config={"prefill_delay_per_token_s": 0.1},
        serving=ServingConfig(graceful_timeout_s=0.5, handoff_timeout_s=0.15),
    )
    reply = await harness.post("/v1/completions", BODY)  # 2 prompt tokens: 0.2 s of prefill
    assert reply.status == 504
    assert reply.json()["error"]["message"].startswith("KV handoff expired")
    await harness.router.wait_drained()
    s = await scrape(harness)
    assert value(s, "narwhal_handoffs_total", fate="expired") == 1
    assert value(s, "narwhal_handoff_held_seconds_count") == 1
    await finish(harness)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.integers(1, 8)), max_size=40))
def test_request_buckets_count_as_observe_would(reads: list[tuple[float, int]]) -> None:
    """Per-request buckets flushed once give the histogram ``observe`` gives, and the
    batched histogram exports it as prometheus-client's ``Histogram`` does, line for line
    (its ``_created`` time aside)."""
    observed = Histogram(
        "gap", "Gaps.", registry=(theirs := CollectorRegistry()), buckets=GAP_BUCKETS
    )
    flushed = BatchedHistogram("gap", "Gaps.", GAP_BUCKETS, ours := CollectorRegistry())
    buckets = RequestBuckets(flushed)
    for gap, k in reads:
        for _ in range(k):
            observed.observe(gap / k)
        buckets.add(gap, k)
    buckets.flush()
    buckets.flush()  # idempotent: nothing is added twice

    def samples(registry: CollectorRegistry) -> dict[str, float]:
        return {
            f"{s.name}{s.labels}": s.value
            for metric in registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    got, want = samples(ours), samples(theirs)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key

    def lines(registry: CollectorRegistry) -> list[str]:
        """The exposition, its creation time and its sum left out (compared above)."""
        text = generate_latest(registry).decode()
        return [re.sub(r"^(gap_created|gap_sum) .*", r"\1 _", line) for line in text.splitlines()]

    assert lines(ours) == lines(theirs)
