"""The newcomer's demo: two fake engines and the router on 127.0.0.1, one streamed chat.

Needs nothing beyond narwhal's own dependencies: the chat is streamed with the standard
library's ``http.client`` and read with narwhal's SSE parser, so ``pip install narwhal``
then ``narwhal demo`` works.
"""

from __future__ import annotations

import http.client
import signal
import sys
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import msgspec
import trio
import trio.lowlevel
from hypercorn.config import Sockets

from narwhal.core.config import EngineSpec, FleetConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.frontdoor.server import bind_sockets
from narwhal.observe.logs import configure as configure_logs
from narwhal.router.service import Router
from narwhal.router.serving import hypercorn_config, serve
from narwhal.stream.sse import DONE, SSEParser

MODEL = "fake-model"
HOST = "127.0.0.1"


def listen(port: int) -> Sockets:
    """The router's socket on ``HOST:port``, bound now: the ``OSError`` when it cannot be
    (the command line names it, as for ``narwhal serve``); the engines take any free port."""
    return bind_sockets(hypercorn_config(FleetConfig(MODEL, ()), HOST, port))


def run_demo(*, keep: bool = False, port: int = 8000, sockets: Sockets | None = None) -> int:
    """0 when the chat streamed to its end, 1 (and why, on stderr) when it did not."""
    configure_logs("text", "error")  # the demo's output is the stream, not the router's log
    if sockets is None:
        sockets = listen(port)
    failure = None
    try:
        failure = trio.run(partial(_demo, keep=keep, port=port, sockets=sockets))
    except* KeyboardInterrupt:  # Ctrl-C before the chat ended (--keep waits for it: 0)
        failure = "interrupted"
    if failure:
        print(f"narwhal demo: {failure}", file=sys.stderr)
        return 1
    return 0


async def _demo(*, keep: bool, port: int, sockets: Sockets) -> str | None:
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
            partial(
                serve,
                fleet,
                host=HOST,
                port=port,
                router=Router(fleet),
                shutdown_trigger=stop.wait,
                sockets=sockets,
            )
        )
        print(f"fake producer {p_url}, fake consumer {d_url}, router {url}", file=sys.stderr)
        failure = await trio.to_thread.run_sync(_stream_one_chat, url)
        if not failure:
            _who_served(producer, consumer)
        if keep and not failure:
            print(
                f"\nThe fleet stays up; try:\n  curl -N {url}/v1/chat/completions "
                f'-H \'content-type: application/json\' -d \'{{"model": "{MODEL}", '
                '"messages": [{"role": "user", "content": "hi"}], "stream": true}\'\n'
                f"  curl {url}/narwhal/engines\nCtrl-C to stop.",
                file=sys.stderr,
            )
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
        stop.set()
        await trio.lowlevel.checkpoint()
        nursery.cancel_scope.deadline = trio.current_time() + 2
        # engines have no graceful path to wait for; the router drains via stop
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    return failure


def _stream_one_chat(url: str) -> str | None:
    """POST one streamed chat completion and print its tokens as they arrive; what went
    wrong, or None."""
    body = msgspec.json.encode(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about the narwhal."}],
            "max_tokens": 24,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        print(f"request id: {resp.getheader('x-request-id')}")
        if resp.status != 200:
            return f"the router answered {resp.status}: {resp.read()!r}"
        parser = SSEParser()
        while chunk := resp.read1(65536):  # as the bytes arrive, chunked framing undone
            for data in parser.feed(chunk):
                if data == DONE:
                    print()
                    return None
                event: Any = msgspec.json.decode(data)
                if "error" in event:
                    print()
                    return f"the stream ended with an error: {event['error']}"
                for choice in event.get("choices") or ():
                    if content := (choice.get("delta") or {}).get("content"):
                        print(content, end="", flush=True)
        print()
        return "the stream ended before [DONE]"
    except OSError as exc:
        return f"cannot talk to the router at {url}: {exc}"
    finally:
        conn.close()


def _who_served(producer: FakeEngine, consumer: FakeEngine) -> None:
    for name, engine in (("prefill", producer), ("decode", consumer)):
        ids = [entry["request_id"] for entry in engine.log]
        print(f"{name} served by engine {engine.engine_id[:8]} ({engine.url}): {ids[-1:]}")
