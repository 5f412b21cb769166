"""The fake engine's KV events as a router reads them: a real ZMQ SUB socket and replay
client against an engine on loopback (real clock), its prefix cache smaller than the
prompts sent, so blocks are stored and evicted."""

from __future__ import annotations

from typing import Any

import httpcore
import msgspec
import pytest
import trio

from narwhal.fake_engine import kv_events
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.support.kv_events import (
    MODEL,
    Engine,
    Message,
    kv_engine,
    replay,
    subscriber,
    words,
)

# 40 words: two full blocks and 8 tokens; a 4-token reply (the engine caches prompt and
# reply) still fills no third block, so each request is exactly one batch
PROMPT_WORDS = 40


def _stored(events: list[kv_events.Event]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def _removed(events: list[kv_events.Event]) -> list[BlockRemoved]:
    return [e for e in events if isinstance(e, BlockRemoved)]


class Replica:
    """What a router's index holds after applying the events: hash -> (parent, ids)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}

    def apply(self, events: list[kv_events.Event]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                assert parent is None or parent in self.blocks  # a parent it was told of
                for n, block in enumerate(event.block_hashes):
                    self.blocks[block] = (parent, event.token_ids[16 * n : 16 * n + 16])
                    parent = block
            elif isinstance(event, BlockRemoved):
                for block in event.block_hashes:
                    del self.blocks[block]  # only blocks it was told of are removed
            else:
                self.blocks.clear()


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_the_events_describe_the_cache_stores_and_evictions_in_sequence(
    nursery: trio.Nursery, encoding: kv_events.Encoding
) -> None:
    async with (
        kv_engine(nursery, prefix_cache_blocks=4, kv_events_encoding=encoding) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        a, b, c = (words(PROMPT_WORDS, tag) for tag in "abc")
        d = b + " " + words(8, "d")  # b's two blocks, then a third block of its own
        replica = Replica()
        messages: list[Message] = []
        for prompt in (a, b, c, d):
            await e.complete(prompt)
            message = await sub.next()
            messages.append(message)
            replica.apply(message.batch(encoding))
        assert [m.seq for m in messages] == [0, 1, 2, 3]
        assert {m.topic for m in messages} == {b"kv"}
        assert sub.pending() == 0  # one batch a request, nothing more

        # the wire itself, read without our structs
        ts, raw_events, rank = msgspec.msgpack.decode(messages[0].payload)
        assert isinstance(ts, float)
        assert rank == 0
        [raw] = raw_events
        if encoding == "map":
            assert list(raw) == [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ]
            assert (raw["type"], raw["block_size"], raw["medium"]) == ("BlockStored", 16, "GPU")
        else:
            assert raw[0] == "BlockStored"
            assert raw[2:] == [None, raw[3], 16, None, "GPU", None]

        batches = [m.batch(encoding) for m in messages]
        # a: its two full blocks, the ids /tokenize gives it
        [stored_a] = batches[0]
        assert isinstance(stored_a, BlockStored)
        assert stored_a.parent_block_hash is None
        assert stored_a.token_ids == (await e.tokenize({"prompt": a}))[:32]
        assert all(0 <= h < 2**64 for h in stored_a.block_hashes)
        # c fills the cache past its 4 blocks: a's (the least recently used) are evicted
        [stored_c] = _stored(batches[2])
        [removed] = _removed(batches[2])
        assert len(stored_c.block_hashes) == 2
        assert sorted(removed.block_hashes) == sorted(stored_a.block_hashes)
        # d: only the block the cache did not hold, its parent b's last block
        [stored_b] = batches[1]
        assert isinstance(stored_b, BlockStored)
        [stored_d] = _stored(batches[3])
        assert stored_d.parent_block_hash == stored_b.block_hashes[-1]
        assert stored_d.token_ids == (await e.tokenize({"prompt": d}))[32:48]
        [removed_d] = _removed(batches[3])
        assert removed_d.block_hashes == [stored_c.block_hashes[1]]  # c's tail goes first
        # the router's replica holds exactly what the engine's cache holds
        assert len(replica.blocks) == len(e.engine.prefix_cache.blocks) == 4
        status, stats = await e.call("GET", "/fake/stats")
        assert (status, stats["kv_events"]["seq"], stats["kv_events"]["published"]) == (200, 4, 4)


async def test_a_reset_clears_the_cache_and_says_so(nursery: trio.Nursery) -> None:
    async with kv_engine(nursery, prefix_cache_blocks=8) as e, subscriber(nursery, e.engine) as sub:
        await e.complete(words(PROMPT_WORDS, "a"))
        assert (await sub.next()).seq == 0
        status, _ = await e.call("POST", "/reset_prefix_cache")
        assert status == 200
        message = await sub.next()
        assert (message.seq, message.batch()) == (1, [AllBlocksCleared()])
        assert not e.engine.prefix_cache.blocks
        # the same prompt again is stored again, whole
        await e.complete(words(PROMPT_WORDS, "a"))
        [stored] = (await sub.next()).batch()
        assert isinstance(stored, BlockStored)
        assert len(stored.block_hashes) == 2


async def test_events_on_give_the_cache_the_kv_capacity_and_describe_chat_as_tokenize_does(
    nursery: trio.Nursery,
) -> None:
    """No --prefix-cache-blocks: the cache is the KV cache (kv_blocks). A chat's published
    ids are the ids /tokenize gives its messages (framing tokens included)."""
    async with kv_engine(nursery, kv_blocks=64) as e, subscriber(nursery, e.engine) as sub:
        assert e.engine.prefix_cache.capacity == 64
        # 34 words + 4 framing tokens: 38, two full blocks; the reply (4 framing tokens and
        # at most 4 words) fills no third
        messages = [{"role": "user", "content": words(34, "c")}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        status, _ = await e.call("POST", "/v1/chat/completions", body)
        assert status == 200
        [stored] = (await sub.next()).batch()
        assert isinstance(stored, BlockStored)
        tokens = await e.tokenize({"messages": messages})
        assert len(tokens) == 38
        assert stored.token_ids == tokens[:32]
        # and a completion's /tokenize ids match what it published
        await e.complete(words(PROMPT_WORDS, "p"))
        [stored] = (await sub.next()).batch()
        assert isinstance(stored, BlockStored)
        assert stored.token_ids == (await e.tokenize({"prompt": words(PROMPT_WORDS, "p")}))[:32]


async def test_a_publisher_that_connects_reaches_the_subscriber_that_binds(
    nursery: trio.Nursery,
) -> None:
    """An endpoint without ``*`` (nor port 0): the engine connects to the router's bound
    SUB, as vLLM does, under the engine's own topic."""
    async with subscriber(nursery, topic=b"e7") as sub:
        address = sub.bind()
        async with kv_engine(nursery, kv_events_endpoint=address, kv_events_topic="e7") as e:
            with trio.fail_after(10):
                await e.publisher.wait_subscribed()
            status, answer = await e.call("GET", "/kv_event_sources")
            sources = answer["0"]
            assert status == 200
            assert (sources["endpoint"], sources["mode"], sources["topic"]) == (
                address,
                "connect",
                "e7",
            )
            assert sources["bound_endpoint"] is None
            await e.complete(words(PROMPT_WORDS, "a"))
            message = await sub.next()
            assert (message.topic, message.seq) == (b"e7", 0)


async def test_kv_event_sources_names_the_addresses_a_router_can_use(
    nursery: trio.Nursery,
) -> None:
    async with kv_engine(nursery, kv_events_buffer_steps=50) as e:
        status, answer = await e.call("GET", "/kv_event_sources")
        sources = answer["0"]
        assert status == 200
        assert sources["enable_kv_cache_events"] is True
        assert sources["publisher"] == "zmq"
        assert (sources["topic"], sources["buffer_steps"], sources["encoding"]) == (
            "kv",
            50,
            "map",
        )
        assert sources["mode"] == "bind"
        for key in ("endpoint", "replay_endpoint"):
            host, port = sources[key].removeprefix("tcp://").rsplit(":", 1)
            assert (host, port != "0") == ("127.0.0.1", True)
        assert sources["endpoint"] == sources["bound_endpoint"] == e.publisher.endpoint
        assert sources["replay_endpoint"] == sources["bound_replay_endpoint"]
    async with kv_engine(nursery, kv_events_endpoint="tcp://*:0") as e:
        _, answer = await e.call("GET", "/kv_event_sources")
        sources = answer["0"]
        assert sources["endpoint"].startswith("tcp://*:")  # "*": the engine's own host
        assert sources["bound_endpoint"].startswith("tcp://127.0.0.1:")  # loopback only
        async with subscriber(nursery, e.engine) as sub:
            await e.complete(words(PROMPT_WORDS, "a"))
            assert (await sub.next()).seq == 0


async def test_without_an_endpoint_there_are_no_events_and_the_routes_are_vllms_404(
    nursery: trio.Nursery,
) -> None:
    engine = FakeEngine(FakeEngineConfig(model=MODEL))
    await nursery.start(engine.serve)
    async with httpcore.AsyncConnectionPool() as http:
        e = Engine(engine, http)
        assert engine.kv_events is None
        assert engine.prefix_cache.capacity == 0
        for method, path in (("GET", "/kv_event_sources"), ("POST", "/fake/kv_events")):
            assert await e.call(method, path, {}) == (404, {"detail": "Not Found"})
        assert (await e.call("POST", "/reset_prefix_cache"))[0] == 200
        assert "kv_events" not in (await e.call("GET", "/fake/stats"))[1]
    engine.stop()


async def test_a_replay_repairs_a_dropped_batch(nursery: trio.Nursery) -> None:
    async with (
        kv_engine(nursery, prefix_cache_blocks=16) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        status, _ = await e.call("POST", "/fake/kv_events", {"drop_next": 1})
        assert status == 200
        await e.complete(words(PROMPT_WORDS, "a"))  # seq 0: not sent
        await e.complete(words(PROMPT_WORDS, "b"))
        message = await sub.next()
        assert message.seq == 1  # a gap: 0 is missing
        replayed = await replay(e.publisher.replay_endpoint, 0)
        assert [m.seq for m in replayed] == [0, 1]
        assert replayed[1].payload == message.payload
        [stored] = replayed[0].batch()
        assert isinstance(stored, BlockStored)
        assert stored.token_ids == (await e.tokenize({"prompt": words(PROMPT_WORDS, "a")}))[:32]
        # from a later start, only what follows
        assert [m.seq for m in await replay(e.publisher.replay_endpoint, 1)] == [1]
        assert await replay(e.publisher.replay_endpoint, 2) == []


async def test_a_forgotten_batch_is_a_gap_no_replay_repairs(nursery: trio.Nursery) -> None:
    async with (
        kv_engine(nursery, prefix_cache_blocks=16) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        await e.call("POST", "/fake/kv_events", {"drop_next": 1, "forget": True})
        await e.complete(words(PROMPT_WORDS, "a"))
        await e.complete(words(PROMPT_WORDS, "b"))
        assert (await sub.next()).seq == 1
        assert [m.seq for m in await replay(e.publisher.replay_endpoint, 0)] == [1]


async def test_duplicates_garbage_and_floods_reach_the_subscriber(nursery: trio.Nursery) -> None:
    async with (
        kv_engine(nursery, prefix_cache_blocks=16) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        await e.call("POST", "/fake/kv_events", {"duplicate_next": 1, "garbage_next": 1})
        await e.complete(words(PROMPT_WORDS, "a"))  # garbage first (precedence)
        await e.complete(words(PROMPT_WORDS, "b"))  # then the duplicate
        garbage, first, second = await sub.take(3)
        assert (garbage.seq, garbage.payload) == (0, kv_events.GARBAGE)
        with pytest.raises(msgspec.DecodeError):
            garbage.batch()
        assert (first.seq, second.seq) == (1, 1)
        assert first.payload == second.payload
        # the replay has the real batch 0
        [replayed, _] = await replay(e.publisher.replay_endpoint, 0)
        assert isinstance(replayed.batch()[0], BlockStored)
        status, stats = await e.call("POST", "/fake/kv_events", {"flood": 300})
        assert status == 200
        assert stats["seq"] == 302
        flood = await sub.take(300)
        assert [m.seq for m in flood] == list(range(2, 302))
        stored, removed = flood[-1].batch()
        assert isinstance(stored, BlockStored)
        assert isinstance(removed, BlockRemoved)
        assert removed.block_hashes == stored.block_hashes  # a flood leaves nothing behind


@pytest.mark.parametrize("how", ["knob", "process"])
async def test_a_restart_starts_the_sequence_again_with_new_hashes(
    nursery: trio.Nursery, how: str
) -> None:
    async with (
        kv_engine(nursery, prefix_cache_blocks=16) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        prompt = words(PROMPT_WORDS, "a")
        await e.complete(prompt)
        await e.complete(words(PROMPT_WORDS, "b"))
        before = await sub.take(2)
        if how == "knob":
            status, stats = await e.call("POST", "/fake/kv_events", {"restart": True})
            assert (status, stats["seq"], stats["buffered"]) == (200, 0, 0)
        else:
            seen = e.publisher.subscriptions
            e.engine.stop()
            await nursery.start(e.engine.serve)  # the same ports again
            with trio.fail_after(10):  # the subscriber reconnects and subscribes again
                await e.publisher.wait_subscribed(seen + 1)
        assert not e.engine.prefix_cache.blocks
        await e.complete(prompt)
        after = await sub.next()
        assert after.seq == 0
        [old], [new] = before[0].batch(), after.batch()
        assert isinstance(old, BlockStored)
        assert isinstance(new, BlockStored)
        assert new.token_ids == old.token_ids
        assert set(new.block_hashes).isdisjoint(old.block_hashes)  # a new salt


async def test_a_malformed_replay_request_is_ignored_and_the_next_answered(
    nursery: trio.Nursery,
) -> None:
    async with kv_engine(nursery, prefix_cache_blocks=16) as e:
        await e.complete(words(PROMPT_WORDS, "a"))
        endpoint = e.publisher.replay_endpoint
        with trio.move_on_after(0.5) as waited:  # no answer comes to a malformed request
            await replay(endpoint, 0, [b"", b"short"])
        assert waited.cancelled_caught
        with trio.move_on_after(0.5) as waited:
            await replay(endpoint, 0, [b"not empty", (0).to_bytes(8, "big")])
        assert waited.cancelled_caught
        assert [m.seq for m in await replay(endpoint, 0)] == [0]
        counters: dict[str, Any] = (await e.call("GET", "/fake/stats"))[1]["kv_events"]
        assert counters["counters"]["replay_rejected"] == 2


async def test_bad_knobs_are_a_400(nursery: trio.Nursery) -> None:
    async with kv_engine(nursery) as e:
        for body in ({"drop_next": -1}, {"nonsense": 1}, [1]):
            status, reply = await e.call("POST", "/fake/kv_events", body)
            assert status == 400, body
            assert reply["error"]["code"] == 400
