"""LoRA adapters behind one router, on real vLLM.

Two engines of this module's own serve setup.sh's adapter (``DIR/tiny-lora``: random rank-8
``q_proj``/``v_proj``, a fixed seed) as ``tinylora`` beside the base model
(``--enable-lora --max-lora-rank 8 --lora-modules tinylora=DIR``): ``p-lora``, a
``kv_producer``, and ``d-lora``, a ``kv_consumer``. The session's consumer serves the base
model alone and is this module's ``d-plain``. A router of the module's own runs over the
three with ``[aliases] tiny-alias = "tinylora"`` and a journal; it learns what each engine
serves from the engine's ``GET /v1/models`` (no fleet keys say so). The tests check that:

* both LoRA engines list ``tinylora`` with ``parent`` the base, beside NixlConnector, and
  hand a ``tinylora`` request's KV from one to the other by themselves (no router);
* a ``tinylora`` completion and chat are prefilled on p-lora and decoded on d-lora, KV moved
  (the journal's attempt: ``handoff`` decoded, not ``local``; d-lora's NIXL transfers), and
  their greedy text is vLLM's own for the adapter, not the base model's;
* the base model still goes through, and reaches d-plain within 8 requests;
* ``tiny-alias`` answers as ``tinylora`` (same engines, same text, the served name in its
  ``model``); the router's ``GET /v1/models`` names the base, the adapter and the alias; an
  unknown model is the router's own 404.

Memory: an engine here holds about 1.9 GiB RSS (1.4 GiB PSS), the adapter about 40 MiB more,
so the module adds two engines (four in all with the session's pair) and reuses the
session's consumer instead of a third. It stops what it started; the session's pair is left
as it was (the teardown checks that the session's own handoff still works).
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
    LORA,
    MODEL,
    PATIENT_ENGINE,
    PATIENT_SERVING,
    Engine,
    Fleet,
    Process,
    fleet_toml,
    http,
    journal_line,
    lora_args,
    serve_router,
    start_engines,
    warm_pair,
)

pytestmark = pytest.mark.vllm

ALIAS = "tiny-alias"
TOKENS = 32
BASE_TRIES = 8  # the base model's requests, at most, until one reaches d-plain
XFERS = "vllm:nixl_xfer_time_seconds_count"  # a consumer's pulls that moved blocks
# under one block (128 tokens) of the tiny model's: no full block is cached, so every
# handoff moves the whole prompt and a request asked directly computes it all itself
PROMPT = "The quiet harbour keeps its boats in rows while the gulls argue over the nets. "
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where do the boats wait in the harbour?"},
]


@dataclass
class LoraFleet:
    p_lora: Engine
    d_lora: Engine
    d_plain: Engine
    started_s: float


@dataclass
class LoraRouter:
    router: Process
    journal: Path

    @property
    def url(self) -> str:
        return self.router.url  # type: ignore[attr-defined, no-any-return]


def _group_memory_mib(engine: Engine) -> tuple[int, int]:
    """RSS and PSS of every process in the engine's group (the API server, the engine
    core, its worker), in MiB; (0, 0) where /proc says nothing."""
    assert engine.proc is not None
    rss = pss = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != engine.proc.pid:  # the process group
                continue
            for line in (stat.parent / "smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    return rss // 1024, pss // 1024


@pytest.fixture(scope="module")
def lora(fleet: Fleet) -> Iterator[LoraFleet]:
    begun = time.monotonic()
    p_lora, d_lora = start_engines(
        fleet,
        [("p-lora", "kv_producer", lora_args()), ("d-lora", "kv_consumer", lora_args())],
    )
    try:
        started_s = time.monotonic() - begun
        for engine in (p_lora, d_lora, fleet.consumer):
            rss, pss = _group_memory_mib(engine)
            print(f"\n{engine.name}: RSS {rss} MiB, PSS {pss} MiB")
        print(f"p-lora and d-lora ready in {started_s:.0f}s (started together)")
        warm_pair(p_lora, d_lora)  # NIXL's handshake, for both pairs, before any test
        warm_pair(p_lora, fleet.consumer)
        yield LoraFleet(p_lora, d_lora, fleet.consumer, started_s)
    finally:
        d_lora.stop()
        p_lora.stop()
    # the session's pair as the module found it: its own handoff still goes through
    warm_pair(fleet.producer, fleet.consumer)


@pytest.fixture(scope="module")
def routed(fleet: Fleet, lora: LoraFleet) -> Iterator[LoraRouter]:
    journal = fleet.logs / "router-lora.jsonl"
    text = fleet_toml(
        [
            ("p-lora", lora.p_lora.url, "prefill"),
            ("d-lora", lora.d_lora.url, "decode"),
            ("d-plain", lora.d_plain.url, "decode"),
        ],
        serving=PATIENT_SERVING,
        engine=PATIENT_ENGINE,
        aliases={ALIAS: LORA},
    )
    router = serve_router(fleet, "router-lora", text, ("--journal", str(journal)))
    try:
        yield LoraRouter(router, journal)
    finally:
        router.stop()


def _body(path: str, model: str, **more: Any) -> dict[str, Any]:
    shape: dict[str, Any] = (
        {"messages": MESSAGES} if path == "/v1/chat/completions" else {"prompt": PROMPT}
    )
    return {"model": model, **shape, "max_tokens": TOKENS, "temperature": 0, **more}


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert isinstance(text, str), answer
    return text


def _post(url: str, path: str, body: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
    headers = {"x-request-id": rid} if rid else None
    status, raw = http("POST", url + path, body, headers=headers)
    assert status == 200, raw[:400]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def _routed(
    routed: LoraRouter, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's answer and its journal line."""
    rid = f"lora-{secrets.token_hex(6)}"
    answer = _post(routed.url, path, body, rid)
    return answer, journal_line(routed.journal, rid)


def _models(url: str) -> dict[str, str | None]:
    status, raw = http("GET", url + "/v1/models", timeout=30)
    assert status == 200, raw[:400]
    return {card["id"]: card.get("parent") for card in json.loads(raw)["data"]}


def test_the_lora_engines_serve_the_adapter_and_hand_its_kv_over(lora: LoraFleet) -> None:
    for engine in (lora.p_lora, lora.d_lora):
        assert _models(engine.url) == {MODEL: None, LORA: MODEL}, engine.name
    assert _models(lora.d_plain.url) == {MODEL: None}
    path = "/v1/completions"
    xfers = lora.d_lora.metric(XFERS)
    prefill = _post(
        lora.p_lora.url,
        path,
        _body(path, LORA, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
    )
    descriptor = prefill["kv_transfer_params"]
    handed = _post(lora.d_lora.url, path, _body(path, LORA, kv_transfer_params=descriptor))
    assert lora.d_lora.metric(XFERS) > xfers  # the decode pulled the producer's blocks
    assert handed["model"] == LORA
    direct = _post(lora.d_lora.url, path, _body(path, LORA))
    base = _post(lora.d_lora.url, path, _body(path, MODEL))
    print(f"\nadapter {_text(direct)!r}\nbase    {_text(base)!r}")
    assert _text(handed) == _text(direct)
    assert _text(direct) != _text(base)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_adapters_request_is_prefilled_and_decoded_on_its_engines(
    lora: LoraFleet, routed: LoraRouter, path: str
) -> None:
    xfers = lora.d_lora.metric(XFERS)
    answer, line = _routed(routed, path, _body(path, LORA))
    print(f"\njournal: {json.dumps(line['attempts'])}")
    assert line["outcome"] == "completed", line
    (attempt,) = line["attempts"]
    assert attempt.get("producer") == "p-lora", line
    assert attempt.get("consumer") == "d-lora", line
    assert attempt.get("handoff") == "decoded", line
    assert not attempt.get("local"), line
    assert lora.d_lora.metric(XFERS) > xfers  # the KV moved: d-lora did not compute it
    assert answer["model"] == LORA
    # vLLM's own answer for the adapter, asked directly of one engine (it computes the
    # prompt itself: no full block of it is cached), and not the base model's
    direct = _post(lora.d_lora.url, path, _body(path, LORA))
    base = _post(lora.d_plain.url, path, _body(path, MODEL))
    assert _text(answer) == _text(direct)
    assert _text(answer) != _text(base)


def test_the_base_model_still_goes_through_and_reaches_the_plain_consumer(
    lora: LoraFleet, routed: LoraRouter
) -> None:
    path = "/v1/completions"
    consumers: list[str | None] = []
    for n in range(BASE_TRIES):  # bounded; a new prompt each time, so no prefix pulls it
        body = {**_body(path, MODEL), "prompt": f"Request {n}: {PROMPT}", "max_tokens": 8}
        answer, line = _routed(routed, path, body)
        assert line["outcome"] == "completed", line
        (attempt,) = line["attempts"]
        assert attempt.get("producer") == "p-lora", line
        consumers.append(attempt.get("consumer"))
        direct = _post(lora.d_plain.url, path, body)
        assert _text(answer) == _text(direct)
        if "d-plain" in consumers:
            break
    print(f"\nthe base model's consumers: {consumers}")
    assert set(consumers) <= {"d-lora", "d-plain"}, consumers
    assert "d-plain" in consumers, f"{BASE_TRIES} base requests, none on d-plain: {consumers}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_alias_answers_as_its_adapter(routed: LoraRouter, path: str) -> None:
    adapter, _ = _routed(routed, path, _body(path, LORA))
    aliased, line = _routed(routed, path, _body(path, ALIAS))
    assert line["outcome"] == "completed", line
    (attempt,) = line["attempts"]
    assert attempt.get("producer") == "p-lora", line
    assert attempt.get("consumer") == "d-lora", line
    assert _text(aliased) == _text(adapter)


def test_an_alias_answer_names_the_served_model_it_stands_for(routed: LoraRouter) -> None:
    # The router answers with the served name, as OpenAI answers an alias with the dated
    # model it stands for: the engines' bytes pass unchanged (no rewrite per chunk), and the
    # name says which adapter actually answered.
    path = "/v1/completions"
    aliased, _ = _routed(routed, path, _body(path, ALIAS))
    assert aliased["model"] == LORA


def test_the_routers_model_list_names_the_base_the_adapter_and_the_alias(
    routed: LoraRouter,
) -> None:
    models = _models(routed.url)
    print(f"\nthe router's /v1/models: {models}")
    assert {MODEL, LORA, ALIAS} <= set(models), models
    assert models[MODEL] is None
    assert models[LORA] == MODEL


def test_an_unknown_model_is_the_routers_404(routed: LoraRouter) -> None:
    path = "/v1/completions"
    status, raw = http("POST", routed.url + path, _body(path, "no-such-model"))
    assert status == 404, raw[:400]
    assert json.loads(raw)["error"]["message"] == "model 'no-such-model' is not served here"
