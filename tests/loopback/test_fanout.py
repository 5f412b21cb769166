"""Fan-out (contract 3): ``n > 1`` and a list of prompts run as independent prefill/decode
requests, one merged response with OpenAI's choice order (prompt-major, then ``n``)."""

from __future__ import annotations

from typing import Any

import msgspec
import openai
import trio
import trio.testing

from narwhal.core.config import ServingConfig
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, post_raw, start_fleet

PROMPTS = ["The quick brown fox jumps", "Once upon a time there was"]


def expected(prompt: str, max_tokens: int) -> str:
    return gen.generate(gen.prompt_of({"prompt": prompt}, False)[0], max_tokens)


def texts_of(events: list[bytes]) -> dict[int, str]:
    """Streamed completion text per choice index."""
    out: dict[int, str] = {}
    for event in events:
        if event == b"[DONE]":
            continue
        for choice in msgspec.json.decode(event).get("choices") or []:
            out[choice["index"]] = out.get(choice["index"], "") + (choice.get("text") or "")
    return out


def backend_ids(h: Harness) -> list[str]:
    return sorted(e["request_id"] for eng in h.engines.values() for e in eng.log)


async def test_n_completions_come_back_as_n_choices(pd: Harness) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "n": 3}
    reply = await pd.post("/v1/completions", body)
    assert reply.status == 200, reply.body[:300]
    answer = reply.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == expected(PROMPTS[0], 5) for c in answer["choices"])
    usage = answer["usage"]
    assert usage["completion_tokens"] == 15
    assert usage["prompt_tokens"] == gen.prompt_of({"prompt": PROMPTS[0]}, False)[1]  # once
    rid = reply.headers["x-request-id"]
    assert backend_ids(pd) == sorted(
        f"{rid}-p0-n{j}-a1-{leg}" for j in range(3) for leg in ("prefill", "decode")
    )
    await pd.router.wait_drained()
    [line] = pd.router.journal.lines
    assert sorted(a.fanout_index for a in line.attempts) == [0, 1, 2]
    assert line.tokens == 15
    await finish(pd)


async def test_a_prompt_list_streams_prompt_major_then_n(pd: Harness) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS,
        "max_tokens": 4,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply = await pd.post("/v1/completions", body)
    assert reply.status == 200
    events = reply.events()
    assert events[-1] == b"[DONE]"
    assert texts_of(events) == {k: expected(PROMPTS[k // 2], 4) for k in range(4)}
    usage_chunks = [
        msgspec.json.decode(e) for e in events[:-1] if "usage" in msgspec.json.decode(e)
    ]
    usage = [u["usage"] for u in usage_chunks if u.get("usage")]
    assert len(usage) == 1  # one usage chunk for the whole response, at the end
    assert usage[0]["completion_tokens"] == 16
    # shaped as vLLM's own usage chunk (a child's), not as a token chunk
    keys = ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
    assert list(usage_chunks[-1]) == keys
    await finish(pd)


async def test_chat_n_streams_a_role_delta_per_choice(pd: Harness) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
    }
    reply = await pd.post("/v1/chat/completions", body)
    chunks = [msgspec.json.decode(e) for e in reply.events()[:-1]]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    content: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            content[choice["index"]] = content.get(choice["index"], "") + (
                choice["delta"].get("content") or ""
            )
    assert content[0] == content[1] != ""
    reply = await pd.post("/v1/chat/completions", {**body, "stream": False})
    answer = reply.json()
    assert [c["message"]["content"] for c in answer["choices"]] == [content[0], content[1]]
    await finish(pd)


async def test_more_than_max_fanout_is_a_400_naming_the_field(nursery: trio.Nursery) -> None:
    serving = ServingConfig(graceful_timeout_s=0.5, max_fanout=4)
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=serving)
    for field, extra in (("n", {"n": 5}), ("prompt", {"prompt": ["a", "b", "c"], "n": 2})):
        body: dict[str, Any] = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
        reply = await h.post("/v1/completions", body)
        assert reply.status == 400
        assert reply.json()["error"]["message"].startswith(f"{field}: ")
        assert "max_fanout=4" in reply.json()["error"]["message"]
    reply = await h.post("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2})
    assert reply.status == 400
    assert not any(e.log for e in h.engines.values())
    await finish(h)


async def test_one_failing_child_fails_the_request_before_the_commit_point(pd: Harness) -> None:
    pd.engines["d0"].faults.push(Fault(kind="status", status=500, leg="decode"))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "n": 3}
    reply = await pd.post("/v1/completions", body)
    assert reply.status == 502
    await pd.router.wait_drained()
    [line] = pd.router.journal.lines
    assert (line.outcome, line.status) == ("failed", 502)
    await finish(pd)


async def test_a_child_failing_after_the_commit_point_ends_the_stream_with_one_event(
    nursery: trio.Nursery,
) -> None:
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.01})
    h.engines["d0"].faults.push(Fault(kind="tokens_then_close", tokens=3, leg="decode"))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 30, "n": 2, "stream": True}
    reply = await post_raw(h, "/v1/completions", body)
    assert reply.status == 200
    assert not reply.ended  # cut after the terminal event (contract 6)
    events = reply.events()
    assert events[-1] != b"[DONE]"
    errors = [e for e in events if b'"error"' in e]
    assert len(errors) == 1
    assert events[-1] == errors[0]
    assert msgspec.json.decode(errors[0])["error"]["code"] == 502
    await finish(h)


async def test_a_client_leaving_cancels_every_child(nursery: trio.Nursery) -> None:
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.05})
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "n": 3, "stream": True}
    async with h.http.stream(
        "POST", h.url + "/v1/completions", content=msgspec.json.encode(body)
    ) as resp:
        assert resp.status == 200
        await resp.aiter_stream().__anext__()
    with trio.fail_after(5):
        await h.router.wait_drained()
    decodes = [e for e in h.engines["d0"].log if e["request_id"].endswith("-decode")]
    assert len(decodes) == 3
    await trio.testing.wait_all_tasks_blocked(cushion=0.05)  # the engine sees them go
    assert all(e["end"] is not None for e in decodes)
    assert all(e["tokens"] < 200 for e in decodes)
    [line] = h.router.journal.lines
    assert line.outcome == "cancelled"
    await finish(h, disconnects=1)


async def test_the_openai_client_reads_n_choices(pd: Harness) -> None:
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0)
    async with client:
        answer = await client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=3, n=2)
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text for c in answer.choices] == [expected(PROMPTS[k // 2], 3) for k in range(4)]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=3,
            n=3,
            stream=True,
        )
        seen: set[int] = set()
        async for chunk in stream:
            seen |= {c.index for c in chunk.choices}
        assert seen == {0, 1, 2}
    await finish(pd)


def test_n_seeded_samples_are_n_different_seeds() -> None:
    from narwhal.core.requests import parse_request

    raw = msgspec.json.encode({"model": MODEL, "prompt": "x", "n": 3, "seed": 7})
    subs = parse_request(raw, endpoint="/v1/completions", model=MODEL).split()
    assert [sub.body["seed"] for _, _, sub in subs] == [7, 8, 9]
