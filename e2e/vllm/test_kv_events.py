"""The precise prefix index on real vLLM: the engines' own KV events.

Two engines of this module's own, both ``kv_both``, each with a deliberately small KV cache
(``--num-gpu-blocks-override 24``: 24 blocks of 128 tokens) and KV events on
(``--kv-events-config``), publishing under a topic of its own to a router of this module's
in ``[kv_events] mode = "listen"`` (a publisher endpoint without ``*`` makes vLLM's PUB
connect to it: every socket stays on loopback), each keeping its batches for replay on a
loopback ROUTER socket. The tests check that:

* after prompts that fill more blocks than a cache holds, the router's view of each engine
  (``/narwhal/engines``) is exactly the blocks that engine's own events kept (its whole
  history, read back from its replay socket from sequence 0);
* a prompt an engine computed outside the router (a client that bypassed it) is placed on
  that engine: only its events could say so;
* an engine SIGKILLed and restarted is dropped from the index, then rebuilt from its new
  events;
* the token ids the router asks of ``/tokenize`` (``narwhal.core.token_ids``) are vLLM's
  own prompt ids for a completion prompt, a chat with a system prompt and a multi-turn
  chat.

Runs after the session pair's suites that need the machine quiet (file order: k after d).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from narwhal.core.token_ids import tokenize_body

from .conftest import (
    MODEL,
    PATIENT_ENGINE,
    PATIENT_SERVING,
    START_S,
    Engine,
    Fleet,
    Process,
    _engine,
    _vllm_dir,
    fleet_toml,
    free_port,
    http,
    restart,
    serve_router,
)

pytestmark = pytest.mark.vllm

BLOCK = 128  # the CPU backend's block, in tokens
CACHE_BLOCKS = 24
SETTLE_S = 60.0  # the router's view and the engine's events agree within this
SENTENCE = (
    "The quiet harbour keeps its boats in rows while the gulls argue over the nets and "
    "the morning ferry waits for the tide to turn before it leaves for the islands. "
)
LONG = SENTENCE * 5  # 2-3 blocks of the tiny model's tokens, within its 512-token context


@dataclass
class EventEngine:
    engine: Engine
    id: str
    replay: str

    def history(self) -> tuple[set[Any], int]:
        """The blocks the engine's events kept, from its whole history (replayed from 0):
        stored, less removed, less everything before a clear; and how many it removed."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        held: set[Any] = set()
        removed = 0
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            for _ in range(100_000):  # bounded: the replay buffer's size
                frames = sock.recv_multipart()[1:]
                seq, payload = frames[-2], frames[-1]
                if int.from_bytes(seq, "big", signed=True) == -1:
                    return held, removed
                batch = msgspec.msgpack.decode(payload)
                events = batch["events"] if isinstance(batch, dict) else batch[1]
                for event in events:
                    kind = event["type"] if isinstance(event, dict) else event[0]
                    hashes = event.get("block_hashes") if isinstance(event, dict) else None
                    if hashes is None and kind != "AllBlocksCleared":
                        hashes = event[1]
                    if kind == "BlockStored":
                        held.update(_hashable(h) for h in hashes)
                    elif kind == "BlockRemoved":
                        removed += len(hashes)
                        held.difference_update(_hashable(h) for h in hashes)
                    elif kind == "AllBlocksCleared":
                        held.clear()
        finally:
            sock.close()
        raise AssertionError("the replay never ended")


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, bytearray | list) else h


@dataclass
class EventFleet:
    engines: dict[str, EventEngine]
    router: Process
    journal: Path

    @property
    def url(self) -> str:
        return self.router.url  # type: ignore[attr-defined, no-any-return]

    def view(self, engine_id: str) -> dict[str, Any]:
        status, body = http("GET", self.url + "/narwhal/engines", timeout=30)
        assert status == 200
        (engine,) = [e for e in json.loads(body)["engines"] if e["id"] == engine_id]
        kv: dict[str, Any] = engine["kv_events"]
        return kv


@pytest.fixture(scope="module")
def events(fleet: Fleet) -> Iterator[EventFleet]:
    listen = f"tcp://127.0.0.1:{free_port()}"
    started: dict[str, EventEngine] = {}
    try:
        for engine_id in ("e1", "e2"):
            replay = f"tcp://127.0.0.1:{free_port()}"
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": listen,
                "replay_endpoint": replay,
                "topic": f"kv-{engine_id}",
            }
            engine = _engine(_vllm_dir(), fleet.logs, f"events-{engine_id}", "kv_both")
            engine.argv += ["--num-gpu-blocks-override", str(CACHE_BLOCKS)]  # the last wins
            engine.argv += ["--kv-events-config", json.dumps(config)]
            engine.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
            started[engine_id] = EventEngine(engine, engine_id, replay)
            engine.start()
            engine.wait_until(engine.url + "/health", START_S)
        journal = fleet.logs / "router-events.jsonl"
        text = fleet_toml(
            [(e.id, e.engine.url, "both") for e in started.values()],
            serving=PATIENT_SERVING,
            engine=PATIENT_ENGINE,
            placement={"metrics_interval_s": 1.0},
            kv_events={"mode": "listen", "listen": listen},
        )
        router = serve_router(fleet, "router-events", text, ("--journal", str(journal)))
        try:
            ours = EventFleet(started, router, journal)
            for engine_id in started:
                _go_live(ours, engine_id)
            yield ours
        finally:
            router.stop()
    finally:
        for event_engine in started.values():
            event_engine.engine.stop()


def _go_live(fleet: EventFleet, engine_id: str) -> None:
    """Prompt the engine directly until the router reads a batch of its (the engine's PUB
    connects to the router once it is up), then clear its cache: both views start empty."""
    engine = fleet.engines[engine_id].engine
    for i in range(30):  # bounded: a batch per prompt
        _complete(engine.url, f"warm {engine_id} {i} " + LONG)
        if fleet.view(engine_id)["state"] == "live":
            break
        time.sleep(1.0)  # the publisher's connection to the router, bounded by the loop
    else:
        others = {e: fleet.view(e)["state"] for e in fleet.engines if e != engine_id}
        said = [line for line in engine.tail(400).splitlines() if "kv_events" in line.lower()]
        pytest.fail(
            f"{engine_id}: the router never read its events: {fleet.view(engine_id)}; "
            f"the others: {others}; the engine's log on its events: {said[-5:]}; the "
            f"router's log: {fleet.router.log}"
        )
    status, body = http("POST", engine.url + "/reset_prefix_cache")
    assert status == 200, body
    _settle(fleet, engine_id)


def _complete(url: str, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, raw = http("POST", url + "/v1/completions", body)
    assert status == 200, raw[:400]
    answer: dict[str, Any] = json.loads(raw)
    return answer


def _settle(fleet: EventFleet, engine_id: str) -> int:
    """Wait until the router's view of the engine is the blocks its events kept; those."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        kept = len(fleet.engines[engine_id].history()[0])
        view = fleet.view(engine_id)
        if view["state"] == "live" and view["blocks"] == kept:
            return kept
        if time.monotonic() > deadline:
            pytest.fail(f"{engine_id}: the router holds {view}, its events kept {kept} blocks")
        time.sleep(0.5)  # the router reads the same batches; bounded by SETTLE_S


def test_the_router_holds_what_each_engines_events_kept(events: EventFleet) -> None:
    for i in range(20):  # 20 prompts of 2-3 blocks, on both engines: more than 24 blocks
        answer = _complete(events.url, f"prompt {i}: " + LONG)
        assert answer["choices"][0]["text"]
    for engine_id in events.engines:
        kept = _settle(events, engine_id)
        assert kept <= CACHE_BLOCKS
        # capped at the engine's own cache size (vllm:cache_config_info, scraped)
        assert events.view(engine_id)["capacity"] == CACHE_BLOCKS
    evicted = [e.history()[1] for e in events.engines.values()]
    assert all(evicted), f"the engines evicted {evicted} blocks: the cache was never full"


def test_a_prompt_an_engine_computed_alone_is_placed_on_it(events: EventFleet) -> None:
    prompt = "a prompt only e2 has seen: " + LONG
    _complete(events.engines["e2"].engine.url, prompt)  # bypassing the router
    _settle(events, "e2")  # (a full cache: as many blocks as before, others evicted)
    lines_before = len(events.journal.read_text().splitlines()) if events.journal.exists() else 0
    _complete(events.url, prompt + " And then?")
    line = _journal_line(events.journal, lines_before)
    assert line["attempts"][-1]["producer"] == "e2"


def test_a_killed_engine_is_dropped_then_rebuilt(events: EventFleet) -> None:
    e1 = events.engines["e1"]
    _complete(events.url, "before the kill: " + LONG)
    e1.engine.signal(signal.SIGKILL)
    deadline = time.monotonic() + SETTLE_S * 2
    while events.view("e1")["blocks"] != 0 or events.view("e1")["state"] == "live":
        if time.monotonic() > deadline:
            pytest.fail(f"e1 was killed, the router still holds {events.view('e1')}")
        time.sleep(1.0)  # the health checks notice within health_interval_s; bounded
    restart(e1.engine)
    _go_live(events, "e1")  # what it published before its PUB reached the router is lost
    _complete(e1.engine.url, "after the restart: " + LONG)
    assert _settle(events, "e1") > 0


@pytest.mark.parametrize("shape", ["completion", "chat with a system prompt", "multi-turn"])
def test_the_ids_the_router_asks_for_are_vllms_prompt_ids(events: EventFleet, shape: str) -> None:
    url = events.engines["e2"].engine.url
    chat = shape != "completion"
    if shape == "completion":
        body: dict[str, Any] = {"prompt": "Tell me about " + SENTENCE}
    elif shape == "chat with a system prompt":
        body = {
            "messages": [
                {"role": "system", "content": "You answer briefly. " + SENTENCE},
                {"role": "user", "content": "Where do the boats wait?"},
            ]
        }
    else:
        body = {
            "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Where do the boats wait?"},
                {"role": "assistant", "content": "In rows in the quiet harbour."},
                {"role": "user", "content": "And the ferry?"},
            ]
        }
    raw = {k: msgspec.Raw(msgspec.json.encode(v)) for k, v in body.items()}
    asked = json.loads(msgspec.json.encode(tokenize_body(raw, MODEL, chat=chat)))
    status, answer = http("POST", url + "/tokenize", asked)
    assert status == 200, answer
    ids = json.loads(answer)["tokens"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = {"model": MODEL, **body, "max_tokens": 1, "temperature": 0}
    status, raw_answer = http("POST", url + path, {**request, "return_token_ids": True})
    assert status == 200, raw_answer[:400]
    served = json.loads(raw_answer)
    prompt_ids = served.get("prompt_token_ids") or served["choices"][0].get("prompt_token_ids")
    assert prompt_ids == ids


def _journal_line(journal: Path, before: int) -> dict[str, Any]:
    for _ in range(100):  # bounded: the journal's writer thread may lag, 10 s at most
        lines = journal.read_text().splitlines() if journal.exists() else []
        if len(lines) > before:
            line: dict[str, Any] = json.loads(lines[before])
            return line
        time.sleep(0.1)
    raise AssertionError(f"no new journal line in {journal}")
