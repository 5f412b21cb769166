"""The success path over real loopback sockets: router + fake producer and consumer."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from narwhal.fake_engine.generation import generate
from tests.support.fleet import MODEL, Harness, finish, start_fleet

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about narwhals."}]


def _requests(engine: Any) -> list[dict[str, Any]]:
    return list(engine.log)


def _text(events: list[bytes], chat: bool) -> str:
    out = []
    for payload in events:
        if payload == b"[DONE]":
            continue
        chunk = msgspec.json.decode(payload)
        for choice in chunk["choices"]:
            out.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return "".join(out)


async def test_streaming_completion(pd: Harness) -> None:
    reply = await pd.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "stream": True}
    )
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert len(reply.headers["x-request-id"]) == 16
    events = reply.events()
    assert events[-1] == b"[DONE]"
    assert _text(events, chat=False) == generate(PROMPT, 12)


async def test_streaming_chat_keeps_role_delta_and_usage(pd: Harness) -> None:
    reply = await pd.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert reply.status == 200
    chunks = [msgspec.json.decode(e) for e in reply.events()[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_non_streaming_completion_is_assembled_from_a_streamed_decode(pd: Harness) -> None:
    reply = await pd.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 7})
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == generate(PROMPT, 7)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 7
    decode_body = _requests(pd.engines["d0"])[-1]["body"]
    assert decode_body["stream"] is True  # the router always streams from the engine


async def test_non_streaming_chat(pd: Harness) -> None:
    reply = await pd.post(
        "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    )
    assert reply.status == 200
    body = reply.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == generate(MESSAGES[0]["content"], 4)
    assert body["usage"]["prompt_tokens"] > 0


async def test_prefill_body_shape(pd: Harness) -> None:
    reply = await pd.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
            "min_tokens": 2,
            "n": 1,
            "best_of": 1,
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "custom_field": [1],
        },
    )
    assert reply.status == 200
    rid = reply.headers["x-request-id"]
    (prefill,) = _requests(pd.engines["p0"])
    assert prefill["request_id"] == f"{rid}-a1-prefill"
    body = prefill["body"]
    assert body["max_tokens"] == 1
    assert body["stream"] is False
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    for removed in ("stream_options", "min_tokens", "n", "best_of", "max_completion_tokens"):
        assert removed not in body
    # sampling fields and unknown fields pass through unchanged
    assert body["temperature"] == 0.5
    assert body["top_p"] == 0.9
    assert body["custom_field"] == [1]
    assert body["messages"] == MESSAGES


async def test_decode_carries_the_descriptor_verbatim_and_the_producer_released_it(
    pd: Harness,
) -> None:
    reply = await pd.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    )
    rid = reply.headers["x-request-id"]
    producer, consumer = pd.engines["p0"], pd.engines["d0"]
    (decode,) = _requests(consumer)
    assert decode["request_id"] == f"{rid}-a1-decode"
    descriptor = decode["body"]["kv_transfer_params"]
    # the descriptor the producer issued, field for field, in vLLM's shape
    assert descriptor["remote_engine_id"] == producer.engine_id
    assert (
        descriptor["remote_request_id"]
        == f"cmpl-{rid}-a1-prefill-0-" + descriptor["remote_request_id"].rsplit("-", 1)[1]
    )
    assert descriptor["remote_port"] == producer.kv_port
    assert isinstance(descriptor["remote_block_ids"][0], list)
    assert decode["body"]["prompt"] == PROMPT
    assert decode["body"]["max_tokens"] == 3
    assert producer.store.events[-1] == {
        "event": "kv_released",
        "request_id": descriptor["remote_request_id"],
        "consumer": consumer.engine_id,
    }
    assert producer.stats()["kv_leases_active"] == 0
    assert consumer.counters["kv_pull_ok"] == 1
    assert consumer.counters["kv_pull_failed"] == 0


@pytest.mark.parametrize("echo", [False, True])
async def test_one_engine_in_both_roles_is_sent_no_transfer_params_to_decode(
    nursery: trio.Nursery, echo: bool
) -> None:
    # alone, it serves the request in one leg; an echo needs the prefill leg, and then
    # neither leg carries a descriptor
    harness = await start_fleet(nursery, {"solo": "both"})
    reply = await harness.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
            "echo": echo,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"},
        },
    )
    assert reply.status == 200
    legs = _requests(harness.engines["solo"])
    if echo:  # the prefill leg asks for no descriptor: its producer decodes too
        prefill, decode = legs
        assert "kv_transfer_params" not in prefill["body"]
    else:
        (decode,) = legs
    assert "kv_transfer_params" not in decode["body"]
    assert _text(reply.events(), chat=False) == (PROMPT if echo else "") + generate(PROMPT, 4)
    await finish(harness)


@pytest.mark.parametrize(
    "forged",
    [
        {
            "do_remote_prefill": True,
            "remote_engine_id": "evil",
            "remote_block_ids": [[1]],
            "remote_host": "10.0.0.1",
            "remote_port": 1,
        },
        {"do_remote_decode": False},
        None,
        "string",
    ],
)
async def test_client_kv_transfer_params_never_reach_an_engine(pd: Harness, forged: Any) -> None:
    for stream in (True, False):
        reply = await pd.post(
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 2,
                "stream": stream,
                "kv_transfer_params": forged,
            },
        )
        assert reply.status == 200
    producer, consumer = pd.engines["p0"], pd.engines["d0"]
    for entry in _requests(producer):
        assert entry["body"]["kv_transfer_params"] == {"do_remote_decode": True}
    for entry in _requests(consumer):
        assert entry["body"]["kv_transfer_params"]["remote_engine_id"] == producer.engine_id
    assert consumer.counters["kv_pull_failed"] == 0


async def test_models_health_ready_engines(pd: Harness) -> None:
    models = (await pd.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert (await pd.get("/health")).json() == {"status": "ok"}
    assert (await pd.get("/ready")).status == 200
    engines = (await pd.get("/narwhal/engines")).json()["engines"]
    assert [(e["id"], e["role"]) for e in engines] == [("p0", "prefill"), ("d0", "decode")]
    assert engines[0]["inflight"] == {"prefill": 0, "decode": 0}
    assert engines[0]["breaker"]["state"] == "closed"


@pytest.mark.parametrize(
    ("body", "status", "start"),
    [
        (b"{not json", 400, "body: not valid JSON"),
        (b"[1, 2]", 400, "body: must be a JSON object"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens:"),
        ({"model": MODEL}, 400, "prompt:"),
        ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream:"),
        ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n: 17 completions"),
        ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of: 3 is not served"),
        (
            {"model": MODEL, "prompt": "x", "vllm_xargs": {"kv_transfer_params": {}}},
            400,
            "vllm_xargs.kv_transfer_params",
        ),
        ({"model": "other", "prompt": "x"}, 404, "model 'other' is not served here"),
    ],
)
async def test_bad_requests_are_rejected_before_any_engine(
    pd: Harness, body: Any, status: int, start: str
) -> None:
    reply = await pd.post("/v1/completions", body)
    assert reply.status == status
    error = reply.json()["error"]
    assert error["message"].startswith(start)
    assert error["code"] == status
    assert "x-request-id" in reply.headers
    assert not _requests(pd.engines["p0"])


async def test_body_over_the_limit_is_413(pd: Harness) -> None:
    limit = pd.router.config.serving.max_request_bytes
    reply = await pd.post("/v1/completions", {"model": MODEL, "prompt": "x" * limit})
    assert reply.status == 413
    assert reply.json()["error"]["code"] == 413
    assert not _requests(pd.engines["p0"])


async def test_engine_client_error_passes_through(pd: Harness) -> None:
    reply = await pd.post(
        "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 10**6}
    )
    # the one-token prefill passes; the consumer refuses the output limit, as vLLM does
    assert reply.status == 400
    assert reply.json()["error"]["message"].startswith("max_tokens=1000000 cannot be greater")


async def test_unknown_paths_are_404_and_reach_no_engine(pd: Harness) -> None:
    for path in ("/invocations", "/v1/embeddings"):  # /tokenize is served (contract 3)
        assert (await pd.post(path, {"model": MODEL})).status == 404
    assert not _requests(pd.engines["p0"])


async def test_engine_connections_are_kept_alive(pd: Harness) -> None:
    for stream in (True, False, True, False):
        reply = await pd.post(
            "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": stream}
        )
        assert reply.status == 200
    # one data connection per engine serves every leg: [DONE] is followed by the end of the
    # body, which the router reads so the connection goes back to the pool (the active
    # health checks keep one connection of their own)
    opened = {url: n for url, (n, _) in pd.router.client.connections().items()}
    assert opened == {pd.router.fleet.by_id[e].url: 1 for e in ("p0", "d0")}
    assert pd.engines["p0"].counters["connections"] == 2
    assert pd.engines["d0"].counters["connections"] == 2


async def test_json_bombs_are_400_not_500(pd: Harness) -> None:
    deep = (
        b'{"model": "fake-model", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    reply = await pd.post("/v1/completions", deep)
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "body: JSON nested too deeply"
    huge = b'{"model": "fake-model", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    assert (await pd.post("/v1/completions", huge)).status == 400
    assert not _requests(pd.engines["p0"])
