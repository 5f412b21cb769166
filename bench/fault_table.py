"""Print what a client observes for every catalogued engine fault (streaming and not).

    python bench/fault_table.py

Runs the router and two fake engines in-process on 127.0.0.1 with short timeouts (first
token and silence 0.3 s, prefill 0.5 s), breaks one leg per row as
``tests.support.fault_scenarios`` says, and prints a markdown table as observed.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import httpcore
import msgspec
import trio

from narwhal.core.config import EngineConfig, EngineSpec, FleetConfig, ServingConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.router.service import Router
from narwhal.router.serving import serve
from narwhal.stream.sse import SSEParser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the catalogue is the tests'
from tests.support.fault_scenarios import FAULTS

MODEL = "fake-model"


async def observe(name: str, stream: bool) -> str:
    side, fault = FAULTS[name]
    async with trio.open_nursery() as nursery:
        producer = FakeEngine(FakeEngineConfig(model=MODEL, role="prefill"))
        consumer = FakeEngine(FakeEngineConfig(model=MODEL, role="decode"))
        p_url, d_url = await nursery.start(producer.serve), await nursery.start(consumer.serve)
        fleet = FleetConfig(
            model=MODEL,
            engines=(EngineSpec("p0", p_url, "prefill"), EngineSpec("d0", d_url, "decode")),
            serving=ServingConfig(
                prefill_timeout_s=0.5, request_timeout_s=5, graceful_timeout_s=0.2
            ),
            engine=EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
        )
        stop = trio.Event()
        url = await nursery.start(
            partial(serve, fleet, port=0, router=Router(fleet), shutdown_trigger=stop.wait)
        )
        engine = producer if side == "producer" else consumer
        if fault is None:
            engine.stop()
        else:
            engine.faults.push(fault)
        body = msgspec.json.encode(
            {"model": MODEL, "prompt": "hello", "max_tokens": 6, "stream": stream}
        )
        parts: list[bytes] = []
        cut = False
        async with (
            httpcore.AsyncConnectionPool() as http,
            http.stream(
                "POST",
                url + "/v1/completions",
                content=body,
                headers=[("content-type", "application/json")],
            ) as resp,
        ):
            try:
                parts += [part async for part in resp.aiter_stream()]
            except httpcore.RemoteProtocolError:
                cut = True  # after a terminal event the body is cut (contract 6)
        stop.set()
        nursery.cancel_scope.cancel()
    described = describe(resp.status, b"".join(parts), stream)
    return described + ", then the body cut" if cut else described


def describe(status: int, body: bytes, stream: bool) -> str:
    if status != 200:
        message = msgspec.json.decode(body)["error"]["message"]
        return f"{status} `{message[:60]}`"
    if not stream:
        return "200 complete JSON"
    events = SSEParser().feed(body)
    tokens = sum(1 for e in events if e != b"[DONE]" and b'"error"' not in e)
    if events[-1] == b"[DONE]":
        return f"200, {tokens} tokens, [DONE]"
    error = msgspec.json.decode(events[-1])["error"]
    return f"200, {tokens} tokens, terminal event {error['code']} `{error['message'][:45]}`"


async def main() -> None:
    print("| fault | streaming client | non-streaming client |")
    print("|---|---|---|")
    for name in FAULTS:
        streaming = await observe(name, True)
        plain = await observe(name, False)
        print(f"| {name} | {streaming} | {plain} |")


if __name__ == "__main__":
    trio.run(main)
