"""Fake engines on the in-memory network, spoken to with h11: the cost model's tests, whose
every duration is exact virtual time under trio's MockClock (costs are powers of two, so
the sums are exact floats)."""

from __future__ import annotations

from typing import Any

import h11
import msgspec
import trio

from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from tests.support.memory_network import MemoryNetwork

MODEL = "tiny"
MS = 62.5  # per prompt token: 16 tokens (a block) take exactly one second


def alone(nursery: trio.Nursery, name: str = "e0", **fields: Any) -> tuple[FakeEngine, Any]:
    """One engine alone on a network of its own, served as ``name``."""
    net = MemoryNetwork(nursery)
    return attach(net, name, **fields), net


def attach(net: MemoryNetwork, name: str, **fields: Any) -> FakeEngine:
    """An engine of model ``MODEL`` served as ``name`` on ``net`` (a producer and a
    consumer share one network, so the consumer's pulls reach the producer)."""
    fake = FakeEngine(FakeEngineConfig(model=MODEL, **fields), network=net)
    fake.attach(name)
    return fake


async def call(
    net: MemoryNetwork, host: str, method: str, path: str, body: Any = None
) -> tuple[int, bytes]:
    """One HTTP/1.1 exchange on a fresh in-memory connection."""
    stream = await net.open_stream(host, 80)
    try:
        conn = h11.Connection(h11.CLIENT)
        data = b"" if body is None else msgspec.json.encode(body)
        headers = [("host", host), ("content-length", str(len(data))), ("connection", "close")]
        out = conn.send(h11.Request(method=method, target=path, headers=headers)) or b""
        if data:
            out += conn.send(h11.Data(data=data)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        status, parts = 0, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, b"".join(parts)
    finally:
        await stream.aclose()


def words(tag: str, count: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(count))


def prefill_body(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def stream_body(prompt: str, tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True}


def chat_body(messages: list[dict[str, Any]], tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": tokens, **fields}


async def timed(net: MemoryNetwork, host: str, body: dict[str, Any]) -> float:
    """How long a completion took (a stream to its ``[DONE]``)."""
    start = trio.current_time()
    status, content = await call(net, host, "POST", "/v1/completions", body)
    assert status == 200, content
    if body.get("stream"):
        assert content.endswith(b"data: [DONE]\n\n")
    return trio.current_time() - start


async def descriptor(net: MemoryNetwork, producer: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill leg (``body``, completions or chat)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, content = await call(net, producer, "POST", path, body)
    assert status == 200, content
    params: dict[str, Any] = msgspec.json.decode(content)["kv_transfer_params"]
    return params


def chat_content(sse: bytes) -> str:
    """What a chat client reads as the reply: the streamed deltas' content, concatenated
    (an error event carries none)."""
    assert sse.endswith(b"data: [DONE]\n\n"), sse[-200:]
    text = ""
    for line in sse.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in msgspec.json.decode(line[6:]).get("choices", []):
                text += choice["delta"].get("content") or ""
    return text


async def scrape(net: MemoryNetwork, host: str) -> dict[str, float]:
    status, text = await call(net, host, "GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(name: str) -> str:
    """A vLLM metric's sample name as the fake engine labels it."""
    return f'vllm:{name}{{model_name="{MODEL}"}}'
