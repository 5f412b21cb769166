"""The fake engine serving a base model and LoRA adapters, over HTTP as vLLM does: the model
list, the 404 for a name it does not serve, an adapter's own text, adapter slots (swaps,
their cost, requests waiting for a slot) and ``vllm:lora_requests_info``, the prefix cache
and KV events per adapter, and a KV handoff refused across models. Engines run on the
in-memory network under trio's MockClock (exact virtual time), the KV events on loopback."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from narwhal.fake_engine.kv_events import BlockStored
from tests.support.kv_events import kv_engine, subscriber
from tests.support.memory_engine import (
    MODEL,
    MS,
    alone,
    attach,
    call,
    descriptor,
    metric,
    scrape,
    timed,
    words,
)
from tests.support.memory_network import MemoryNetwork
from tests.support.paths import CAPTURES

MODELS = (MODEL, "sql:" + MODEL, "chat:" + MODEL)
WAIT_S = 60.0  # virtual seconds: every wait on the engine is bounded by this


def _body(model: str, prompt: str = "once upon a time", tokens: int = 8, **fields: Any) -> Any:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, **fields}


async def _text(net: MemoryNetwork, host: str, model: str, **fields: Any) -> tuple[str, str]:
    """A completion's text and the model its answer names."""
    status, content = await call(net, host, "POST", "/v1/completions", _body(model, **fields))
    assert status == 200, content
    reply = msgspec.json.decode(content)
    return reply["choices"][0]["text"], reply["model"]


async def _stats(net: MemoryNetwork, host: str) -> Any:
    status, content = await call(net, host, "GET", "/fake/stats")
    assert status == 200
    return msgspec.json.decode(content)


def _lora_series(metrics: dict[str, float]) -> list[tuple[str, float]]:
    """``vllm:lora_requests_info``'s label sets (as written) and values, newest last."""
    series = [(k, v) for k, v in metrics.items() if k.startswith("vllm:lora_requests_info{")]
    return sorted(series, key=lambda s: s[1])


def _labels(running: str, waiting: str, max_lora: int = 1) -> str:
    labels = f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
    return f'vllm:lora_requests_info{{max_lora="{max_lora}",{labels}}}'


# ---- what it serves ----------------------------------------------------------------------


async def test_the_model_list_has_the_base_then_each_adapter_with_its_parent(
    nursery: trio.Nursery,
) -> None:
    engine, net = alone(nursery, models=MODELS)
    status, content = await call(net, "e0", "GET", "/v1/models")
    assert status == 200
    listed = msgspec.json.decode(content)
    assert listed["object"] == "list"
    cards = listed["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (MODEL, None, MODEL),
        ("sql", MODEL, "sql"),
        ("chat", MODEL, "chat"),
    ]
    for card in cards:
        assert list(card) == [
            "id",
            "object",
            "created",
            "owned_by",
            "root",
            "parent",
            "max_model_len",
            "permission",
        ]
        assert (card["object"], card["owned_by"]) == ("model", "vllm")
        assert card["created"] == int(engine.start_time)
        [permission] = card["permission"]
        assert permission["object"] == "model_permission"
    # as vLLM: an adapter's card leaves the context length to its parent's
    assert [c["max_model_len"] for c in cards] == [engine.config.max_model_len, None, None]


async def test_model_alone_serves_it_as_before(nursery: trio.Nursery) -> None:
    engine, net = alone(nursery)
    _, content = await call(net, "e0", "GET", "/v1/models")
    [card] = msgspec.json.decode(content)["data"]
    assert (card["id"], card["parent"], card["root"]) == (MODEL, None, MODEL)
    status, text = await call(net, "e0", "GET", "/metrics")
    assert status == 200
    assert b"lora_requests_info" not in text  # as vLLM without --enable-lora
    assert "lora_swaps" not in await _stats(net, "e0")
    assert engine.catalog.adapters == ()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/tokenize", {"prompt": "hi"}),
    ],
)
async def test_a_name_it_does_not_serve_is_vllms_404_byte_for_byte(
    nursery: trio.Nursery, path: str, body: dict[str, Any]
) -> None:
    _, net = alone(nursery, models=MODELS)
    captured = (CAPTURES / "err_model.txt").read_bytes().splitlines()
    assert captured[1] == b"HTTP 404"
    status, content = await call(net, "e0", "POST", path, {"model": "nope", **body})
    assert (status, content) == (404, captured[0])
    assert msgspec.json.decode(content) == {
        "error": {
            "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    status, _ = await call(net, "e0", "POST", path, {"model": "sql", **body})
    assert status == 200


async def test_an_adapter_says_its_own_text_the_base_says_what_it_always_said(
    nursery: trio.Nursery,
) -> None:
    net = MemoryNetwork(nursery)
    attach(net, "lora", models=MODELS, max_loras=2)
    attach(net, "plain")
    base, named = await _text(net, "lora", MODEL)
    assert (base, named) == await _text(net, "plain", MODEL)  # unchanged by the adapters
    sql, named = await _text(net, "lora", "sql")
    assert named == "sql"  # the answer names the adapter, as vLLM's does
    chat, _ = await _text(net, "lora", "chat")
    assert len({base, sql, chat}) == 3
    assert (sql, "sql") == await _text(net, "lora", "sql")  # deterministic
    # a stream says the same, and names the adapter in every chunk
    body = _body("sql", stream=True)
    status, content = await call(net, "lora", "POST", "/v1/completions", body)
    assert status == 200
    chunks = [
        msgspec.json.decode(line[6:])
        for line in content.split(b"\n")
        if line.startswith(b"data: {")
    ]
    assert {c["model"] for c in chunks} == {"sql"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == sql


# ---- adapter slots -----------------------------------------------------------------------


async def test_adapters_that_fit_are_loaded_once_one_too_many_swaps_each_time(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net = MemoryNetwork(nursery)
    attach(net, "two", models=MODELS, max_loras=2, lora_swap_ms=500)
    attach(net, "one", models=MODELS, max_loras=1, lora_swap_ms=500)
    took = [await timed(net, "two", _body(m)) for m in ("sql", "chat", "sql", "chat", MODEL)]
    assert took == [0.5, 0.5, 0.0, 0.0, 0.0]  # a load costs its time, the base needs none
    stats = await _stats(net, "two")
    assert (stats["lora_swaps"], stats["lora_loads"]) == (0, {"sql": 1, "chat": 1})
    assert stats["loaded"] == ["sql", "chat"]
    took = [await timed(net, "one", _body(m)) for m in ("sql", "chat", "sql", MODEL, "sql")]
    assert took == [0.5, 0.5, 0.5, 0.0, 0.0]
    stats = await _stats(net, "one")
    assert (stats["lora_swaps"], stats["lora_loads"]) == (2, {"sql": 2, "chat": 1})
    assert (stats["max_loras"], stats["loaded"]) == (1, ["sql"])
    assert stats["counters"]["lora_swaps"] == 2


async def test_with_every_slot_running_a_request_for_another_adapter_waits_and_shows(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    engine, net = alone(nursery, models=MODELS, itl_s=1.0)  # max_loras 1, as vLLM's default
    done: dict[str, float] = {}

    async def client(name: str, model: str) -> None:
        await timed(net, "e0", _body(model, f"prompt {name}", 5, stream=True))  # 4 s of tokens
        done[name] = trio.current_time()

    async with trio.open_nursery() as clients:
        clients.start_soon(client, "a", "sql")
        with trio.fail_after(WAIT_S):
            await engine.wait_running(1)
        clients.start_soon(client, "b", "chat")
        with trio.fail_after(WAIT_S):
            await engine.wait_queued(1)
        clients.start_soon(client, "c", "sql")  # sql is loaded: it runs at once
        clients.start_soon(client, "d", MODEL)  # the base needs no slot
        with trio.fail_after(WAIT_S):
            await engine.wait_running(4)
        metrics = await scrape(net, "e0")
        assert metrics[metric("num_requests_waiting")] == 1
        assert metrics[metric("num_requests_running")] == 3
        assert _lora_series(metrics)[-1][0] == _labels("sql", "chat")
    assert done == {"a": 4.0, "c": 4.0, "d": 4.0, "b": 8.0}
    series = _lora_series(await scrape(net, "e0"))
    assert series[-1][0] == _labels("", "")  # the newest is the current state
    assert {_labels("sql", "chat"), _labels("chat", "")} <= {name for name, _ in series}
    assert (await _stats(net, "e0"))["lora_swaps"] == 1


async def test_a_client_that_leaves_while_waiting_for_a_slot_leaves_the_queue(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    engine, net = alone(nursery, models=MODELS, itl_s=1.0)
    async with trio.open_nursery() as clients:
        clients.start_soon(timed, net, "e0", _body("sql", tokens=5, stream=True))
        with trio.fail_after(WAIT_S):
            await engine.wait_running(1)
        async with trio.open_nursery() as leaving:
            body = _body("chat", stream=True)
            leaving.start_soon(call, net, "e0", "POST", "/v1/completions", body)
            with trio.fail_after(WAIT_S):
                await engine.wait_queued(1)
            assert _lora_series(await scrape(net, "e0"))[-1][0] == _labels("sql", "chat")
            leaving.cancel_scope.cancel()  # the client leaves
    with trio.fail_after(WAIT_S):
        await engine.wait_idle()
    # had it stayed in the queue it would have swapped sql out once sql's stream ended
    assert engine.adapter_slots.waiting == {}
    assert engine.waiting == 0
    assert _lora_series(await scrape(net, "e0"))[-1][0] == _labels("", "")
    assert (await _stats(net, "e0"))["lora_swaps"] == 0


# ---- the prefix cache, KV events and the KV handoff ---------------------------------------


async def test_the_prefix_cache_never_hits_across_adapters(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    # 32 tokens: two blocks, of which a hit covers the first (the last token is computed)
    _, net = alone(
        nursery,
        models=MODELS,
        max_loras=2,
        lora_swap_ms=250,
        prefix_cache_blocks=64,
        prefill_ms_per_token=MS,
    )
    prompt = words("w", 32)
    took = [await timed(net, "e0", _body(m, prompt, 1)) for m in ("sql", "sql", MODEL, "chat")]
    assert took == [2.25, 1.0, 2.0, 2.25]  # an adapter's first request loads it
    took = [await timed(net, "e0", _body(m, prompt, 1)) for m in (MODEL, "chat")]
    assert took == [1.0, 1.0]


async def test_kv_events_name_the_adapter_blocks_were_computed_under(
    nursery: trio.Nursery,
) -> None:
    async with (
        kv_engine(nursery, models=MODELS, max_loras=2) as e,
        subscriber(nursery, e.engine) as sub,
    ):
        prompt = words("k", 32)
        for model in ("chat", "sql", MODEL):
            status, _ = await e.call("POST", "/v1/completions", _body(model, prompt, 1))
            assert status == 200
        tagged = []
        for _ in range(3):
            [stored] = [ev for ev in (await sub.next()).batch() if isinstance(ev, BlockStored)]
            tagged.append((stored.lora_id, stored.lora_name, stored.parent_block_hash))
        # the same tokens are new blocks under each: adapter ids as vLLM numbers them
        assert tagged == [(2, "chat", None), (1, "sql", None), (None, None, None)]


async def test_kv_is_never_handed_across_models_the_same_model_pulls_it(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net = MemoryNetwork(nursery)
    producer = attach(net, "p0", role="prefill", models=MODELS, max_loras=2)
    consumer = attach(net, "d0", role="decode", models=MODELS, max_loras=2)
    prompt = words("h", 20)
    prefill = _body("sql", prompt, 1, stream=False, kv_transfer_params={"do_remote_decode": True})
    params = await descriptor(net, "p0", prefill)
    assert "model" not in params  # a descriptor names no model, as vLLM's

    async def decode(model: str, stream: bool) -> tuple[int, bytes]:
        body = _body(model, prompt, 4, stream=stream, kv_transfer_params=params)
        return await call(net, "d0", "POST", "/v1/completions", body)

    status, content = await decode("chat", stream=True)
    assert status == 200
    assert b'"type": "InternalServerError"' in content  # vLLM's in-stream error
    assert content.endswith(b"data: [DONE]\n\n")
    assert await decode(MODEL, stream=False) == (
        500,
        b'{"error":{"message":"Internal server error","type":"InternalServerError",'
        b'"param":null,"code":500}}',
    )
    assert consumer.counters["kv_pull_failed_wrong_model"] == 2
    assert producer.counters["kv_pull_refused_wrong_model"] == 2
    status, content = await decode("sql", stream=False)  # the lease was kept for it
    assert status == 200
    handed = msgspec.json.decode(content)["choices"][0]["text"]
    assert handed == (await _text(net, "d0", "sql", prompt=prompt, tokens=4))[0]
    assert consumer.counters["kv_pull_ok"] == 1
