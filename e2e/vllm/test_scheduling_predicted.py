"""Policy "predicted" on real vLLM (contract 4.8): the cost model learns each engine from
the router's own legs, and places by predicted time to first token.

Runs after test_saturated_consumer and before test_stream_resume (file order), as its
engines come and go. Two producers of this module's own (``--max-num-seqs 2``: two
sequences at once, vLLM queues the rest) paired with the session's consumer, and a router
with the policy:

* **Learning.** Prompts of 10 to 100 words, the first half with ``echo``: each producer
  that computed prompts has learned coefficients (``min_samples`` legs). Its learned
  prefill rate is printed beside the engine's own account of the same requests (the
  deltas of ``vllm:request_prefill_time_seconds`` and ``vllm:prompt_tokens_total``, in
  the engine's tokens, the router's in its estimate: the ids of ``/tokenize`` against the
  text's bytes / 4), not asserted: on this CPU engine a leg's time is mostly its fixed
  cost and warm-up stalls of seconds (a first handoff's NIXL registration), and a rate
  fitted from two dozen legs may miss the engine's by far (two runs: 907 against 827 and
  669 against 363 tokens/s on one producer, no rate at all on the other).
* **A held prefix.** A 70-word prompt, then its next turn (the prompt, the reply, a new
  question): the turn's prefill goes to the producer that computed the first (it holds
  the prompt), over the idle other one.
* **The holder deeply queued.** Six long generations straight to the holder (two run,
  four wait, as its scrape shows the router): the next turn goes to the other producer.
"""

from __future__ import annotations

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
    Engine,
    Fleet,
    Process,
    fleet_toml,
    http,
    journal_line,
    serve_router,
    start_engines,
    warm_pair,
)

pytestmark = pytest.mark.vllm

WORDS = ("river", "stone", "lantern", "meadow", "copper", "harbor", "violet", "thunder")
LEARN = 12  # prompts per phase: more than min_samples (8)
FLOOD = 6  # long generations that fill the holder (two at once) and queue four


def words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str(i % 13) for i in range(n))


@pytest.fixture(scope="module")
def producers(fleet: Fleet) -> Iterator[dict[str, Engine]]:
    small = ("--max-num-seqs", "2")
    started = start_engines(
        fleet, [("producer-s1", "kv_producer", small), ("producer-s2", "kv_producer", small)]
    )
    try:
        for engine in started:
            warm_pair(engine, fleet.consumer)
        yield {"s1": started[0], "s2": started[1]}
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def router(fleet: Fleet, producers: dict[str, Engine]) -> Iterator[tuple[str, Any]]:
    journal = fleet.logs / "router-predicted.jsonl"
    text = fleet_toml(
        [(pid, engine.url, "prefill") for pid, engine in producers.items()]
        + [("d0", fleet.consumer.url, "decode")],
        serving={"request_timeout_s": 300.0, "prefill_timeout_s": 120.0, "max_attempts": 1},
        engine={"kv_lease_s": KV_LEASE_S, "first_token_timeout_s": 120.0},
        placement={"policy": "predicted", "metrics_interval_s": 0.5},
        prediction={"min_samples": 8},
    )
    proc: Process = serve_router(fleet, "router-predicted", text, ("--journal", str(journal)))
    try:
        yield proc.url, journal  # type: ignore[attr-defined]
    finally:
        proc.stop()


def complete(url: str, prompt: str, rid: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    status, raw = http(
        "POST", url + "/v1/completions", body, timeout=HANDOFF_S, headers={"x-request-id": rid}
    )
    assert status == 200, raw[:300]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def view(url: str) -> dict[str, dict[str, Any]]:
    status, body = http("GET", url + "/narwhal/engines", timeout=30)
    assert status == 200
    return {e["id"]: e for e in json.loads(body)["engines"]}


def prefill_account(engine: Engine) -> tuple[float, float]:
    """(seconds of prefill, prompt tokens) the engine has counted so far."""
    return engine.metric("vllm:request_prefill_time_seconds_sum"), engine.metric(
        "vllm:prompt_tokens_total"
    )


def estimate_ratio(engine: Engine, prompts: list[str]) -> float:
    """The router's token estimate (text bytes / 4) over the engine's tokens, for these."""
    real = 0
    for prompt in prompts:
        status, raw = http("POST", engine.url + "/tokenize", {"model": MODEL, "prompt": prompt})
        assert status == 200, raw[:200]
        real += int(json.loads(raw)["count"])
    return sum(len(p.encode()) / 4 for p in prompts) / real


def test_each_producer_is_learned_from_its_legs(
    producers: dict[str, Engine], router: tuple[str, Any]
) -> None:
    url, _ = router
    engines = dict(producers)
    before = {eid: prefill_account(e) for eid, e in engines.items()}
    # the engines' context is 512 tokens, and a word here is about four of them
    prompts = [words(n, 10 + (n * 37) % 90) for n in range(2 * LEARN)]
    for n, prompt in enumerate(prompts):
        echo = {"echo": True} if n < LEARN else {}  # the first phase needs the producer
        complete(url, prompt, f"learn-{n}", **echo)
    after = {eid: prefill_account(e) for eid, e in engines.items()}
    models = {eid: v["prediction"] for eid, v in view(url).items()}
    print(f"\nthe model after {2 * LEARN} prompts: {json.dumps(models)}")
    ratio = estimate_ratio(producers["s1"], prompts)
    checked = []
    for eid in engines:
        learned = models[eid]["prefill"]
        seconds = after[eid][0] - before[eid][0]
        tokens = after[eid][1] - before[eid][1]
        if not learned["learned"] or seconds <= 0:
            continue
        own = tokens / seconds  # the engine's tokens a second of prefill
        ours = learned["tokens_per_s"] / ratio  # the router's, in the engine's tokens
        print(f"{eid}: learned {ours:.0f} tokens/s, its own account {own:.0f} tokens/s")
        checked.append((eid, ours, own))
    assert checked, models  # a producer that computed prompts has learned coefficients


def test_a_held_prefix_wins_until_its_holder_is_queued(
    producers: dict[str, Engine], router: tuple[str, Any]
) -> None:
    url, journal = router
    first = words(99, 70)
    reply = complete(url, first, "held-0")["choices"][0]["text"]
    holder = journal_line(journal, "held-0")["attempts"][-1]["producer"]
    turn = f"{first}{reply} and then what happened"
    complete(url, turn, "held-1")
    line = journal_line(journal, "held-1")
    assert line["attempts"][-1]["producer"] == holder, line
    # the holder busy: two generations run, four wait (its scrape shows the router)
    engine = producers[holder]

    def flood(i: int) -> None:
        body = {"model": MODEL, "prompt": words(200 + i, 20), "max_tokens": 300}
        body["min_tokens"] = 300
        http("POST", engine.url + "/v1/completions", body, timeout=HANDOFF_S * 4)

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(FLOOD)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # bounded: the flood queues within seconds
            report = view(url)[holder]["report"]
            if report is not None and report["waiting"] >= FLOOD - 2 - 1:
                break
            time.sleep(0.2)
        complete(url, f"{turn} later still", "held-2")
        line = journal_line(journal, "held-2")
        print(f"\nheld prefix on {holder}; queued, the next turn went to {line['attempts']}")
        assert line["attempts"][-1]["producer"] not in (None, holder), line
    finally:
        for t in threads:
            t.join(timeout=HANDOFF_S * 4)
