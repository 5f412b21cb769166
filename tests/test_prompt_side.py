"""Prompt-side fields come from the prefill leg (SPEC 3, "Completeness"; SPEC 4.1): the
producer computed the prompt, the consumer only pulled its KV. ``prompt_logprobs`` asked
by a non-streaming client are served from the prefill response, where vLLM puts them (a
completion choice's ``prompt_logprobs``, a chat response's top-level one)."""

from __future__ import annotations

from narwhal.fake_engine import generation as gen
from tests.conftest import MODEL, Harness, finish

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_prompt_logprobs_come_from_the_prefill_leg(pd: Harness) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "prompt_logprobs": 2}
    reply = await pd.post("/v1/completions", body)
    assert reply.status == 200, reply.body[:300]
    [choice] = reply.json()["choices"]
    assert choice["prompt_logprobs"] == gen.prompt_logprobs(PROMPT, 2)
    [prefill] = pd.engines["p0"].log
    [decode] = pd.engines["d0"].log
    assert prefill["body"]["prompt_logprobs"] == 2
    assert "prompt_logprobs" not in decode["body"]  # vLLM refuses them on a stream
    await finish(pd)


async def test_chat_prompt_logprobs_are_top_level(pd: Harness) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    reply = await pd.post("/v1/chat/completions", body)
    assert reply.status == 200, reply.body[:300]
    answer = reply.json()
    prompt = gen.prompt_of(body, True)[0]
    assert answer["prompt_logprobs"] == gen.prompt_logprobs(prompt, 0)
    await finish(pd)


async def test_without_the_ask_there_are_none(pd: Harness) -> None:
    reply = await pd.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert reply.json()["choices"][0]["prompt_logprobs"] is None
    await finish(pd)
