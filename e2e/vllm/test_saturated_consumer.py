"""Flow control on real vLLM (contract 4.5): what a consumer has no room for waits in the router.

A second consumer is started with ``--max-num-seqs 2`` (two sequences at once; vLLM queues
the rest in ``vllm:num_requests_waiting``) and paired with the session's producer. A router
of its own runs with ``engine_waiting_limit = 1``: eight concurrent long requests are more
than the consumer's room, so the router holds them (``narwhal_queue_depth`` on its
``/metrics``), the consumer's own waiting queue stays at or below the limit (above it for
one sample at most: the router counts the slots the engine's last report showed free, and a
burst into them shows as waiting until the engine's next step schedules it), and every
request completes with all its tokens.

Runs last but for test_stream_resume (file order): its second consumer pairs with the
session's producer, and the suites before it never meet a consumer that has come and gone.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import (
    HANDOFF_S,
    KV_LEASE_S,
    MODEL,
    START_S,
    Engine,
    Fleet,
    Process,
    _engine,
    _vllm_dir,
    fleet_toml,
    http,
    serve_router,
    warm_pair,
)

pytestmark = pytest.mark.vllm

CLIENTS = 8
TOKENS = 120
SAMPLE_S = 0.2


@pytest.fixture(scope="module")
def small_consumer(fleet: Fleet) -> Iterator[Engine]:
    engine = _engine(_vllm_dir(), fleet.logs, "consumer-small", "kv_consumer")
    engine.argv += ["--max-num-seqs", "2"]  # the last one wins: two sequences at once
    engine.start()
    try:
        engine.wait_until(engine.url + "/health", START_S)
        warm_pair(fleet.producer, engine)
        yield engine
    finally:
        engine.stop()


def _scalar(text: str, series: str) -> float:
    """The sum of ``series`` over its label sets (not of the series whose names it begins:
    vLLM also exports ``vllm:num_requests_waiting_by_reason``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((series + "{", series + " "))
    )


def test_what_the_consumer_has_no_room_for_waits_in_the_router(
    fleet: Fleet, small_consumer: Engine
) -> None:
    text = fleet_toml(
        [("p0", fleet.producer.url, "prefill"), ("d-small", small_consumer.url, "decode")],
        serving={"request_timeout_s": 600.0, "prefill_timeout_s": 120.0},
        engine={
            "kv_lease_s": KV_LEASE_S,
            "first_token_timeout_s": 300.0,
            "decode_read_timeout_s": 60.0,
        },
        placement={"metrics_interval_s": 0.5},
        admission={"engine_waiting_limit": 1, "max_queue_wait_s": 500.0},
    )
    router: Process = serve_router(fleet, "router-flow", text)
    url = router.url  # type: ignore[attr-defined]
    answers: list[tuple[int, Any]] = []

    def client(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"request {i} tells a long story about",
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,  # every request runs its whole length: long, as asked
            "temperature": 0,
        }
        status, raw = http("POST", url + "/v1/completions", body, timeout=HANDOFF_S * 4)
        answers.append((status, json.loads(raw) if status == 200 else raw[:300]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    peaks = {"router_queued": 0.0, "engine_waiting": 0.0, "engine_running": 0.0}
    timeline: list[tuple[float, float, float, float]] = []
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + HANDOFF_S * 4
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            # sampling gauges through the run, bounded by the clients' own timeout
            ours = http("GET", url + "/metrics", timeout=30)[1].decode()
            theirs = http("GET", small_consumer.url + "/metrics", timeout=30)[1].decode()
            sample = (
                _scalar(ours, "narwhal_queue_depth"),
                _scalar(theirs, "vllm:num_requests_waiting"),
                _scalar(theirs, "vllm:num_requests_running"),
            )
            timeline.append((round(time.monotonic() - start, 2), *sample))
            for key, value in zip(peaks, sample, strict=True):
                peaks[key] = max(peaks[key], value)
            time.sleep(SAMPLE_S)
        for t in threads:
            t.join(timeout=30)
    finally:
        router.stop()
    print(f"\nflow control on real vLLM: peaks {peaks}, statuses {[s for s, _ in answers]}")
    print("timeline (s, router queued, engine waiting, engine running):", timeline)
    assert len(answers) == CLIENTS
    assert all(status == 200 for status, _ in answers), answers
    assert all(a["usage"]["completion_tokens"] == TOKENS for _, a in answers)
    assert peaks["router_queued"] >= 1  # the router held what the consumer had no room for
    # the engine's own queue stayed within the limit: a burst into its free slots shows as
    # waiting until its next step schedules it (one sample), a queue persists (two or more)
    over = [waiting > 1 for _, _, waiting, _ in timeline]
    assert not any(a and b for a, b in itertools.pairwise(over)), timeline
    assert peaks["engine_running"] <= 2
