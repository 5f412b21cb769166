"""The fake engine's cost model on the consumer side, where conditional disaggregation
shows: the prefix cache keeps what a consumer pulled and what it generated (the next chat
turn hits it through the reply), a KV pull costs per block the consumer does not hold and
is counted under vLLM's NIXL metric names, and a prompt computed on an engine slows the
streams it is decoding (prefill interference). Engines run on the in-memory network under
trio's MockClock: every duration is exact virtual time."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from narwhal.fake_engine import cost
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from tests.support.memory_engine import (
    MS,
    alone,
    attach,
    call,
    chat_body,
    chat_content,
    descriptor,
    metric,
    prefill_body,
    scrape,
    stream_body,
    timed,
    words,
)
from tests.support.memory_network import MemoryNetwork

SYSTEM = {"role": "system", "content": words("rule", 60)}  # 64 tokens with its header
QUESTION = {"role": "user", "content": words("q", 12)}  # 16: the first turn is 5 blocks
TURN_1 = [SYSTEM, QUESTION]
REPLY_TOKENS = 40


def _pair(nursery: trio.Nursery, **consumer: Any) -> tuple[MemoryNetwork, FakeEngine, FakeEngine]:
    """A producer ``p`` (prefill, no cost) and a consumer ``d`` (decode, ``consumer``'s
    options) on one network."""
    net = MemoryNetwork(nursery)
    return net, attach(net, "p", role="prefill"), attach(net, "d", role="decode", **consumer)


async def _first_turn(net: MemoryNetwork, engine: str = "d", disaggregated: bool = True) -> str:
    """Turn 1, streamed on ``engine`` after a prefill on ``p`` (or computed there): the
    reply as the client read it."""
    fields: dict[str, Any] = {"stream": True}
    if disaggregated:
        prefill = chat_body(TURN_1, 1, kv_transfer_params={"do_remote_decode": True})
        fields["kv_transfer_params"] = await descriptor(net, "p", prefill)
    body = chat_body(TURN_1, REPLY_TOKENS, **fields)
    status, sse = await call(net, engine, "POST", "/v1/chat/completions", body)
    assert status == 200
    return chat_content(sse)


async def _second_turn(net: MemoryNetwork, reply: str) -> float:
    """Turn 2 as a local prefill on ``d`` (no descriptor): how long it took."""
    messages = [*TURN_1, {"role": "assistant", "content": reply}, {"role": "user", "content": "z"}]
    start = trio.current_time()
    status, _ = await call(net, "d", "POST", "/v1/chat/completions", chat_body(messages, 2))
    assert status == 200
    return trio.current_time() - start


# ---- the consumer's prefix cache -----------------------------------------------------------


async def test_the_next_chat_turn_hits_the_consumer_cache_through_the_reply(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, _, consumer = _pair(nursery, prefill_ms_per_token=MS, prefix_cache_blocks=256)
    reply = await _first_turn(net)
    # the reply in the client's tokens: the assistant's header, then its words (a word
    # the reply continues without a space is one token, as the client sends it back)
    reply_tokens = 4 + len(reply.split())
    assert reply_tokens >= 2 * cost.BLOCK_TOKENS  # the reply fills blocks of its own
    before = await scrape(net, "d")
    assert before[metric("prefix_cache_queries_total")] == 80  # the pull's lookup counts
    assert before[metric("prefix_cache_hits_total")] == 0
    elapsed = await _second_turn(net, reply)
    after = await scrape(net, "d")
    cached = 80 + reply_tokens - (80 + reply_tokens) % cost.BLOCK_TOKENS
    assert cached >= 80 + cost.BLOCK_TOKENS * (reply_tokens // cost.BLOCK_TOKENS)
    assert after[metric("prefix_cache_hits_total")] == cached
    # only the reply's partial block and the new message (4 + 1 tokens) are computed
    assert elapsed == (80 + reply_tokens + 5 - cached) / 16
    assert consumer.counters["prompt_tokens_cached"] == cached


async def test_a_reply_cut_short_is_not_cached(nursery: trio.Nursery, autojump_clock: Any) -> None:
    """Only a generation that ran to its end is cached: the stream here ends in an error
    (then ``[DONE]``, as vLLM ends it), and the next turn hits the pulled prompt alone."""
    net, _, consumer = _pair(nursery, prefill_ms_per_token=MS, prefix_cache_blocks=256)
    attach(net, "ref", role="both")  # says the whole reply: greedy, a function of the prompt
    consumer.faults.push(Fault(kind="stream_error", tokens=REPLY_TOKENS - 1))
    cut = await _first_turn(net)
    reply = await _first_turn(net, "ref", disaggregated=False)
    assert reply.startswith(cut)
    assert len(cut) < len(reply)
    await _second_turn(net, reply)
    assert (await scrape(net, "d"))[metric("prefix_cache_hits_total")] == 80


# ---- the KV pull's cost -------------------------------------------------------------------


async def test_a_pull_costs_per_block_the_consumer_does_not_hold(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    # 1/4 s a block after a fixed 1/2 s; the slowdown is the engine's, not the link's
    net, _, consumer = _pair(
        nursery, transfer_delay_s=0.5, kv_ms_per_block=250, prefix_cache_blocks=64, slowdown=2.0
    )
    shared = words("s", 48)  # 3 blocks

    async def pull(prompt: str) -> float:
        params = await descriptor(net, "p", prefill_body(prompt))
        return await timed(net, "d", stream_body(prompt, 2) | {"kv_transfer_params": params})

    assert await pull(shared + " " + words("a", 32)) == 0.5 + 5 * 0.25
    # 88 tokens: 6 blocks, the last one partial; the shared 3 are held
    assert await pull(shared + " " + words("b", 40)) == 0.5 + 3 * 0.25
    assert consumer.counters["kv_blocks_pulled"] == 8
    metrics = await scrape(net, "d")
    assert metrics[metric("nixl_xfer_time_seconds_count")] == 2
    assert metrics[metric("nixl_bytes_transferred_count")] == 2
    assert metrics[metric("nixl_bytes_transferred_sum")] == 8 * cost.KV_BYTES_PER_BLOCK
    assert metrics[metric("prefix_cache_hits_total")] == 48


async def test_a_pull_the_consumer_holds_whole_transfers_nothing(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, _, consumer = _pair(
        nursery, transfer_delay_s=0.5, kv_ms_per_block=250, prefix_cache_blocks=64
    )
    prompt = words("w", 80)  # exactly 5 blocks
    for _ in range(2):
        params = await descriptor(net, "p", prefill_body(prompt))
        elapsed = await timed(net, "d", stream_body(prompt, 2) | {"kv_transfer_params": params})
    assert elapsed == 0.5  # the handshake and the notice to free the producer's blocks
    assert consumer.counters["kv_pull_ok"] == 2
    assert consumer.counters["kv_blocks_pulled"] == 5
    metrics = await scrape(net, "d")
    assert metrics[metric("nixl_xfer_time_seconds_count")] == 1
    assert metrics[metric("nixl_bytes_transferred_sum")] == 5 * cost.KV_BYTES_PER_BLOCK
    # the hit, as vLLM counts it, still leaves the last token to compute
    assert metrics[metric("prefix_cache_hits_total")] == 64
    assert metrics[metric("prefix_cache_queries_total")] == 160


# ---- prefill interference ------------------------------------------------------------------


async def _stream_beside_prompts(net: MemoryNetwork, prompts: int) -> dict[str, float]:
    """A stream of 6 tokens a second apart after its 1 s prompt; at 1.5 s, ``prompts``
    local prompts of 2 s each arrive. When each request ended, from the stream's start."""
    done: dict[str, float] = {}
    start = trio.current_time()

    async def client(name: str, body: dict[str, Any]) -> None:
        await timed(net, "e0", body)
        done[name] = trio.current_time() - start

    async with trio.open_nursery() as clients:
        clients.start_soon(client, "stream", stream_body(words("s", 16), 6))
        await trio.sleep(1.5)
        for n in range(prompts):
            clients.start_soon(client, f"prompt{n}", prefill_body(words(f"p{n}_", 32)))
    return done


@pytest.mark.parametrize(("prompts", "stream_end"), [(0, 6.0), (1, 7.0), (2, 8.0)])
async def test_prefill_interference_slows_a_stream_only_while_prompts_are_computed(
    nursery: trio.Nursery, autojump_clock: Any, prompts: int, stream_end: float
) -> None:
    """Tokens at 1, 2, 3, ... alone. The gap that begins at 2 s, while the prompts are
    computed (1.5 s to 3.5 s), is 1 + 1 x prompts seconds; the gaps after it are 1 s again."""
    _, net = alone(nursery, itl_s=1.0, prefill_ms_per_token=MS, prefill_interference=1.0)
    done = await _stream_beside_prompts(net, prompts)
    assert done.pop("stream") == stream_end
    assert set(done.values()) <= {3.5}  # the prompts themselves are not slowed


async def test_a_pull_does_not_interfere(nursery: trio.Nursery, autojump_clock: Any) -> None:
    """Only computing a prompt shares the engine's steps; moving KV in does not."""
    net, _, _ = _pair(
        nursery, itl_s=1.0, prefill_ms_per_token=MS, kv_ms_per_block=500, prefill_interference=1.0
    )
    params = await descriptor(net, "p", prefill_body(words("x", 32)))
    async with trio.open_nursery() as clients:
        clients.start_soon(timed, net, "d", stream_body("a", 4))  # its prompt: 1/16 s
        await trio.sleep(0.5)
        pulled = stream_body(words("x", 32), 1) | {"kv_transfer_params": params}
        clients.start_soon(timed, net, "d", pulled)  # 1 s of pull
    assert trio.current_time() == 3 + 1 / 16


# ---- the decode batch ----------------------------------------------------------------------


async def _two_streams(net: MemoryNetwork, second: dict[str, Any]) -> dict[str, float]:
    """A stream of 5 tokens a second apart alone; at 1.5 s ``second`` arrives. When each
    ended, from the first one's start."""
    done: dict[str, float] = {}
    start = trio.current_time()

    async def client(name: str, body: dict[str, Any]) -> None:
        await timed(net, "e0", body)
        done[name] = trio.current_time() - start

    async with trio.open_nursery() as clients:
        clients.start_soon(client, "first", stream_body("a", 5))
        await trio.sleep(1.5)
        clients.start_soon(client, "second", second)
    return done


async def test_a_stream_that_joins_the_batch_slows_every_stream_from_the_next_gap(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """First alone: tokens at 0, 1, 2 s. Its gap that begins at 2 s, with the second stream
    decoding since 1.5 s, is 2 s, and so is the next; the second's own gaps are 2 s from its
    first token (1.5, 3.5, 5.5)."""
    _, net = alone(nursery, itl_s=1.0, decode_batch_growth=1.0)
    assert await _two_streams(net, stream_body("b", 3)) == {"second": 5.5, "first": 6.0}


async def test_a_prompt_being_computed_is_not_in_the_decode_batch(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """The second request's 2 s prompt (1.5 s to 3.5 s) leaves the first stream's pace
    alone (its own one-token prompt takes 1/16 s, then a token a second): the second joins
    the batch with its first token, after the first stream's last gap began."""
    _, net = alone(nursery, itl_s=1.0, prefill_ms_per_token=MS, decode_batch_growth=1.0)
    done = await _two_streams(net, stream_body(words("p", 32), 1))
    assert done == {"first": 4 + 1 / 16, "second": 3.5}


# ---- off by default ------------------------------------------------------------------------


async def test_without_the_options_pulls_cost_their_fixed_delay_and_streams_keep_pace(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, _, consumer = _pair(nursery, transfer_delay_s=0.5)
    prompt = words("w", 80)
    for _ in range(2):
        params = await descriptor(net, "p", prefill_body(prompt))
        elapsed = await timed(net, "d", stream_body(prompt, 2) | {"kv_transfer_params": params})
        assert elapsed == 0.5
    metrics = await scrape(net, "d")
    assert metrics[metric("nixl_xfer_time_seconds_count")] == consumer.counters["kv_pull_ok"] == 2
    assert metrics[metric("nixl_bytes_transferred_sum")] == 10 * cost.KV_BYTES_PER_BLOCK
    assert metrics[metric("prefix_cache_queries_total")] == 0
    assert consumer.stats()["prefix_cache"]["blocks"] == 0  # nothing cached, replies neither
    assert not consumer.config.cost_model
    # a prompt computed beside a stream leaves its pace alone
    _, alone_net = alone(nursery, "e0", itl_s=1.0, prefill_ms_per_token=MS)
    done = await _stream_beside_prompts(alone_net, 2)
    assert done == {"stream": 6.0, "prompt0": 3.5, "prompt1": 3.5}
