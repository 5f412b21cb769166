"""Token counts (journal ``tokens``, ``narwhal_generation_tokens_total``) are the engines' own.

vLLM does not send one token per chunk: under load a chunk carries several, and a token
whose text is held back goes out with empty text. The fake engine streams that way here
(``chunk_tokens``); a stranger's clients talk to the router over loopback, and the counts
are held against what the consumer itself says it generated (its ``/metrics``, its log).
"""

from __future__ import annotations

import re
from typing import Any

import httpcore
import msgspec
import trio

from tests.support.fleet import MODEL, Harness, finish, start_fleet

TOKENS = 32
PATTERN = (1, 3, 0, 2, 5)  # tokens per chunk, in turn; 0: its text waits for the next chunk


def _counter(text: bytes, name: str) -> float:
    match = re.search(rb"^" + re.escape(name.encode()) + rb"\{[^}]*\} (\S+)$", text, re.M)
    assert match is not None, name
    return float(match.group(1))


async def _scrape(url: str) -> bytes:
    async with httpcore.AsyncConnectionPool() as http:
        return (await http.request("GET", url + "/metrics")).content


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    completion = {"model": MODEL, "prompt": "count the tokens", "max_tokens": TOKENS}
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count the tokens"}],
        "max_tokens": TOKENS,
    }
    usage = {"stream_options": {"include_usage": True}}
    return [
        ("/v1/completions", {**completion, "stream": True}),
        ("/v1/completions", {**completion, "stream": True, **usage}),
        ("/v1/completions", {**completion, "stream": False}),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/chat/completions", {**chat, "stream": True, **usage}),
        ("/v1/chat/completions", {**chat, "stream": False}),
    ]


async def _fleet(nursery: trio.Nursery) -> Harness:
    return await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"chunk_tokens": PATTERN}
    )


async def test_counts_are_the_engines_own_when_chunks_carry_several_tokens_or_none(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    rounds = 4
    chunk_counts = []
    for _ in range(rounds):
        for path, body in _bodies():
            reply = await harness.post(path, body)
            assert reply.status == 200, reply.body
            if body["stream"]:
                chunks = [msgspec.json.decode(e) for e in reply.events()[:-1]]
                chunk_counts.append(sum(1 for c in chunks if c["choices"]))
    await harness.router.wait_drained()
    assert max(chunk_counts) < TOKENS  # the wire carried fewer chunks than tokens

    requests = rounds * len(_bodies())
    decode_legs = {e["request_id"]: e for e in harness.engines["d0"].log}
    assert len(decode_legs) == requests
    for line in harness.router.journal.lines:
        entry = decode_legs[f"{line.request_id}-a1-decode"]
        assert line.tokens == entry["tokens"] == TOKENS
    engine_count = _counter(
        await _scrape(harness.engines["d0"].url), "vllm:generation_tokens_total"
    )
    router_count = _counter(await _scrape(harness.url), "narwhal_generation_tokens_total")
    assert router_count == engine_count == requests * TOKENS
    await finish(harness)


async def test_a_client_that_did_not_ask_for_usage_never_sees_the_usage_chunk(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    for path, body in _bodies():
        if not body["stream"]:
            continue
        reply = await harness.post(path, body)
        events = reply.events()
        assert events[-1] == b"[DONE]"
        chunks = [msgspec.json.decode(e) for e in events[:-1]]
        usage = [c for c in chunks if not c["choices"]]
        asked = "stream_options" in body
        if asked:  # exactly vLLM's: one usage chunk, the last before [DONE]
            assert len(usage) == 1
            assert chunks[-1] is usage[0]
            assert usage[0]["usage"]["completion_tokens"] == TOKENS
        else:
            assert usage == []
            assert all(c.get("usage") is None for c in chunks)
    await harness.router.wait_drained()
    # the router asked every decode leg for the engine's count
    for entry in harness.engines["d0"].log:
        assert entry["body"]["stream_options"] == {"include_usage": True}
    await finish(harness)


async def test_continuous_usage_stats_never_reach_a_client_that_did_not_ask_for_usage(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    body = {
        "model": MODEL,
        "prompt": "count the tokens",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},  # without include_usage: none
    }
    reply = await harness.post("/v1/completions", body)
    chunks = [msgspec.json.decode(e) for e in reply.events()[:-1]]
    assert chunks
    assert all(c["choices"] and c.get("usage") is None for c in chunks)
    await harness.router.wait_drained()
    assert harness.router.journal.lines[-1].tokens == 4
    await finish(harness)


async def test_grouped_chunks_carry_the_same_text(nursery: trio.Nursery) -> None:
    """The multi-token stream is the same answer: the router's assembled text (from the
    decode leg's grouped chunks) is what the engine answers alone, non-streamed."""
    harness = await _fleet(nursery)
    body = {"model": MODEL, "prompt": "count the tokens", "max_tokens": TOKENS}
    reply = await harness.post("/v1/completions", body)
    async with httpcore.AsyncConnectionPool() as http:
        alone = await http.request(
            "POST", harness.engines["d0"].url + "/v1/completions", content=msgspec.json.encode(body)
        )
    expected = msgspec.json.decode(alone.content)["choices"][0]["text"]
    assert reply.json()["choices"][0]["text"] == expected
    assert reply.json()["usage"]["completion_tokens"] == TOKENS
    await finish(harness)
