"""Stream resume (contract 6.4) over loopback: a consumer that fails after output costs the
client nothing. The continuation is prefilled and decoded on other engines from the
prompt's ids and the ids already sent; the client reads one stream, judged from its bytes.

Fleet: one producer (p0) and two consumers (d0, d1). On a fresh fleet the first request's
decode goes to d1 (the rotation after the producer's turn); each test checks that in the
journal, so a change of placement fails here rather than passing vacuously.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from narwhal.core.config import EngineConfig, PlacementConfig, RecoveryConfig, ServingConfig
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, RawReply, finish, post_raw, start_fleet

PROMPT = "a narwhal swims north under the ice"
ROLES = {"p0": "prefill", "d0": "decode", "d1": "decode"}
FIRST = "d1"  # the consumer a fresh fleet's first request decodes on
ASKED = 24


async def _fleet(nursery: trio.Nursery, roles: dict[str, str] = ROLES, resume: int = 1) -> Harness:
    return await start_fleet(
        nursery,
        roles,
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=20.0),
        engine=EngineConfig(first_token_timeout_s=2.0, decode_read_timeout_s=0.3),
        recovery=RecoveryConfig(resume_streams=resume),
    )


def _body(chat: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": ASKED, "stream": True, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
        return "/v1/chat/completions", body
    body["prompt"] = PROMPT
    return "/v1/completions", body


def _expected(body: dict[str, Any], chat: bool) -> str:
    return gen.generate(gen.prompt_of(body, chat)[0], ASKED)


def _read(reply: RawReply, chat: bool) -> tuple[str, list[dict[str, Any]]]:
    """The client's text and chunks, asserting one whole stream: [DONE] last, no error
    event, the body ended."""
    events = reply.events()
    assert reply.status == 200
    assert events[-1] == b"[DONE]", events[-3:]
    assert reply.ended
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c]
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
    return text, chunks


async def _line(h: Harness) -> Any:
    await h.router.wait_drained()
    return h.router.journal.lines[-1]


def _resumes(h: Harness, outcome: str) -> float:
    value = h.router.metrics.registry.get_sample_value
    return value("narwhal_stream_resumes_total", {"outcome": outcome}) or 0.0


BREAKS = {
    "closed": Fault(kind="tokens_then_close", tokens=5, leg="decode"),
    "silent": Fault(kind="tokens_then_silence", tokens=5, leg="decode"),
    "in-stream 5xx": Fault(kind="stream_error", tokens=5, code=500, leg="decode"),
}


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("why", list(BREAKS))
async def test_a_stream_broken_after_output_goes_on_elsewhere(
    nursery: trio.Nursery, why: str, chat: bool
) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS[why])
    path, body = _body(chat, stream_options={"include_usage": True})
    reply = await post_raw(h, path, body)
    text, chunks = _read(reply, chat)
    assert text == _expected(body, chat)  # no token repeated or missing
    rid = reply.headers["x-request-id"]
    # one stream: every chunk the client's own id and model; no ids it did not ask for
    assert {(c["id"], c["model"]) for c in chunks} == {(chunks[0]["id"], MODEL)}
    assert all(choice.get("token_ids") is None for c in chunks for choice in c["choices"])
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    prompt_tokens = gen.prompt_of(body, chat)[1]
    assert usage == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + ASKED,
        "completion_tokens": ASKED,
    }
    line = await _line(h)
    assert (line.outcome, line.status, line.tokens) == ("completed", 200, ASKED)
    first, second = line.attempts
    assert (first.consumer, first.resume, first.resumed_at_token) == (FIRST, "resumed", None)
    assert (second.consumer, second.resumed_at_token, second.handoff_fate) == ("d0", 5, "decoded")
    assert f"{rid}-a2-prefill" in [e["request_id"] for e in h.engines["p0"].log]
    assert _resumes(h, "resumed") == _resumes(h, "completed") == 1
    await finish(h)


async def test_a_client_that_asked_for_token_ids_gets_every_one(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    path, body = _body(False, return_token_ids=True)
    reply = await post_raw(h, path, body)
    text, chunks = _read(reply, chat=False)
    assert text == _expected(body, False)
    ids = [i for c in chunks for choice in c["choices"] for i in choice.get("token_ids") or []]
    assert len(ids) == ASKED
    assert [gen.VOCAB[i - 100] for i in ids] == [gen.VOCAB[i] for i in gen.token_ids(PROMPT, ASKED)]
    await finish(h)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_a_non_streaming_answer_is_the_same_as_if_nothing_failed(
    nursery: trio.Nursery, chat: bool
) -> None:
    h = await _fleet(nursery)
    path, body = _body(chat, stream=False)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    broken = (await h.post(path, body)).json()
    whole = (await h.post(path, body)).json()
    assert [a.resume for a in h.router.journal.lines[0].attempts] == ["resumed", None]
    for answer in (broken, whole):
        del answer["id"], answer["created"]
    assert broken == whole
    await finish(h)


def _choices(reply: RawReply) -> dict[int, str]:
    events = reply.events()
    assert events[-1] == b"[DONE]"
    by_index: dict[int, str] = {}
    for event in events[:-1]:
        for choice in msgspec.json.decode(event)["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    return by_index


async def test_fan_out_children_resume_one_by_one(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    h.engines["d0"].faults.push(BREAKS["closed"])  # both children break, each once
    path, body = _body(False, n=2, seed=7, temperature=0.8)
    broken = _choices(await post_raw(h, path, body))
    line = await _line(h)
    assert (line.outcome, line.tokens) == ("completed", 2 * ASKED)
    resumed = [a for a in line.attempts if a.resumed_at_token is not None]
    assert sorted(a.fanout_index for a in resumed) == [0, 1]
    # the fake engine continues a seeded sample's script (vLLM does not promise to)
    assert broken == _choices(await post_raw(h, path, body))
    await finish(h)


REFUSED = {
    "tool calls": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    "guided decoding": {"response_format": {"type": "json_object"}},
    "logprobs": {"logprobs": True},
}


@pytest.mark.parametrize("why", list(REFUSED))
async def test_what_cannot_continue_ends_with_the_terminal_event(
    nursery: trio.Nursery, why: str
) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    path, body = _body(True, **REFUSED[why])
    reply = await post_raw(h, path, body)
    assert b'"error"' in reply.events()[-1]
    assert not reply.ended  # the body cut after the terminal event, as without resume
    line = await _line(h)
    assert (line.outcome, line.status) == ("failed", 502)
    [attempt] = line.attempts
    assert attempt.resume == why
    assert _resumes(h, "refused") == 1
    await finish(h)


async def test_an_echo_is_not_resumed(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    reply = await post_raw(h, *_body(False, echo=True))
    assert b'"error"' in reply.events()[-1]
    assert [a.resume for a in (await _line(h)).attempts] == ["echo"]
    await finish(h)


async def test_with_no_other_consumer_the_stream_ends_as_today(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery, {"p0": "prefill", "d0": "decode"})
    h.engines["d0"].faults.push(BREAKS["closed"])
    reply = await post_raw(h, *_body(False))
    assert b'"error"' in reply.events()[-1]
    assert [a.resume for a in (await _line(h)).attempts] == ["no other consumer"]
    await finish(h)


async def test_a_continuation_that_fails_too_ends_with_one_terminal_event(
    nursery: trio.Nursery,
) -> None:
    """resume_streams = 1: the second failure is told as without resume, once."""
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    h.engines["d0"].faults.push(Fault(kind="tokens_then_close", tokens=3, leg="decode"))
    reply = await post_raw(h, *_body(False))
    events = reply.events()
    assert sum(b'"error"' in e for e in events) == 1
    assert b'"error"' in events[-1]
    text = "".join(msgspec.json.decode(e)["choices"][0]["text"] for e in events[:-1])
    assert text == gen.generate(PROMPT, 8)  # 5 tokens, then 3 of the continuation
    line = await _line(h)
    assert [a.resume for a in line.attempts] == ["resumed", "resumes spent"]
    assert _resumes(h, "failed") == 1
    await finish(h)


async def test_resume_off_is_the_terminal_event(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery, resume=0)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    reply = await post_raw(h, *_body(False))
    assert b'"error"' in reply.events()[-1]
    events = reply.events()
    # the decode leg was not asked for token ids: nothing changed on the wire
    assert all(b'"token_ids":null' in e for e in events[:-1])
    assert "return_token_ids" not in h.engines[FIRST].log[-1]["body"]
    assert [a.resume for a in (await _line(h)).attempts] == [None]
    await finish(h)


async def test_a_stream_its_consumer_served_alone_goes_on_in_a_disaggregated_continuation(
    nursery: trio.Nursery,
) -> None:
    """Decode first: a short prompt is served by its consumer alone (no prefill leg, its
    prompt ids from its own stream); its continuation has a producer and a handoff."""
    h = await start_fleet(
        nursery,
        ROLES,
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=20.0),
        recovery=RecoveryConfig(resume_streams=1),
        placement=PlacementConfig(local_prefill_tokens=128, metrics_interval_s=0.0),
    )
    h.engines["d0"].faults.push(BREAKS["closed"])  # decode first: d0 takes a fresh fleet's first
    path, body = _body(True)
    text, _ = _read(await post_raw(h, path, body), chat=True)
    assert text == _expected(body, True)
    first, second = (await _line(h)).attempts
    assert (first.local, first.producer, first.resume) == (True, None, "resumed")
    assert (second.local, second.producer, second.resumed_at_token) == (False, "p0", 5)
    assert (first.consumer, second.consumer) == ("d0", "d1")
    await finish(h)


async def test_after_a_retry_the_continuation_speaks_as_the_attempt_the_client_saw(
    nursery: trio.Nursery,
) -> None:
    """A retry before output, then a resume: the client's stream is the retry's (its id on
    every chunk), not the attempt that failed silently before it."""
    h = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"},
        serving=ServingConfig(
            graceful_timeout_s=0.5, request_timeout_s=20.0, max_attempts=2, retry_backoff_s=0.01
        ),
        engine=EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
        recovery=RecoveryConfig(resume_streams=1),
        # round robin, so that the order is known: d1 first, the retry on d2, then d0
        placement=PlacementConfig(policy="round_robin", prefix_affinity=False),
    )
    h.engines["d1"].faults.push(Fault(kind="metadata_then_silence", leg="decode"))
    h.engines["d2"].faults.push(BREAKS["closed"])
    path, body = _body(True)
    reply = await post_raw(h, path, body)
    text, chunks = _read(reply, chat=True)
    assert text == _expected(body, True)
    rid = reply.headers["x-request-id"]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{rid}-a2-decode"}
    attempts = (await _line(h)).attempts
    assert [(a.consumer, a.retry, a.resume) for a in attempts] == [
        ("d1", "retry", None),
        ("d2", None, "resumed"),
        ("d0", None, None),
    ]
    await finish(h)


async def test_continuous_usage_counts_on_across_the_resume(nursery: trio.Nursery) -> None:
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    options = {"include_usage": True, "continuous_usage_stats": True}
    path, body = _body(False, stream_options=options)
    text, chunks = _read(await post_raw(h, path, body), chat=False)
    assert text == _expected(body, False)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == list(range(1, ASKED + 1))
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {gen.prompt_of(body, False)[1]}
    await finish(h)


def _sse(chunk: dict[str, Any]) -> list[Any]:
    return ["write", b"data: " + msgspec.json.encode(chunk) + b"\n\n"]


async def test_a_stream_that_broke_after_its_finish_is_not_continued(
    nursery: trio.Nursery,
) -> None:
    """The choice had its finish reason: a continuation would generate past the end."""
    h = await _fleet(nursery)
    head = {"id": "cmpl-x", "object": "text_completion", "created": 1, "model": MODEL}
    first = {"index": 0, "text": " a", "prompt_token_ids": [1, 2], "token_ids": [101]}
    last = {"index": 0, "text": " b", "token_ids": [102], "finish_reason": "stop"}
    steps = [
        ["headers", None],
        _sse({**head, "choices": [first]}),
        _sse({**head, "choices": [last]}),
        ["close", None],
    ]
    h.engines[FIRST].faults.push(Fault(kind="script", value=steps, leg="decode"))
    reply = await post_raw(h, *_body(False))
    assert b'"error"' in reply.events()[-1]  # the terminal event, as without resume
    assert [a.resume for a in (await _line(h)).attempts] == ["stream finished"]
    await finish(h)


async def test_a_completion_without_a_limit_keeps_the_default_one(nursery: trio.Nursery) -> None:
    """No max_tokens: a completion's default limit (16) holds across the resume."""
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    path, body = _body(False, stream_options={"include_usage": True})
    del body["max_tokens"]
    text, chunks = _read(await post_raw(h, path, body), chat=False)
    assert text == gen.generate(PROMPT, 16)
    [usage] = [c["usage"] for c in chunks if c.get("usage")]
    assert usage["completion_tokens"] == 16
    await finish(h)


async def test_a_chat_without_a_limit_goes_on_to_the_context_end(nursery: trio.Nursery) -> None:
    """Its limit is the context's end: the continuation's is the consumer's context length
    less its prompt (from /v1/models), and the text ends where the unbroken one does."""
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    path, body = _body(True)
    del body["max_tokens"]
    text, _ = _read(await post_raw(h, path, body), chat=True)
    assert text == gen.generate(gen.prompt_of(body, True)[0], 16)  # the fake's default
    continued = h.engines["d0"].log[-1]["body"]
    assert len(continued["prompt"]) + continued["max_tokens"] == 32768  # its max_model_len
    assert (await _line(h)).tokens == 16
    await finish(h)


async def test_stop_strings_the_engine_holds_text_back_for_are_not_continued(
    nursery: trio.Nursery,
) -> None:
    """vLLM holds back the text of a stop string's length less one while it reports the
    tokens' ids: what it held would be lost, so the stream ends as without resume."""
    h = await _fleet(nursery)
    h.engines[FIRST].faults.push(BREAKS["closed"])
    reply = await post_raw(h, *_body(False, stop=["@@never"]))
    assert b'"error"' in reply.events()[-1]
    assert [a.resume for a in (await _line(h)).attempts] == ["stop strings"]
    h.engines[FIRST].faults.push(BREAKS["closed"])  # one character holds nothing back
    path, body = _body(False, stop=["@"])
    text, _ = _read(await post_raw(h, path, body), chat=False)
    assert text == _expected(body, False)
    await finish(h)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
async def test_ids_whose_text_was_held_back_are_generated_again(
    nursery: trio.Nursery, chat: bool
) -> None:
    """The engine holds a token's text back (an incomplete character: its ids come with no
    text) and fails: the continuation starts before it, and its text is not lost."""
    h = await start_fleet(
        nursery,
        ROLES,
        engine_config={"chunk_tokens": (1, 0)},  # every second token's text waits
        serving=ServingConfig(graceful_timeout_s=0.5, request_timeout_s=20.0),
        recovery=RecoveryConfig(resume_streams=1),
    )
    h.engines[FIRST].faults.push(Fault(kind="tokens_then_close", tokens=4, leg="decode"))
    path, body = _body(chat)
    text, _ = _read(await post_raw(h, path, body), chat)
    assert text == _expected(body, chat)
    first, second = (await _line(h)).attempts
    assert first.resume == "resumed"
    assert second.resumed_at_token == 3  # the fourth token's text had not come
    await finish(h)
