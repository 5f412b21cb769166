"""The newcomer's demo: two fake engines and the router on 127.0.0.1, one streamed chat.

Uses the official ``openai`` client (a test dependency: ``make demo`` installs it).
"""

from __future__ import annotations

import sys
from functools import partial

import trio
import trio.lowlevel

from narwhal.config import EngineSpec, FleetConfig
from narwhal.fake_engine.engine import FakeEngine, FakeEngineConfig
from narwhal.logs import configure as configure_logs
from narwhal.router.service import Router
from narwhal.server import serve

MODEL = "fake-model"


def run_demo(*, keep: bool = False, port: int = 8000) -> int:
    configure_logs("text", "error")  # the demo's output is the stream, not the router's log
    trio.run(partial(_demo, keep=keep, port=port))
    return 0


async def _demo(*, keep: bool, port: int) -> None:
    producer = FakeEngine(FakeEngineConfig(model=MODEL, role="prefill"))
    consumer = FakeEngine(FakeEngineConfig(model=MODEL, role="decode", itl_s=0.04))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        p_url = await nursery.start(producer.serve)
        d_url = await nursery.start(consumer.serve)
        fleet = FleetConfig(
            model=MODEL,
            engines=(
                EngineSpec("prefill-0", p_url, "prefill"),
                EngineSpec("decode-0", d_url, "decode"),
            ),
        )
        url = await nursery.start(
            partial(serve, fleet, port=port, router=Router(fleet), shutdown_trigger=stop.wait)
        )
        print(f"fake producer {p_url}, fake consumer {d_url}, router {url}", file=sys.stderr)
        await trio.to_thread.run_sync(_stream_one_chat, url)
        _who_served(producer, consumer)
        if keep:
            print(
                f"\nThe fleet stays up; try:\n  curl -N {url}/v1/chat/completions "
                f'-H \'content-type: application/json\' -d \'{{"model": "{MODEL}", '
                '"messages": [{"role": "user", "content": "hi"}], "stream": true}\'\n'
                f"  curl {url}/narwhal/engines\nCtrl-C to stop.",
                file=sys.stderr,
            )
            await trio.sleep_forever()
        stop.set()
        await trio.lowlevel.checkpoint()
        nursery.cancel_scope.deadline = trio.current_time() + 2
        # engines have no graceful path to wait for; the router drains via stop
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()


def _stream_one_chat(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about the narwhal."}],
        max_tokens=24,
        stream=True,
    )
    print(f"request id: {raw.headers.get('x-request-id')}")
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    client.close()


def _who_served(producer: FakeEngine, consumer: FakeEngine) -> None:
    for name, engine in (("prefill", producer), ("decode", consumer)):
        ids = [entry["request_id"] for entry in engine.log]
        print(f"{name} served by engine {engine.engine_id[:8]} ({engine.url}): {ids[-1:]}")
