"""The official ``openai`` client, sync and async, through the router, unchanged."""

from __future__ import annotations

import openai
import pytest
import trio

from narwhal.fake_engine.generation import generate
from tests.support.fleet import MODEL, Harness

PROMPT = "A narwhal swims north under the ice"
MESSAGES = [{"role": "user", "content": PROMPT}]


def _sync_calls(url: str) -> dict[str, object]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)
    try:
        out: dict[str, object] = {}
        out["completion"] = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
        out["completion_stream"] = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=6, stream=True
            )
            if c.choices
        )
        out["chat"] = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        out["chat_stream_usage"] = chunks[-1].usage
        out["models"] = [m.id for m in client.models.list()]
        return out
    finally:
        client.close()


async def test_sync_openai_client(pd: Harness) -> None:
    out = await trio.to_thread.run_sync(_sync_calls, pd.url)
    completion = out["completion"]
    assert isinstance(completion, openai.types.Completion)
    assert completion.choices[0].text == generate(PROMPT, 6)
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6
    assert out["completion_stream"] == generate(PROMPT, 6)
    chat = out["chat"]
    assert isinstance(chat, openai.types.chat.ChatCompletion)
    assert chat.choices[0].message.content == generate(PROMPT, 5)
    assert out["chat_stream"] == generate(PROMPT, 5)
    usage = out["chat_stream_usage"]
    assert usage is not None
    assert usage.completion_tokens == 5  # type: ignore[attr-defined]
    assert out["models"] == [MODEL]


async def test_async_openai_client(pd: Harness) -> None:
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
    try:
        completion = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert completion.choices[0].text == generate(PROMPT, 4)
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            stream=True,  # type: ignore[arg-type]
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == generate(PROMPT, 4)
    finally:
        await client.close()


async def test_openai_client_sees_status_errors(pd: Harness) -> None:
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError, match="is not served here"):
            await client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="best_of: 2 is not served"):
            await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, best_of=2)
    finally:
        await client.close()
