"""The precise prefix index on loopback: fake engines publish their caches' changes as vLLM
does, the router subscribes (real ZMQ sockets, real clock), and its view of each engine is
what that engine's events say: after evictions, a reset, gaps, a restart and garbage."""

from __future__ import annotations

import socket
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import zmq

from narwhal.core.config import AdmissionConfig, ConfigError, KvEventsConfig, PlacementConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.cost import VOCAB_SIZE
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.router.service import Router
from narwhal.router.token_source import TOKENIZE_TIMEOUT_S
from tests.support.fleet import MODEL, Harness, finish, fleet_config, serve_router, start_fleet

WAIT_S = 10.0
CACHE_BLOCKS = 8  # each engine's prefix cache: 8 blocks of 16 tokens


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def start_kv_fleet(nursery: trio.Nursery, tokenizer: str = "engine") -> Harness:
    """A producer, two consumers, every engine publishing its cache's events, and a router
    subscribed to them all (each engine's stream attached before it returns)."""
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode"},
        engine_config={
            "kv_events_endpoint": "tcp://127.0.0.1:0",
            "kv_events_replay_endpoint": "tcp://127.0.0.1:0",
            "prefix_cache_blocks": CACHE_BLOCKS,
        },
        kv_events=KvEventsConfig(mode="subscribe", tokenizer=tokenizer),
        placement=PlacementConfig(metrics_interval_s=0),
        admission=AdmissionConfig(queue=False),
    )
    await attached(harness.engines.values())
    return harness


async def attached(engines: Iterable[FakeEngine]) -> None:
    """Every engine's publisher has seen its subscriber: no batch from now on is lost."""
    with trio.fail_after(WAIT_S):
        for engine in engines:
            assert engine.kv_events is not None
            await engine.kv_events.wait_subscribed(1)


@pytest.fixture
async def kv_fleet(nursery: trio.Nursery) -> AsyncIterator[Harness]:
    harness = await start_kv_fleet(nursery)
    yield harness
    await finish(harness)


async def settle(harness: Harness, check: Callable[[], bool]) -> bool:
    """``check()`` once it holds, or as it stands after ``WAIT_S`` of the router reading."""
    with trio.move_on_after(WAIT_S):
        await harness.router.kv_subscriber.wait_until(check)
    return check()


def seen(harness: Harness) -> str:
    """The router's view of each engine beside that engine's cache: a failure's message."""
    views = {e: view(harness, e) for e in harness.engines}
    caches = {e: len(engine.prefix_cache.blocks) for e, engine in harness.engines.items()}
    return f"the router's view {views} of caches {caches}"


def view(harness: Harness, engine_id: str) -> dict[str, Any]:
    found: dict[str, Any] = msgspec.json.decode(harness.router.engines_view())
    (engine,) = [e for e in found["engines"] if e["id"] == engine_id]
    kv: dict[str, Any] = engine["kv_events"]
    return kv


def agrees(harness: Harness, engine_id: str) -> Callable[[], bool]:
    """The router holds exactly the blocks the engine's cache holds."""
    engine = harness.engines[engine_id]

    def check() -> bool:
        stream = harness.router.fleet.precise.streams.get(engine_id)  # made by its 1st batch
        return (
            stream is not None
            and stream.live
            and len(stream.blocks) == len(engine.prefix_cache.blocks)
            and not stream.waiting
        )

    return check


async def complete(harness: Harness, prompt: str) -> dict[str, Any]:
    reply = await harness.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.json()
    return body


async def knob(harness: Harness, engine_id: str, **knobs: Any) -> None:
    """Turn one of the engine's KV-event knobs (``POST /fake/kv_events``)."""
    url = harness.router.fleet.by_id[engine_id].url + "/fake/kv_events"
    answer = await harness.http.request("POST", url, content=msgspec.json.encode(knobs))
    assert answer.status == 200, answer.content


async def test_the_router_holds_what_each_engine_holds_past_evictions(kv_fleet: Harness) -> None:
    for i in range(6):  # 6 prompts of 3 blocks each: more than 8 blocks, so the caches evict
        await complete(kv_fleet, words(50, f"p{i}-"))
    for engine_id in ("p0", "d0", "d1"):
        assert await settle(kv_fleet, agrees(kv_fleet, engine_id)), seen(kv_fleet)
        assert view(kv_fleet, engine_id)["state"] == "live"
    p0 = kv_fleet.engines["p0"]
    assert p0.prefix_cache.evictions > 0
    assert view(kv_fleet, "p0")["blocks"] == CACHE_BLOCKS


async def test_placement_follows_what_the_events_say_not_what_was_sent(
    kv_fleet: Harness,
) -> None:
    prompt = words(64, "conversation-")
    await complete(kv_fleet, prompt)
    journal = kv_fleet.router.journal
    first = journal.lines[-1].attempts[0].consumer
    assert first is not None
    other = "d1" if first == "d0" else "d0"
    fleet = kv_fleet.router.fleet
    # the router sent the prompt to `first`; now `first` drops it and `other` computes it
    # (a client that bypassed the router): only the engines' events know
    for engine_id, path, body in (
        (first, "/reset_prefix_cache", None),
        (other, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}),
    ):
        content = None if body is None else msgspec.json.encode(body)
        answer = await kv_fleet.http.request(
            "POST", fleet.by_id[engine_id].url + path, content=content
        )
        assert answer.status == 200
    assert await settle(kv_fleet, agrees(kv_fleet, first)), seen(kv_fleet)
    assert await settle(kv_fleet, agrees(kv_fleet, other)), seen(kv_fleet)
    for _ in range(3):
        await complete(kv_fleet, prompt + " and more")
        assert journal.lines[-1].attempts[0].consumer == other


async def test_a_reset_clears_the_engine_in_the_router_too(kv_fleet: Harness) -> None:
    await complete(kv_fleet, words(40, "reset-"))
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)
    assert view(kv_fleet, "p0")["blocks"] > 0
    url = kv_fleet.router.fleet.by_id["p0"].url
    reset = await kv_fleet.http.request("POST", url + "/reset_prefix_cache")
    assert reset.status == 200
    assert await settle(kv_fleet, lambda: view(kv_fleet, "p0")["blocks"] == 0), seen(kv_fleet)


async def test_a_gap_is_repaired_from_the_replay_socket(kv_fleet: Harness) -> None:
    await complete(kv_fleet, words(40, "before-"))  # the stream is live from this batch
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)
    await knob(kv_fleet, "p0", drop_next=1)
    await complete(kv_fleet, words(40, "lost-"))  # its batch never reaches the router
    await complete(kv_fleet, words(40, "after-"))  # this one shows the gap
    assert await settle(kv_fleet, lambda: view(kv_fleet, "p0")["repaired"] == 1), seen(kv_fleet)
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)
    assert view(kv_fleet, "p0")["unrepaired"] == 0


async def test_a_gap_the_replay_cannot_repair_drops_the_engine(kv_fleet: Harness) -> None:
    p0 = kv_fleet.engines["p0"]
    await complete(kv_fleet, words(40, "before-"))
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)
    await knob(kv_fleet, "p0", drop_next=1, forget=True)
    await complete(kv_fleet, words(40, "lost-"))
    await complete(kv_fleet, words(40, "after-"))
    assert await settle(kv_fleet, lambda: view(kv_fleet, "p0")["unrepaired"] == 1), seen(kv_fleet)
    # what it held before the gap is gone from the router; only what came after is there
    assert view(kv_fleet, "p0")["blocks"] < len(p0.prefix_cache.blocks)


async def test_an_engine_that_restarts_is_dropped_then_rebuilt(kv_fleet: Harness) -> None:
    await complete(kv_fleet, words(40, "old-"))
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)
    await knob(kv_fleet, "p0", restart=True)  # sequence from 0, the cache empty
    await complete(kv_fleet, words(40, "new-"))
    assert await settle(kv_fleet, lambda: view(kv_fleet, "p0")["restarts"] == 1), seen(kv_fleet)
    assert await settle(kv_fleet, agrees(kv_fleet, "p0")), seen(kv_fleet)


async def test_garbage_and_floods_are_counted_and_serving_goes_on(kv_fleet: Harness) -> None:
    await knob(kv_fleet, "p0", garbage_next=1)
    await complete(kv_fleet, words(40, "garbage-"))
    rejected = await settle(kv_fleet, lambda: view(kv_fleet, "p0")["rejected"].get("batch") == 1)
    assert rejected, seen(kv_fleet)
    await knob(kv_fleet, "p0", flood=20_000)
    body = await complete(kv_fleet, words(10, "during-"))  # answered while the flood is read
    assert body["choices"][0]["text"]
    series = b'narwhal_kv_events_rejected_total{engine="p0",why="batch"} 1.0'
    with trio.fail_after(WAIT_S):  # the metrics catch up within a second of the batch
        await kv_fleet.router.kv_subscriber.wait_until(
            lambda: series in kv_fleet.router.metrics.render()
        )
    assert series in (await kv_fleet.get("/metrics")).body


async def test_listen_mode_reads_every_engine_through_one_bound_socket(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """The engines' publishers connect to the router (vLLM's endpoint without ``*``), each
    under its own topic; the router binds one SUB socket and tells them apart by topic."""
    port = free_port()
    listen = f"tcp://127.0.0.1:{port}"
    engines: dict[str, FakeEngine] = {}
    urls: dict[str, tuple[str, str]] = {}
    for engine_id, role in (("p0", "prefill"), ("d0", "decode")):
        engine = FakeEngine(
            FakeEngineConfig(
                model=MODEL,
                role=role,  # type: ignore[arg-type]
                kv_events_endpoint=listen,
                kv_events_topic=f"kv-{engine_id}",
                prefix_cache_blocks=CACHE_BLOCKS,
            )
        )
        urls[engine_id] = (await nursery.start(engine.serve), role)
        engines[engine_id] = engine
    config = fleet_config(
        urls,
        kv_events=KvEventsConfig(mode="listen", listen=listen),
        placement=PlacementConfig(metrics_interval_s=0),
    )
    harness = await serve_router(nursery, Router(config), engines)
    await attached(engines.values())
    await complete(harness, words(40, "listen-"))
    assert await settle(harness, agrees(harness, "p0")), seen(harness)
    assert await settle(harness, agrees(harness, "d0")), seen(harness)
    assert view(harness, "p0")["blocks"] > 0
    # a publisher under a topic no engine of the fleet has: dropped, and named in the log
    stray = zmq.Context.instance().socket(zmq.PUB)
    stray.setsockopt(zmq.LINGER, 0)
    stray.connect(listen)
    try:
        with trio.fail_after(WAIT_S):
            for seq in range(1000):  # bounded: until the SUB's subscription has reached it
                stray.send_multipart([b"kv-nobody", seq.to_bytes(8, "big"), b"\x90"])
                if "kv-nobody" in caplog.text:
                    break
                await trio.sleep(0.01)  # the publisher's pace
    finally:
        stray.close()
    assert caplog.text.count("'kv-nobody', which no engine of the fleet publishes") == 1
    assert view(harness, "p0")["state"] == "live"
    await finish(harness)


def _word_tokenizer(path: Path, words: list[str]) -> str:
    """A tokenizer.json whose ids for ``words`` are the fake engine's (a word's CRC-32
    within its vocabulary), so the router's own ids match what the engines publish."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": VOCAB_SIZE + 1}
    vocab.update({w: zlib.crc32(w.encode()) % VOCAB_SIZE for w in words})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return str(path)


async def test_a_local_tokenizer_json_places_text_prompts_without_asking_the_engines(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prompt = words(64, "local-")
    tokenizer = _word_tokenizer(tmp_path / "tokenizer.json", prompt.split())
    harness = await start_kv_fleet(nursery, tokenizer)
    # d1 computes the prompt outside the router: only its events say so
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    url = harness.router.fleet.by_id["d1"].url + "/v1/completions"
    answer = await harness.http.request("POST", url, content=msgspec.json.encode(body))
    assert answer.status == 200
    assert await settle(harness, agrees(harness, "d1")), seen(harness)
    await complete(harness, prompt)
    assert harness.router.journal.lines[-1].attempts[0].consumer == "d1"
    assert harness.router.tokens.asked == 0  # no /tokenize: the ids came from the file
    await finish(harness)


def test_a_tokenizer_json_that_cannot_be_read_refuses_the_fleet(tmp_path: Path) -> None:
    config = fleet_config(
        {"p0": ("http://127.0.0.1:9", "both")},
        kv_events=KvEventsConfig(mode="subscribe", tokenizer=str(tmp_path / "none.json")),
    )
    with pytest.raises(ConfigError) as caught:
        Router(config)
    (problem,) = caught.value.problems
    assert problem.startswith(f"kv_events.tokenizer: cannot read {tmp_path / 'none.json'}")


async def test_a_tokenizer_that_hangs_costs_one_request_its_bound_then_none(
    kv_fleet: Harness,
) -> None:
    await complete(kv_fleet, words(40, "warm-"))
    assert await settle(kv_fleet, kv_fleet.router.fleet.precise.any_live), seen(kv_fleet)
    for engine in kv_fleet.engines.values():
        engine.faults.push(Fault(kind="hang", leg="tokenize", rate=1.0))
    tokens = kv_fleet.router.tokens
    asked = tokens.asked
    started = trio.current_time()
    await complete(kv_fleet, words(40, "hung-"))  # answered: placement goes on the estimate
    assert trio.current_time() - started < TOKENIZE_TIMEOUT_S + 2.0
    assert (tokens.asked, tokens.failed) == (asked + 1, 1)
    await complete(kv_fleet, words(40, "after-"))  # within the back-off: nobody is asked
    assert tokens.asked == asked + 1
