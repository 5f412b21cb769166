"""Prefix affinity on real vLLM (contract 4.4, issue "placement" item 6).

A second producer joins the session's pair for this module only (a module fixture: the
other tests need two engines, and a third one idle through them would hold another
~3.3 GiB of the 24 GiB machine for minutes). Then the same 20 chat requests, a long shared
system prompt and a short question of their own each, go through a router twice: once
placed ``round_robin`` without affinity, once ``least_loaded`` with prefix affinity, each
phase with a system prompt of its own (no block of one phase's prompt can serve the other).

Each producer's ``vllm:prefix_cache_hits_total`` and ``vllm:prefix_cache_queries_total``
(tokens; vLLM V1 caches prefixes by default, the log's config line says so) are read
before and after each phase; the hit ratio is the sum of the hit deltas over the sum of
the query deltas of both producers. Round robin sends the prompt to both producers, so
both compute it once; affinity sends it to one home, which computes it once: 18 warm
requests of 20 against 19 (a warm one hits 3 blocks of 128 tokens, 384 of ~443). The
ratios and per-producer deltas are printed and written to ``results/prefix_affinity.json``.

Three tests in file order: the second producer up with prefix caching on (its start-up),
the round-robin phase, then the affinity phase and the comparison (``PHASES`` carries the
first phase's numbers to it). Each stays under the suite's 120 s faulthandler dump.

The CPU backend's KV block is 128 tokens and the model's context 512, so the shared
system prompt is sized (with the engine's /tokenize) to at least 400 tokens: three full
blocks a warm request can hit.

Runs after test_kv_lease and before test_real_vllm kills the consumer (file order).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    KV_LEASE_S,
    MODEL,
    Engine,
    Fleet,
    Process,
    http,
    serve_router,
    start_engine,
    warm_pair,
)

pytestmark = pytest.mark.vllm

REQUESTS = 20
SYSTEM_TOKENS = 400  # >= 3 full KV blocks of 128 (the CPU backend's block size)
MAX_TOKENS = 8
CONTEXT = 512  # serve_nixl.sh --max-model-len
METRICS_INTERVAL_S = 1.0
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
RESULTS = Path(__file__).parent / "results" / "prefix_affinity.json"
PHASES: dict[str, dict[str, Any]] = {}  # each phase's numbers, as the tests measure them

ROUTER = """\
model = "{model}"

[[engines]]
id = "p0"
url = "{p0}"
role = "prefill"

[[engines]]
id = "p1"
url = "{p1}"
role = "prefill"

[[engines]]
id = "d0"
url = "{d0}"
role = "decode"

[serving]
request_timeout_s = 300.0
prefill_timeout_s = 120.0
max_attempts = 1

[engine]
kv_lease_s = {lease}
first_token_timeout_s = 120.0
decode_read_timeout_s = 60.0
health_timeout_s = 10.0

[placement]
policy = "{policy}"
metrics_interval_s = {interval}
prefix_affinity = {affinity}
"""

SENTENCES = [
    "You answer questions for the harbour office of a small northern town.",
    "Ferries leave the north pier every hour from six in the morning until ten at night.",
    "Mooring fees are paid by the night at the kiosk beside the fuel dock.",
    "The tide tables are posted on the board outside the office and change every week.",
    "In a storm warning every departure waits until the harbour master clears it.",
    "Bicycles travel free on the morning boats and at half price after noon.",
    "Dogs are welcome on deck but must stay on a lead near the gangway.",
    "The cafe on the quay opens at seven and closes when the last ferry is in.",
    "Lost property is kept for thirty days in the back room of the office.",
    "Fishing from the breakwater is allowed outside the marked channel only.",
    "Always answer briefly, politely and with the exact times where you know them.",
    "If a question is not about the harbour, say that you cannot help with it.",
]


@dataclass
class Producers:
    p0: Engine
    p1: Engine
    consumer: Engine

    @property
    def by_id(self) -> dict[str, Engine]:
        return {"p0": self.p0, "p1": self.p1}


@pytest.fixture(scope="module")
def producers(fleet: Fleet) -> Iterator[Producers]:
    """The session's producer and consumer and a second producer, started here."""
    second = start_engine(fleet, "producer-b", "kv_producer")
    try:
        for producer in (fleet.producer, second):
            warm_pair(producer, fleet.consumer)
        yield Producers(fleet.producer, second, fleet.consumer)
    finally:
        second.stop()


def tokens(engine: Engine, text: str) -> int:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    status, raw = http("POST", engine.url + "/tokenize", body, timeout=30)
    assert status == 200, raw
    return int(json.loads(raw)["count"])


def system_prompt(engine: Engine, tag: str) -> str:
    """At least ``SYSTEM_TOKENS`` tokens, opening with ``tag`` and a fresh nonce: its very
    first block differs from every other prompt these engines ever saw."""
    text = f"[{tag} {secrets.token_hex(4)}]"
    for i in range(100):  # bounded: each sentence adds a dozen tokens or more
        if tokens(engine, text) >= SYSTEM_TOKENS:
            return text
        text += " " + SENTENCES[i % len(SENTENCES)]
    raise AssertionError("the system prompt did not reach its size")


def question(i: int) -> str:
    return f"Question {i}: when does ferry number {i + 3} leave on day {i % 7 + 1}?"


def start_router(fleet: Fleet, p: Producers, name: str, policy: str, affinity: bool) -> Process:
    return serve_router(
        fleet,
        name,
        ROUTER.format(
            model=MODEL,
            p0=p.p0.url,
            p1=p.p1.url,
            d0=p.consumer.url,
            lease=KV_LEASE_S,
            policy=policy,
            interval=METRICS_INTERVAL_S,
            affinity="true" if affinity else "false",
        ),
    )


def engines_view(url: str) -> dict[str, dict[str, Any]]:
    status, body = http("GET", url + "/narwhal/engines", timeout=30)
    assert status == 200, body
    return {e["id"]: e for e in json.loads(body)["engines"]}


def fresh_reports(url: str, budget_s: float = 30.0) -> dict[str, Any]:
    """Every engine's scraped report, once all are fresh (the scraper reads real vLLM)."""
    deadline = time.monotonic() + budget_s
    while True:
        view = engines_view(url)
        reports = {eid: e.get("report") for eid, e in view.items()}
        if all(r is not None and not r["stale"] for r in reports.values()):
            return reports
        if time.monotonic() > deadline:
            pytest.fail(f"no fresh report for every engine within {budget_s:.0f}s: {view}")
        time.sleep(0.5)  # the scrape interval is 1 s; bounded by budget_s


def decisions(url: str) -> dict[str, float]:
    """The router's prefill placements by reason."""
    status, body = http("GET", url + "/metrics", timeout=30)
    assert status == 200
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("narwhal_placement_decisions_total{") and 'leg="prefill"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def counters(p: Producers) -> dict[str, tuple[float, float]]:
    """(hits, queries) of each producer, once two reads a moment apart agree (the engine
    counts a request's lookups as its output is handled)."""
    last: dict[str, tuple[float, float]] | None = None
    for _ in range(20):  # bounded: 10 s
        now = {pid: (e.metric(HITS), e.metric(QUERIES)) for pid, e in p.by_id.items()}
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    assert last is not None
    return last


def phase(fleet: Fleet, p: Producers, name: str, policy: str, affinity: bool) -> dict[str, Any]:
    """The 20 requests through a router of this placement; what each producer counted."""
    system = system_prompt(p.p0, name)
    router = start_router(fleet, p, f"router-{name}", policy, affinity)
    url: str = router.url  # type: ignore[attr-defined]
    try:
        fresh_reports(url)
        placed_before = decisions(url)
        before = counters(p)
        prompt_tokens = []
        for i in range(REQUESTS):  # one at a time: each finds the previous one's blocks
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question(i)},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS}
            status, raw = http("POST", url + "/v1/chat/completions", {**body, "temperature": 0})
            assert status == 200, raw[:500]
            prompt_tokens.append(json.loads(raw)["usage"]["prompt_tokens"])
        after = counters(p)
        placed_after = decisions(url)
        reports = fresh_reports(url)
    finally:
        router.stop()
    assert max(prompt_tokens) + MAX_TOKENS <= CONTEXT, prompt_tokens
    per: dict[str, dict[str, float | None]] = {}
    for pid in p.by_id:
        hits = after[pid][0] - before[pid][0]
        queries = after[pid][1] - before[pid][1]
        per[pid] = {
            "hits": hits,
            "queries": queries,
            "ratio": round(hits / queries, 4) if queries else None,
        }
    hits = sum(float(v["hits"] or 0) for v in per.values())
    queries = sum(float(v["queries"] or 0) for v in per.values())
    placed = {
        reason: placed_after.get(reason, 0.0) - placed_before.get(reason, 0.0)
        for reason in placed_after
        if placed_after.get(reason, 0.0) != placed_before.get(reason, 0.0)
    }
    return {
        "policy": policy,
        "prefix_affinity": affinity,
        "requests": REQUESTS,
        "prompt_tokens": [min(prompt_tokens), max(prompt_tokens)],
        "ratio": round(hits / queries, 4) if queries else None,
        "hits": hits,
        "queries": queries,
        "producers": per,
        "prefill_placements": placed,
        "reports_after": reports,
    }


def prefix_caching_on(engine: Engine) -> bool:
    """vLLM logs its whole config once at start; V1 turns prefix caching on by default."""
    return "enable_prefix_caching=True" in engine.log.read_text(errors="replace")


def fresh_everywhere(result: dict[str, Any]) -> None:
    """The scraper read every engine's /metrics, the producers' prefix counters included."""
    for eid, report in result["reports_after"].items():
        assert report is not None, eid
        assert not report["stale"], (eid, report)
    for pid in ("p0", "p1"):
        assert result["reports_after"][pid]["prefix_cache_hit_ratio"] is not None, pid


def test_both_producers_cache_prefixes(producers: Producers) -> None:
    for engine in producers.by_id.values():
        assert prefix_caching_on(engine), f"{engine.name}: prefix caching is off\n{engine.tail()}"


def test_round_robin_spreads_the_prompt_over_both_producers(
    fleet: Fleet, producers: Producers
) -> None:
    robin = phase(fleet, producers, "round-robin", "round_robin", affinity=False)
    PHASES["round_robin"] = robin
    print(f"\nround_robin: {robin['ratio']} {robin['producers']}")
    assert robin["prefill_placements"] == {"round_robin": REQUESTS}, robin
    for pid in producers.by_id:  # both counted lookups: prefix caching is on on both
        assert robin["producers"][pid]["queries"] > 0, f"{pid} counted no prefix lookups"
    fresh_everywhere(robin)


def test_prefix_affinity_hits_more_than_round_robin(fleet: Fleet, producers: Producers) -> None:
    affinity = phase(fleet, producers, "affinity", "least_loaded", affinity=True)
    PHASES["prefix_affinity"] = affinity
    text = json.dumps(PHASES, indent=2)
    print(f"\nprefix cache hits over queries (tokens, both producers):\n{text}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text + "\n")
    (fleet.logs / RESULTS.name).write_text(text + "\n")

    placed = affinity["prefill_placements"]
    # the first request goes by the ring (a text never seen), the others by the prefix
    # index (the producer that computed the shared system prompt), or spill
    assert placed.get("affinity", 0) >= 1, f"no placement by affinity: {placed}"
    by_prefix = sum(placed.get(why, 0) for why in ("affinity", "prefix_match", "spill"))
    assert by_prefix == REQUESTS, placed
    fresh_everywhere(affinity)
    robin = PHASES.get("round_robin")
    if robin is None:
        pytest.fail("no round-robin phase to compare with (it failed or did not run)")
    print(
        f"\nprefix cache hit ratio: round_robin {robin['ratio']}, "
        f"prefix affinity {affinity['ratio']}\n"
        f"  round_robin per producer: {robin['producers']}\n"
        f"  prefix affinity per producer: {affinity['producers']}"
    )
    assert affinity["ratio"] > robin["ratio"], PHASES
