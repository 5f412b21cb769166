"""An echo with ``return_token_ids`` carries the prompt's token ids, as vLLM does locally.

The prompt is computed by the producer only, so its ids come from the prefill leg. A
stranger compares what the router answers with what one engine answers on its own.
"""

from __future__ import annotations

from typing import Any

import httpcore
import msgspec
import pytest
import trio

from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, finish, start_fleet

BODY = {
    "model": MODEL,
    "prompt": "The quick brown fox jumps over the lazy dog",
    "max_tokens": 3,
    "echo": True,
    "return_token_ids": True,
}


async def _alone(url: str, body: dict[str, Any]) -> bytes:
    """The same request to one engine, as a client of a lone vLLM would send it."""
    async with httpcore.AsyncConnectionPool() as http:
        reply = await http.request(
            "POST", url + "/v1/completions", content=msgspec.json.encode(body)
        )
        assert reply.status == 200
        return reply.content


def _first_choice(raw: bytes) -> dict[str, Any]:
    choice: dict[str, Any] = msgspec.json.decode(SSEParser().feed(raw)[0])["choices"][0]
    return choice


@pytest.mark.parametrize("logprobs", [None, 1])
async def test_a_streamed_echo_first_chunk_carries_the_prompt_token_ids(
    nursery: trio.Nursery, logprobs: int | None
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    body = {**BODY, "stream": True, "logprobs": logprobs}
    reply = await harness.post("/v1/completions", body)
    assert reply.status == 200
    local = _first_choice(await _alone(harness.engines["d0"].url, body))
    routed = _first_choice(reply.body)
    assert isinstance(local["prompt_token_ids"], list)
    assert local["prompt_token_ids"]
    assert routed["prompt_token_ids"] == local["prompt_token_ids"]
    assert routed["text"].startswith(BODY["prompt"])
    await harness.router.wait_drained()
    (prefill,) = harness.engines["p0"].log
    assert prefill["body"]["return_token_ids"] is True  # the producer was asked for them
    await finish(harness)


async def test_a_non_streamed_echo_carries_them_too(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    body = {**BODY, "stream": False}
    reply = await harness.post("/v1/completions", body)
    assert reply.status == 200
    local = msgspec.json.decode(await _alone(harness.engines["d0"].url, body))["choices"][0]
    routed = reply.json()["choices"][0]
    assert routed["prompt_token_ids"] == local["prompt_token_ids"]
    assert routed["text"] == local["text"]
    await finish(harness)


async def test_without_return_token_ids_nothing_changes(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    body = {**BODY, "stream": False, "return_token_ids": False}
    reply = await harness.post("/v1/completions", body)
    assert reply.json()["choices"][0]["prompt_token_ids"] is None
    await finish(harness)


@pytest.mark.parametrize("chat", [False, True])
async def test_a_non_streamed_answer_without_echo_carries_them(
    nursery: trio.Nursery, chat: bool
) -> None:
    """The decode leg streams them in its first chunk only (later chunks say null): the
    assembled answer keeps the ids, as a lone engine's answer has them."""
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "return_token_ids": True}
    if chat:
        body["messages"] = [{"role": "user", "content": BODY["prompt"]}]
    else:
        body["prompt"] = BODY["prompt"]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    reply = await harness.post(path, body)
    assert reply.status == 200
    async with httpcore.AsyncConnectionPool() as http:
        alone = await http.request(
            "POST", harness.engines["d0"].url + path, content=msgspec.json.encode(body)
        )
    local, routed = msgspec.json.decode(alone.content), reply.json()
    if not chat:
        local, routed = local["choices"][0], routed["choices"][0]
    assert isinstance(local["prompt_token_ids"], list)
    assert routed["prompt_token_ids"] == local["prompt_token_ids"]
    await finish(harness)
