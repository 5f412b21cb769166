"""Conditional disaggregation on real vLLM (contract 4.4, decode first).

Two routers of this module's own over the session's pair, both with
``local_prefill_tokens = 128`` and a journal:

* ``local``: p0 producer, d0 consumer. A short prompt (far under 128 tokens) is served by
  the consumer alone: the producer's ``vllm:request_success_total`` does not move, the
  consumer's NIXL transfer count (``vllm:nixl_xfer_time_seconds_count``) does not move,
  the journal's attempt says ``local``, and its greedy text equals the same request
  disaggregated by the session's router (whose handoff does move the transfer count).
* ``turns``: p0 also listed as a consumer (role ``both``), so a turn has two consumers to
  choose from. Three conversations, each with a system prompt of its own (about 680
  bytes: the first turn is disaggregated), then a second turn (the history, the reply,
  a short question): it goes to the consumer that served the first turn, locally, and that
  engine's ``vllm:prefix_cache_hits_total`` grows during it by at least the first turn's
  full prompt blocks (the CPU backend's block is 128 tokens).

Runs after test_kv_lease and before test_real_vllm kills the consumer (file order).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    MODEL,
    PATIENT_ENGINE,
    PATIENT_SERVING,
    Fleet,
    Process,
    fleet_toml,
    http,
    serve_router,
)

pytestmark = pytest.mark.vllm

BLOCK = 128  # the CPU backend's KV block, in tokens
THRESHOLD = 128
CONVERSATIONS = 3
XFERS = "vllm:nixl_xfer_time_seconds_count"
SUCCESSES = "vllm:request_success_total"
HITS = "vllm:prefix_cache_hits_total"


SENTENCES = [
    "The orchard sells apples by the crate from the barn at the end of the lane.",
    "Pears ripen a week after the apples and are sold loose by the kilogram.",
    "The cider press runs on Saturdays and visitors may watch from the gallery.",
    "School groups book the morning tours by telephone at least a week ahead.",
    "Dogs must stay in the car park because the sheep graze under the trees.",
    "Answer in one short sentence, and give prices only when you are sure of them.",
]


def _router(fleet: Fleet, name: str, producer_role: str) -> Iterator[tuple[Process, Path]]:
    journal = fleet.logs / f"{name}.jsonl"
    text = fleet_toml(
        [("p0", fleet.producer.url, producer_role), ("d0", fleet.consumer.url, "decode")],
        serving=PATIENT_SERVING,
        engine=PATIENT_ENGINE,
        placement={"metrics_interval_s": 1.0, "local_prefill_tokens": THRESHOLD},
    )
    router = serve_router(fleet, name, text, ("--journal", str(journal)))
    try:
        yield router, journal
    finally:
        router.stop()


@pytest.fixture(scope="module")
def local(fleet: Fleet) -> Iterator[tuple[Process, Path]]:
    yield from _router(fleet, "router-local", "prefill")


@pytest.fixture(scope="module")
def turns(fleet: Fleet) -> Iterator[tuple[Process, Path]]:
    yield from _router(fleet, "router-turns", "both")


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, raw = http("POST", url + path, {"model": MODEL, "temperature": 0, **body})
    assert status == 200, raw[:400]
    data: dict[str, Any] = json.loads(raw)
    return data


def _lines(journal: Path) -> list[str]:
    return journal.read_text().splitlines() if journal.exists() else []


def _post_logged(
    router: Process, journal: Path, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The answer and the journal's line for it (one request at a time: the next line)."""
    before = len(_lines(journal))
    answer = _post(router.url, path, body)  # type: ignore[attr-defined]
    for _ in range(100):  # bounded: its writer thread may lag a little, 10 s at most
        lines = _lines(journal)
        if len(lines) > before:
            line: dict[str, Any] = json.loads(lines[before])
            return answer, line
        time.sleep(0.1)
    raise AssertionError(f"no journal line in {journal} for a request to {path}")


def test_a_short_prompt_is_served_by_the_consumer_alone(
    fleet: Fleet, local: tuple[Process, Path]
) -> None:
    router, journal = local
    body = {"prompt": "The harbour opens at", "max_tokens": 16}
    xfers, successes = fleet.consumer.metric(XFERS), fleet.producer.metric(SUCCESSES)
    answer, line = _post_logged(router, journal, "/v1/completions", body)
    assert line["outcome"] == "completed"
    assert line["prefill_s"] is None
    (attempt,) = line["attempts"]
    assert attempt.get("local") is True
    assert attempt["consumer"] == "d0"
    assert "producer" not in attempt
    assert fleet.consumer.metric(XFERS) == xfers  # no NIXL transfer
    assert fleet.producer.metric(SUCCESSES) == successes  # no producer leg
    disaggregated = _post(fleet.router_url, "/v1/completions", body)
    assert fleet.consumer.metric(XFERS) > xfers  # the session's router moved KV for it
    assert answer["choices"][0]["text"] == disaggregated["choices"][0]["text"]
    print(f"\nlocal and disaggregated greedy text: {answer['choices'][0]['text']!r}")


def test_the_next_turn_goes_to_the_consumer_that_served_the_first(
    fleet: Fleet, turns: tuple[Process, Path]
) -> None:
    router, journal = turns
    engines = {"p0": fleet.producer, "d0": fleet.consumer}
    rows = []
    for n in range(CONVERSATIONS):
        # over 4 x THRESHOLD bytes (the router's estimate: disaggregated), under the model's
        # 512-token context with the second turn (this tokenizer: about 2.6 bytes a token)
        system = f"Conversation {n}. " + " ".join([*SENTENCES, *SENTENCES[:3]])
        assert len(system.encode()) > 4 * THRESHOLD
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": "When does the press run?"},
        ]
        first, line1 = _post_logged(
            router, journal, "/v1/chat/completions", {"messages": messages, "max_tokens": 12}
        )
        served = line1["attempts"][0]["consumer"]
        assert not line1["attempts"][0].get("local")  # about 300 tokens: disaggregated
        reply = first["choices"][0]["message"]["content"]
        prompt_tokens = first["usage"]["prompt_tokens"]
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the tours?"},
        ]
        hits = engines[served].metric(HITS)
        _, line2 = _post_logged(
            router, journal, "/v1/chat/completions", {"messages": messages, "max_tokens": 12}
        )
        grew = engines[served].metric(HITS) - hits
        rows.append((n, served, line2["attempts"][0]["consumer"], prompt_tokens, grew))
        assert line2["attempts"][0]["consumer"] == served
        assert line2["attempts"][0].get("local") is True
        assert grew >= (prompt_tokens // BLOCK) * BLOCK
    print("\n(conversation, first turn's consumer, second's, first prompt tokens, hits grown)")
    for row in rows:
        print(row)
