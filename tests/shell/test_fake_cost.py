"""The fake engine's cost model: slots and a FIFO queue, prefill time per uncached prompt
token, a prefix cache of chained prompt-block hashes (LRU), a slowdown, and their
``/metrics`` in vLLM's names. Engines run on the in-memory network under trio's MockClock,
so every duration is exact virtual time (costs are powers of two: exact floats)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from narwhal.fake_engine import cost
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.process.cli import build_parser
from tests.support.memory_engine import (
    MODEL,
    MS,
    alone,
    call,
    metric,
    prefill_body,
    scrape,
    stream_body,
    timed,
    words,
)
from tests.support.memory_network import MemoryNetwork

# ---- slots and the queue -----------------------------------------------------------------


async def test_requests_beyond_the_slots_wait_in_fifo_order_and_show_in_metrics(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    engine, net = alone(nursery, slots=1, itl_s=1.0)
    done: dict[str, float] = {}

    async def client(name: str) -> None:
        await timed(net, "e0", stream_body(f"prompt {name}", 5))  # 4 s of tokens
        done[name] = trio.current_time()

    async with trio.open_nursery() as clients:
        for name in "abc":
            clients.start_soon(client, name)
            await trio.sleep(0.25)  # virtual: a, b, c arrive in this order
        metrics = await scrape(net, "e0")
        assert metrics[metric("num_requests_running")] == 1
        assert metrics[metric("num_requests_waiting")] == 2
        assert engine.stats()["waiting"] == 2
    assert done == {"a": 4.0, "b": 8.0, "c": 12.0}
    metrics = await scrape(net, "e0")
    assert metrics[metric("num_requests_running")] == 0
    assert metrics[metric("num_requests_waiting")] == 0


async def test_a_client_that_leaves_while_queued_leaves_the_queue(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    engine, net = alone(nursery, slots=1, itl_s=1.0)
    async with trio.open_nursery() as clients:
        clients.start_soon(timed, net, "e0", stream_body("first", 5))
        await trio.sleep(0.5)
        with trio.move_on_after(1.0):
            await timed(net, "e0", stream_body("second", 5))
        await trio.sleep(0.5)
        assert engine.waiting == 0
        assert (await scrape(net, "e0"))[metric("num_requests_running")] == 1
    # the slot went to nobody else: the next request starts at once
    assert await timed(net, "e0", stream_body("third", 2)) == 1.0


async def test_without_slots_nothing_queues(nursery: trio.Nursery, autojump_clock: Any) -> None:
    engine, net = alone(nursery, itl_s=1.0)
    async with trio.open_nursery() as clients:
        for name in "abc":
            clients.start_soon(timed, net, "e0", stream_body(name, 3))
        await trio.sleep(0.5)
        metrics = await scrape(net, "e0")
        assert metrics[metric("num_requests_running")] == 3
        assert metrics[metric("num_requests_waiting")] == 0
    assert trio.current_time() == 2.0
    assert not engine.config.cost_model


async def test_an_admitted_prompt_holds_kv_blocks_while_it_runs(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    _, net = alone(nursery, slots=2, itl_s=1.0, kv_blocks=100)
    async with trio.open_nursery() as clients:
        clients.start_soon(timed, net, "e0", stream_body(words("w", 40), 3))  # 3 blocks
        await trio.sleep(0.5)
        assert (await scrape(net, "e0"))[metric("kv_cache_usage_perc")] == 0.03
    assert (await scrape(net, "e0"))[metric("kv_cache_usage_perc")] == 0.0


async def test_prompts_beyond_the_prefill_slots_wait_while_streams_decode(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """One prompt computed at a time (1 s each), in arrival order, the next waiting in the
    queue; a stream whose prompt is done decodes beside the next prompt."""
    engine, net = alone(nursery, prefill_slots=1, prefill_ms_per_token=MS, itl_s=1.0)
    done: dict[str, float] = {}

    async def client(name: str, tokens: int) -> None:
        await timed(net, "e0", stream_body(words(name, 16), tokens))
        done[name] = trio.current_time()

    async with trio.open_nursery() as clients:
        for name, tokens in (("a", 3), ("b", 1), ("c", 1)):
            clients.start_soon(client, name, tokens)
            await trio.sleep(0.25)
        metrics = await scrape(net, "e0")
        assert metrics[metric("num_requests_running")] == 1
        assert metrics[metric("num_requests_waiting")] == 2
    # a: its prompt 0-1 s, then tokens at 1, 2, 3 s; b and c computed after it in turn
    assert done == {"a": 3.0, "b": 2.0, "c": 3.0}
    assert engine.counters["prompt_tokens_computed"] == 48
    assert engine.config.cost_model


# ---- prefill time and the prefix cache -----------------------------------------------------


async def test_prefill_time_is_proportional_to_the_prompt(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    _, net = alone(nursery, role="prefill", prefill_ms_per_token=MS)
    assert await timed(net, "e0", prefill_body(words("a", 16))) == 1.0
    assert await timed(net, "e0", prefill_body(words("b", 48))) == 3.0
    # no prefix cache: the same prompt again costs as much
    assert await timed(net, "e0", prefill_body(words("b", 48))) == 3.0
    metrics = await scrape(net, "e0")
    assert metrics[metric("prefix_cache_queries_total")] == 0
    assert metrics[metric("prefix_cache_hits_total")] == 0


async def test_a_shared_prefix_is_computed_once(nursery: trio.Nursery, autojump_clock: Any) -> None:
    engine, net = alone(nursery, role="prefill", prefill_ms_per_token=MS, prefix_cache_blocks=64)
    prefix = words("system", 160)  # 10 blocks
    assert await timed(net, "e0", prefill_body(prefix + " " + words("q", 16))) == 11.0
    assert await timed(net, "e0", prefill_body(prefix + " " + words("r", 16))) == 1.0
    metrics = await scrape(net, "e0")
    assert metrics[metric("prefix_cache_queries_total")] == 2 * 176
    assert metrics[metric("prefix_cache_hits_total")] == 160
    # another prefix shares nothing
    assert await timed(net, "e0", prefill_body(words("other", 32))) == 2.0
    assert (await scrape(net, "e0"))[metric("prefix_cache_hits_total")] == 160
    assert engine.counters["prompt_tokens_cached"] == 160


async def test_a_fully_cached_prompt_still_computes_its_last_token(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    _, net = alone(nursery, role="prefill", prefill_ms_per_token=MS, prefix_cache_blocks=64)
    prompt = words("x", 32)  # two full blocks: the hit stops short of the last token
    assert await timed(net, "e0", prefill_body(prompt)) == 2.0
    assert await timed(net, "e0", prefill_body(prompt)) == 1.0  # block 2 recomputed
    assert (await scrape(net, "e0"))[metric("prefix_cache_hits_total")] == 16


async def test_the_least_recently_used_prefix_is_evicted(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    engine, net = alone(nursery, role="prefill", prefill_ms_per_token=MS, prefix_cache_blocks=10)
    a, b = words("a", 161), words("b", 161)  # 10 full blocks each, and one token
    assert await timed(net, "e0", prefill_body(a)) == 161 / 16
    assert await timed(net, "e0", prefill_body(a)) == 1 / 16
    assert await timed(net, "e0", prefill_body(b)) == 161 / 16  # evicts all of a
    assert await timed(net, "e0", prefill_body(a)) == 161 / 16
    assert engine.prefix_cache.evictions == 20
    assert engine.stats()["prefix_cache"]["blocks"] == 10


async def test_a_chat_prompt_is_its_rendered_messages(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    _, net = alone(nursery, role="prefill", prefill_ms_per_token=MS, prefix_cache_blocks=64)
    system = {"role": "system", "content": words("rule", 60)}  # 64 tokens with its header

    def chat(question: str) -> dict[str, Any]:
        messages = [system, {"role": "user", "content": question}]
        return {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }

    start = trio.current_time()
    assert (await call(net, "e0", "POST", "/v1/chat/completions", chat(words("q", 12))))[0] == 200
    assert trio.current_time() - start == 5.0  # 64 + 4 + 12 tokens
    start = trio.current_time()
    assert (await call(net, "e0", "POST", "/v1/chat/completions", chat(words("z", 12))))[0] == 200
    assert trio.current_time() - start == 1.0  # the system message's 4 blocks were cached


async def test_same_worker_decode_finds_the_prefill_in_the_cache(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """A ``both`` engine that prefilled a prompt decodes it without computing it again."""
    _, net = alone(nursery, role="both", prefill_ms_per_token=MS, prefix_cache_blocks=64)
    prompt = words("p", 80)  # 5 blocks
    assert await timed(net, "e0", prefill_body(prompt)) == 5.0
    assert await timed(net, "e0", stream_body(prompt, 4)) == 1.0  # the last block again


async def test_a_consumer_caches_the_prompt_it_pulled(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net = MemoryNetwork(nursery)
    fields: dict[str, Any] = {"model": MODEL, "prefill_ms_per_token": MS}
    producer = FakeEngine(FakeEngineConfig(role="prefill", **fields), network=net)
    consumer = FakeEngine(
        FakeEngineConfig(role="decode", prefix_cache_blocks=64, **fields), network=net
    )
    producer.attach("p")
    consumer.attach("d")
    prompt = words("p", 80)
    status, body = await call(net, "p", "POST", "/v1/completions", prefill_body(prompt))
    assert status == 200
    decode = stream_body(prompt, 2) | {
        "kv_transfer_params": msgspec.json.decode(body)["kv_transfer_params"]
    }
    assert await timed(net, "d", decode) == 0.0  # pulled, not computed
    assert await timed(net, "d", stream_body(prompt, 2)) == 1.0  # local: 4 blocks cached
    assert consumer.counters["kv_pull_ok"] == 1


# ---- slowdown -----------------------------------------------------------------------------


async def test_a_slowdown_of_two_doubles_every_modelled_time(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fields: dict[str, Any] = {"prefill_ms_per_token": MS, "itl_s": 0.25}
    _, net = alone(nursery, "fast", **fields)
    _, slow_net = alone(nursery, "slow", slowdown=2.0, **fields)
    body = stream_body(words("w", 16), 5)  # 1 s of prefill, 4 gaps of 0.25 s
    assert await timed(net, "fast", body) == 2.0
    assert await timed(slow_net, "slow", body) == 4.0
    # the older option, in seconds per token, is scaled too
    _, old = alone(nursery, "old", prefill_delay_per_token_s=0.125, slowdown=2.0)
    assert await timed(old, "old", prefill_body(words("w", 16))) == 4.0


# ---- sans IO: tokens, block hashes, the LRU --------------------------------------------


def test_prompt_tokens_are_as_many_as_the_engine_counts() -> None:
    bodies: list[tuple[dict[str, Any], bool]] = [
        ({"prompt": "a b  c\n d"}, False),
        ({"prompt": ""}, False),
        ({"prompt": [5, 6, 7]}, False),
        ({"prompt": ["x y", "z"]}, False),
        ({"messages": [{"role": "user", "content": "hi there"}]}, True),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a b"}]}]}, True),
        ({"messages": ["odd", {"role": "system"}]}, True),
    ]
    for body, chat in bodies:
        assert len(cost.prompt_tokens(body, chat)) == gen.prompt_of(body, chat)[1], body


def test_a_block_hash_depends_on_the_whole_prefix() -> None:
    one, two = [1] * 16, [2] * 16
    assert cost.block_hashes(one + two)[1] != cost.block_hashes(two + two)[1]
    assert cost.block_hashes(one + two)[0] == cost.block_hashes(one + one)[0]
    assert len(cost.block_hashes(one + two + [3] * 15)) == 2  # only full blocks


def test_eviction_takes_the_tail_of_the_oldest_prompt_first() -> None:
    cache = cost.PrefixCache(10)
    a = list(range(161))  # 10 blocks
    cache.insert(a)
    cache.insert([-1] * 81)  # 5 new blocks push out a's last 5: its head still hits
    assert cache.lookup(a) == 80
    assert cache.evictions == 5


def test_a_prompt_computed_again_is_the_most_recently_used() -> None:
    cache = cost.PrefixCache(10)
    a, b, c = ([n] * 81 for n in (1, 2, 3))  # 5 blocks each
    cache.insert(a)
    cache.insert(b)
    cache.insert(a)  # touched: b is now the least recently used
    cache.insert(c)
    assert (cache.lookup(a), cache.lookup(b), cache.lookup(c)) == (80, 0, 80)


def test_a_prompt_larger_than_the_cache_keeps_its_head() -> None:
    cache = cost.PrefixCache(4)
    cache.insert(list(range(161)))
    assert cache.lookup(list(range(161))) == 64


def test_no_capacity_no_cache() -> None:
    cache = cost.PrefixCache(0)
    cache.insert(list(range(64)))
    assert cache.lookup(list(range(64))) == 0
    assert (cache.queries, cache.hits) == (0, 0)


_BLOCKS = st.lists(st.integers(0, 2), max_size=5)  # prompts built from 3 distinct blocks


def _prompt(blocks: list[int], tail: int) -> list[int]:
    return [t for b in blocks for t in [b] * cost.BLOCK_TOKENS] + [7] * tail


@given(
    st.lists(st.tuples(_BLOCKS, st.integers(0, 20)), max_size=6),
    st.tuples(_BLOCKS, st.integers(0, 20)),
    st.integers(1, 40),
)
def test_the_hit_is_the_longest_cached_run_of_leading_blocks(
    seen: list[tuple[list[int], int]], query: tuple[list[int], int], capacity: int
) -> None:
    """With room for everything, a lookup finds the longest common prefix with any prompt
    computed before, in whole blocks, short of the last token; with less room, no more."""
    big, small = cost.PrefixCache(1000), cost.PrefixCache(capacity)
    prompts = [_prompt(*p) for p in seen]
    for p in prompts:
        big.insert(p)
        small.insert(p)
        assert len(small.blocks) <= capacity
    q = _prompt(*query)
    expected = 0
    for p in prompts:
        common = 0
        for x, y in zip(q[: len(q) - 1], p, strict=False):
            if x != y:
                break
            common += 1
        expected = max(expected, common - common % cost.BLOCK_TOKENS)
    assert big.lookup(q) == expected
    assert small.lookup(q) <= expected
    assert (big.queries, big.hits) == (len(q), expected)


# ---- the command line ------------------------------------------------------------------


def test_the_options_default_to_off() -> None:
    args = build_parser().parse_args(["fake-engine", "--port", "0"])
    config = FakeEngineConfig(**cost.config_fields(args))
    assert config == FakeEngineConfig()
    assert not config.cost_model


def test_the_options_reach_the_config() -> None:
    argv = ["fake-engine", "--port", "0", "--slots", "4", "--prefill-ms-per-token", "0.5"]
    argv += ["--prefix-cache-blocks", "1024", "--slowdown", "2", "--kv-ms-per-block", "0.25"]
    argv += ["--prefill-interference", "0.5", "--kv-pull-ms", "5", "--decode-batch-growth", "0.1"]
    argv += ["--prefill-slots", "2", "--kv-blocks", "8192"]
    config = FakeEngineConfig(**cost.config_fields(build_parser().parse_args(argv)))
    assert (config.decode_batch_growth, config.prefill_slots, config.kv_blocks) == (0.1, 2, 8192)
    assert config.transfer_delay_s == 0.005
    assert (config.slots, config.prefill_ms_per_token) == (4, 0.5)
    assert (config.prefix_cache_blocks, config.slowdown) == (1024, 2.0)
    assert (config.kv_ms_per_block, config.prefill_interference) == (0.25, 0.5)
    assert config.cost_model


@pytest.mark.parametrize(
    "option", ["--kv-ms-per-block", "--prefill-interference", "--decode-batch-growth"]
)
def test_either_consumer_cost_alone_turns_the_cost_model_on(option: str) -> None:
    argv = ["fake-engine", "--port", "0", option, "1"]
    assert FakeEngineConfig(**cost.config_fields(build_parser().parse_args(argv))).cost_model


@pytest.mark.parametrize(
    "option",
    [
        ["--slots", "-1"],
        ["--slowdown", "0"],
        ["--prefill-ms-per-token", "-2"],
        ["--kv-ms-per-block", "-1"],
        ["--prefill-interference", "nan"],
        ["--decode-batch-growth", "-0.5"],
        ["--prefill-slots", "-1"],
        ["--kv-blocks", "0"],
    ],
)
def test_negative_costs_are_refused(option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["fake-engine", "--port", "0", *option])
    assert exc.value.code == 2
    assert "must be" in capsys.readouterr().err
