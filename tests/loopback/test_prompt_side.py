"""Prompt-side fields come from the prefill leg (contract 3, "Completeness"; contract 4.1): the
producer computed the prompt, the consumer only pulled its KV. ``prompt_logprobs`` asked
by a non-streaming client are served from the prefill response, where vLLM puts them (a
completion choice's ``prompt_logprobs``, a chat response's top-level one)."""

from __future__ import annotations

from narwhal.fake_engine import generation as gen
from tests.support.fleet import MODEL, Harness, finish

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


def test_an_echo_is_the_producers_prompt_before_the_consumers_tokens() -> None:
    """Shaped on vLLM 0.32's echo (tests/captures/shapes/completion_echo_logprobs.json):
    the producer answered the prompt and one token; its offsets count ``<s>``."""
    import msgspec

    from narwhal.core.connector import PrefillResult
    from narwhal.stream.assemble import Assembler

    prefill_logprobs = {
        "tokens": ["<s>", "The", " fox", " jumps"],
        "token_logprobs": [None, -1.0, -2.0, -3.0],
        "top_logprobs": [None, {"The": -1.0}, {" fox": -2.0}, {" jumps": -3.0}],
        "text_offset": [0, 3, 6, 10],
    }
    prefill = PrefillResult(
        producer_url="http://p",
        endpoint="/v1/completions",
        request_id="r-a1-prefill",
        connector="NixlConnector",
        descriptor=msgspec.Raw(b"{}"),
        prompt_logprobs=msgspec.Raw(b'[null, {"1": {"logprob": -1.0}}, {"2": {"logprob": -2.0}}]'),
        text="The fox jumps",
        logprobs=msgspec.Raw(msgspec.json.encode(prefill_logprobs)),
    )
    asked = {"prompt": "The fox", "echo": True, "logprobs": 1}
    assembler = Assembler(chat=False, model="m")
    assembler.prompt_side(prefill, asked)
    generated = {
        "tokens": [" jumps", " high"],
        "token_logprobs": [-3.0, -4.0],
        "top_logprobs": [{" jumps": -3.0}, {" high": -4.0}],
        "text_offset": [0, 6],
    }
    chunk = {
        "id": "c",
        "created": 1,
        "choices": [
            {"index": 0, "text": " jumps high", "logprobs": generated, "finish_reason": "length"}
        ],
    }
    assembler.add(msgspec.json.encode(chunk))
    [choice] = msgspec.json.decode(assembler.body())["choices"]
    assert choice["text"] == "The fox jumps high"
    assert choice["logprobs"]["tokens"] == ["<s>", "The", " fox", " jumps", " high"]
    assert choice["logprobs"]["text_offset"] == [0, 3, 6, 10, 16]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -3.0, -4.0]
    assert choice["prompt_logprobs"][0] is None


def test_a_streamed_echo_puts_the_prompt_in_the_first_chunk() -> None:
    """vLLM streams an echo as the prompt and the first token in one chunk, offsets of
    every later chunk continued (tests/captures/shapes/completion_echo_logprobs.sse)."""
    import msgspec

    from narwhal.stream.assemble import Echo

    echo = Echo("The fox", {"tokens": ["<s>", "The", " fox"], "text_offset": [0, 3, 6]}, 10, True)

    def frame(text: str, offset: int) -> bytes:
        logprobs = {
            "tokens": [text],
            "token_logprobs": [-1.0],
            "top_logprobs": [None],
            "text_offset": [offset],
        }
        chunk = {"choices": [{"index": 0, "text": text, "logprobs": logprobs}]}
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    first = msgspec.json.decode(echo.stream(frame(" jumps", 0))[6:])["choices"][0]
    assert first["text"] == "The fox jumps"
    assert first["logprobs"]["tokens"] == ["<s>", "The", " fox", " jumps"]
    assert first["logprobs"]["text_offset"] == [0, 3, 6, 10]
    later = msgspec.json.decode(echo.stream(frame(" high", 6))[6:])["choices"][0]
    assert later["text"] == " high"
    assert later["logprobs"]["text_offset"] == [16]
    assert echo.stream(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
