"""The fake engine against real vLLM 0.32 captures, and its KV lease rules."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import msgspec
import pytest
import trio
import trio.testing

from narwhal.core import resume
from narwhal.fake_engine import answers, asks
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.fake_engine.kv_channel import KVStore, PullRequest
from narwhal.fake_engine.samples import samples
from narwhal.stream.sse import SSEParser
from tests.support.paths import CAPTURES
from tests.support.token_streams import read_sse

MODEL = "tiny"


class Engine:
    def __init__(self, engine: FakeEngine, http: httpcore.AsyncConnectionPool) -> None:
        self.engine = engine
        self.http = http

    async def call(
        self, method: str, path: str, body: Any = None, rid: str = ""
    ) -> tuple[int, bytes]:
        headers = [("content-type", "application/json")]
        if rid:
            headers.append(("x-request-id", rid))
        content = None if body is None else msgspec.json.encode(body)
        resp = await self.http.request(
            method, self.engine.url + path, headers=headers, content=content
        )
        return resp.status, resp.content


@pytest.fixture
async def engines(nursery: trio.Nursery) -> AsyncIterator[tuple[Engine, Engine]]:
    http = httpcore.AsyncConnectionPool()
    pair = []
    for role in ("prefill", "decode"):
        engine = FakeEngine(FakeEngineConfig(model=MODEL, role=role))  # type: ignore[arg-type]
        await nursery.start(engine.serve)
        pair.append(Engine(engine, http))
    yield pair[0], pair[1]
    await http.aclose()


def _keys(obj: Any) -> Any:
    """The shape of a JSON value: keys in order, recursively (values ignored)."""
    if isinstance(obj, dict):
        return [(k, _keys(v)) for k, v in obj.items()]
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        return [_keys(obj[0])]
    return None


def _capture_json(name: str) -> Any:
    return msgspec.json.decode((CAPTURES / name).read_bytes())


def _capture_events(name: str) -> list[Any]:
    raw = (CAPTURES / name).read_bytes()
    body = raw.split(b"\r\n\r\n", 1)[-1] if raw.startswith(b"HTTP/") else raw
    return [msgspec.json.decode(e) for e in SSEParser().feed(body) if e != b"[DONE]"]


PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


async def _prefill(producer: Engine, rid: str = "pdtest-1", chat: bool = False) -> Any:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    status, raw = await producer.call(
        "POST", "/v1/chat/completions" if chat else "/v1/completions", body, rid
    )
    assert status == 200
    return msgspec.json.decode(raw)


async def test_prefill_response_matches_vllm_field_for_field(
    engines: tuple[Engine, Engine],
) -> None:
    producer, _ = engines
    response = await _prefill(producer)
    assert _keys(response) == _keys(_capture_json("pd_prefill_response.json"))
    descriptor = response["kv_transfer_params"]
    assert descriptor["remote_engine_id"] == producer.engine.engine_id
    assert descriptor["remote_request_id"].startswith("cmpl-pdtest-1-0-")
    assert descriptor["remote_port"] == producer.engine.kv_port
    assert descriptor["transfer_mode"] == "pull"
    assert producer.engine.stats()["kv_leases_active"] == 1


async def test_chat_prefill_matches_vllm(engines: tuple[Engine, Engine]) -> None:
    producer, _ = engines
    response = await _prefill(producer, "chat-1", chat=True)
    capture = (CAPTURES / "edge_chat.txt").read_text().splitlines()
    real = msgspec.json.decode(next(line for line in capture if line.startswith('{"id":"chatcmpl')))
    assert _keys(response) == _keys(real)
    assert response["kv_transfer_params"]["remote_request_id"].startswith("chatcmpl-chat-1-")


async def test_non_streaming_and_streaming_shapes(engines: tuple[Engine, Engine]) -> None:
    _, consumer = engines
    status, raw = await consumer.call(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8}
    )
    assert status == 200
    assert _keys(msgspec.json.decode(raw)) == _keys(_capture_json("single_nonstream.json"))
    status, raw = await consumer.call(
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = SSEParser().feed(raw)
    assert events[-1] == b"[DONE]"
    ours = [msgspec.json.decode(e) for e in events[:-1]]
    real = _capture_events("single_stream_usage.txt")
    assert [_keys(c) for c in ours] == [_keys(c) for c in real]


async def test_chat_stream_shapes(engines: tuple[Engine, Engine]) -> None:
    _, consumer = engines
    _, raw = await consumer.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    ours = [msgspec.json.decode(e) for e in SSEParser().feed(raw)[:-1]]
    real = _capture_events("single_chat_stream.txt")
    assert [_keys(c) for c in ours] == [_keys(c) for c in real]
    assert ours[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


async def test_error_bodies_match_vllm(engines: tuple[Engine, Engine]) -> None:
    _, consumer = engines
    status, raw = await consumer.call("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    real = msgspec.json.decode((CAPTURES / "err_model.txt").read_text().splitlines()[0])
    assert status == 404
    assert msgspec.json.decode(raw) == {
        **real,
        "error": {
            **real["error"],
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
        },
    }
    status, raw = await consumer.call(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}
    )
    real = msgspec.json.decode((CAPTURES / "err_maxtokens.txt").read_text().splitlines()[0])
    assert status == 400
    assert _keys(msgspec.json.decode(raw)) == _keys(real)
    # a prompt over the model's length, as the tiny model (512) answered make e2e-vllm
    engine = consumer.engine
    engine.config = msgspec.structs.replace(engine.config, max_model_len=512)
    body = {"model": MODEL, "prompt": "fox " * 600, "max_tokens": 4}
    status, raw = await consumer.call("POST", "/v1/completions", body)
    real = msgspec.json.decode((CAPTURES / "err_context_length.json").read_bytes())
    assert (status, msgspec.json.decode(raw)) == (400, real)


async def _decode(consumer: Engine, descriptor: Any, stream: bool = True) -> tuple[int, bytes]:
    return await consumer.call(
        "POST",
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": stream,
            "kv_transfer_params": descriptor,
        },
    )


async def test_a_descriptor_is_pulled_once(engines: tuple[Engine, Engine]) -> None:
    producer, consumer = engines
    descriptor = (await _prefill(producer))["kv_transfer_params"]
    status, raw = await _decode(consumer, descriptor)
    assert status == 200
    assert SSEParser().feed(raw)[-1] == b"[DONE]"
    assert consumer.engine.counters["kv_pull_ok"] == 1
    # used twice: the producer already released the blocks; the stream fails like vLLM's
    status, raw = await _decode(consumer, descriptor)
    events = SSEParser().feed(raw)
    assert status == 200
    assert msgspec.json.decode(events[0])["error"]["code"] == 500
    assert events[-1] == b"[DONE]"
    assert consumer.engine.counters["kv_pull_failed_reused"] == 1
    assert producer.engine.counters["kv_pull_refused_reused"] == 1
    status, _ = await _decode(consumer, descriptor, stream=False)
    assert status == 500


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"remote_request_id": "cmpl-never-issued-0-00000000"}, "unknown"),
        ({"remote_block_ids": [[9999]]}, "forged"),
        ({"remote_engine_id": "someone-else"}, "wrong_engine"),
        ({"remote_port": 1}, "unreachable"),
        ({"remote_host": None}, "incomplete"),
    ],
)
async def test_bad_descriptors_fail_on_the_consumer(
    engines: tuple[Engine, Engine], change: dict[str, Any], reason: str
) -> None:
    producer, consumer = engines
    descriptor = {**(await _prefill(producer))["kv_transfer_params"], **change}
    status, raw = await _decode(consumer, descriptor)
    assert status == 200
    assert b'"code": 500' in raw
    assert consumer.engine.counters[f"kv_pull_failed_{reason}"] == 1
    assert consumer.engine.counters["kv_pull_ok"] == 0


def test_leases_expire() -> None:
    clock = trio.testing.MockClock()

    async def scenario() -> None:
        counters: Counter[str] = Counter()
        store = KVStore("e", lease_s=30.0, counters=counters)
        lease = store.issue("r1", prompt_tokens=40)
        assert lease.block_ids == [[1, 2, 3]]
        clock.jump(30.5)
        reply = store.pull(PullRequest("e", "r1", [[1, 2, 3]], "c"))
        assert (reply.ok, reply.reason) == (False, "expired")
        assert counters["kv_leases_expired"] == 1

    trio.run(scenario, clock=clock)


async def test_operational_endpoints(engines: tuple[Engine, Engine]) -> None:
    producer, _ = engines
    assert await producer.call("GET", "/health") == (200, b"")
    assert msgspec.json.decode((await producer.call("GET", "/version"))[1]) == {"version": "0.32.0"}
    models = msgspec.json.decode((await producer.call("GET", "/v1/models"))[1])
    assert models["data"][0]["id"] == MODEL
    metrics = (await producer.call("GET", "/metrics"))[1].decode()
    assert "process_start_time_seconds " in metrics
    stats = msgspec.json.decode((await producer.call("GET", "/fake/stats"))[1])
    assert stats["engine_id"] == producer.engine.engine_id


async def test_scripted_faults_over_http(engines: tuple[Engine, Engine]) -> None:
    producer, _ = engines
    status, _ = await producer.call(
        "POST", "/fake/faults", [{"kind": "status", "leg": "prefill", "status": 503}]
    )
    assert status == 200
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert (await producer.call("POST", "/v1/completions", body))[0] == 503
    assert (await producer.call("POST", "/v1/completions", body))[0] == 200
    status, _ = await producer.call("POST", "/fake/faults", [{"kind": "explode"}])
    assert status == 400


async def test_tokenize_and_token_ids_like_vllm(engines: tuple[Engine, Engine]) -> None:
    _, consumer = engines
    status, raw = await consumer.call("POST", "/tokenize", {"model": MODEL, "prompt": "a b c"})
    reply = msgspec.json.decode(raw)
    assert status == 200
    assert (reply["count"], len(reply["tokens"]), reply["max_model_len"]) == (3, 3, 32768)
    status, raw = await consumer.call(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True, "return_token_ids": True},
    )
    chunks = [msgspec.json.decode(e) for e in SSEParser().feed(raw)[:-1]]
    assert all(isinstance(c["choices"][0]["token_ids"], list) for c in chunks)


@pytest.mark.parametrize("chat", [False, True])
async def test_a_continuation_streams_the_rest_and_meets_faults_as_any_request(
    engines: tuple[Engine, Engine], chat: bool
) -> None:
    """What the router sends to resume a broken stream (the prompt's ids and the ids the
    client has, over /v1/completions) streams the rest of it; a fault scripted for that
    leg breaks it as it breaks any other."""
    _, consumer = engines
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 10, "temperature": 0, "stream": True}
    body.update(return_token_ids=True, stream_options={"include_usage": True})
    if chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    path = "/v1/chat/completions" if chat else "/v1/completions"
    whole = read_sse((await consumer.call("POST", path, body))[1])
    assert whole.prompt_ids == gen.prompt_ids(PROMPT)
    sent = whole.ids[:4]
    asked = resume.continuation(body, chat=chat, prompt_ids=whole.prompt_ids, sent_ids=sent)
    consumer.engine.faults.push(Fault(kind="stream_error", tokens=2))
    broken = read_sse((await consumer.call("POST", "/v1/completions", asked))[1])
    assert (broken.ids, broken.error is not None) == (whole.ids[4:6], True)
    rest = read_sse((await consumer.call("POST", "/v1/completions", asked))[1])
    assert rest.ids == whole.ids[4:]
    assert "".join(gen.VOCAB[i - gen.GENERATED_ID] for i in sent) + rest.text == whole.text
    assert rest.prompt_ids == whole.prompt_ids + sent


# ---- the richer shapes (tests/loopback/test_fake_differential.py: against the captures) ----


def _ask(body: dict[str, Any], chat: bool = False) -> asks.Ask:
    return asks.ask_of({"model": MODEL, **body}, chat, 16)


def _frames(plan: answers.StreamPlan) -> list[bytes]:
    frames = [*plan.head, *(f for f in plan.tokens if f is not None)]
    return frames + ([plan.tail] if plan.tail is not None else [])


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True}, {"seed": 3, "temperature": 1}])
def test_the_rich_path_writes_the_plain_paths_bytes(chat: bool, extra: dict[str, Any]) -> None:
    """A plain request built the general way gives the precomputed bytes exactly: the two
    paths cannot drift apart."""
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    )
    body = {**prompt, "max_tokens": 5, "stream_options": {"include_usage": True}, **extra}
    ask = _ask(body, chat)
    assert ask.plain
    shapes = gen.Shapes("cmpl-x", MODEL, chat)
    ids = gen.token_ids(ask.prompts[0].text, ask.max_tokens, ask.key(0))
    plain = answers.plain_plan(ask, shapes, ids, finished=True, prompt_tokens=ask.prompts[0].count)
    rich = answers.stream_plan(ask, shapes, samples(ask))
    assert _frames(rich) == _frames(plain)


def test_sample_j_of_n_is_the_single_sample_seeded_seed_plus_j() -> None:
    """What lets the router's fan-out (sub-request j seeded seed + j) equal a local n."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.7, "seed": 5}
    several = [s.text for s in samples(_ask({**body, "n": 3}))]
    alone = [samples(_ask({**body, "seed": 5 + j}))[0].text for j in range(3)]
    assert several == alone
    assert len(set(several)) == 3
    # greedy ignores the seed, as vLLM does; unseeded sampling still gives n samples
    assert _ask({**body, "temperature": 0}).key(0) is None
    unseeded = samples(_ask({"prompt": PROMPT, "max_tokens": 6, "n": 2}))
    assert unseeded[0].text == gen.generate(PROMPT, 6) != unseeded[1].text


def test_a_stop_string_across_tokens_cuts_the_text_and_the_stream_holds_it_back() -> None:
    words = [gen.VOCAB[i] for i in gen.token_ids(PROMPT, 8)]
    text = "".join(words)
    stop = words[2][-2:] + words[3][:2]  # over the third and fourth tokens
    assert text.index(stop) == len("".join(words[:3])) - 2  # found there first
    [sample] = samples(_ask({"prompt": PROMPT, "max_tokens": 8, "stop": ["zzz", stop]}))
    assert sample.text == text[: text.index(stop)]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
    assert "".join(sample.parts) == sample.text  # nothing streamed that the cut removed
    assert len(sample.tokens) == len(sample.parts) == 4  # the token that completed it counts


def _fold(plan: answers.StreamPlan, chat: bool) -> Any:
    from narwhal.stream.assemble import Assembler

    assembler = Assembler(chat=chat, model=MODEL)
    for frame in _frames(plan):
        assembler.add(frame)
    return msgspec.json.decode(assembler.body())


def test_a_forced_tool_call_streams_as_tool_call_deltas() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    messages = [{"role": "user", "content": PROMPT}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"messages": messages, "max_tokens": 30, "tools": tools, "tool_choice": choice}
        ask = _ask(body, chat=True)
        shapes = gen.Shapes("chatcmpl-x", MODEL, True)
        choices = samples(ask)
        [call] = _fold(answers.stream_plan(ask, shapes, choices), True)["choices"][0]["message"][
            "tool_calls"
        ]
        assert call["function"]["name"] == "get_weather"
        assert set(msgspec.json.decode(call["function"]["arguments"])) == {"city", "days"}
        assert call["id"].startswith("chatcmpl-tool-")
        # not streamed: the model's raw text, as vLLM 0.32 answers (the capture)
        full = msgspec.json.decode(answers.full(ask, shapes, choices, None))
        message = full["choices"][0]["message"]
        assert message["content"].startswith('<tool_call>\n{"name": "get_weather"')
        assert "tool_calls" not in message
        assert full["usage"]["completion_tokens"] == 30


def test_continuous_usage_counts_every_chunk() -> None:
    body = {
        "prompt": ["One two", "Three four five"],
        "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    ask = _ask(body)
    plan = answers.stream_plan(ask, gen.Shapes("cmpl-x", MODEL, False), samples(ask))
    chunks = [msgspec.json.decode(f) for f in _frames(plan)]
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        seen.setdefault(choice["index"], []).append(chunk["usage"]["completion_tokens"])
        assert chunk["usage"]["prompt_tokens"] == (2 if choice["index"] == 0 else 3)
    assert seen == {0: [1, 2, 3], 1: [1, 2, 3]}
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "total_tokens": 11, "completion_tokens": 6}


def test_an_echo_s_offsets_point_into_its_text() -> None:
    for logprobs in (0, 2, -1):
        body = {"prompt": PROMPT + "  ", "max_tokens": 4, "echo": True, "logprobs": logprobs}
        ask = _ask(body)
        shapes = gen.Shapes("cmpl-x", MODEL, False)
        [choice] = msgspec.json.decode(answers.full(ask, shapes, samples(ask), None))["choices"]
        lists = choice["logprobs"]
        assert choice["text"].startswith(PROMPT + "  ")
        assert "".join(lists["tokens"]) == choice["text"]
        for offset, token in zip(lists["text_offset"], lists["tokens"], strict=True):
            assert choice["text"][offset:].startswith(token)
        assert lists["token_logprobs"][0] is None
        assert len(choice["prompt_logprobs"]) == len(gen.prompt_pieces(PROMPT + "  "))
        streamed = _fold(answers.stream_plan(ask, shapes, samples(ask)), False)
        assert streamed["choices"][0]["text"] == choice["text"]
        assert streamed["choices"][0]["logprobs"] == lists


async def test_refusals_are_vllms(engines: tuple[Engine, Engine]) -> None:
    _, consumer = engines
    shapes = CAPTURES / "shapes"
    for name, suffix, stream in (
        ("completion_n2_greedy", "json", False),
        ("completion_prompt_logprobs", "sse", True),
    ):
        request = msgspec.json.decode((shapes / f"{name}.request.json").read_bytes())
        body = {**request["body"], "stream": stream}
        status, raw = await consumer.call("POST", "/v1/" + request["endpoint"], body)
        assert (status, msgspec.json.decode(raw)) == (400, _capture_json(f"shapes/{name}.{suffix}"))


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
async def test_a_body_nested_past_the_decoder_is_a_400_and_the_engine_lives_on(
    engines: tuple[Engine, Engine], path: str
) -> None:
    """The router passes ``/tokenize`` bodies through as they came: however deep one is,
    the engine answers it as vLLM would and serves the next request."""
    _, consumer = engines
    deep = b'{"model":"%s","prompt":' % MODEL.encode() + b"[" * 5000 + b"]" * 5000 + b"}"
    resp = await consumer.http.request(
        "POST",
        consumer.engine.url + path,
        headers=[("content-type", "application/json")],
        content=deep,
    )
    assert resp.status == 400
    status, _ = await consumer.call("POST", "/tokenize", {"model": MODEL, "prompt": "a"})
    assert status == 200
