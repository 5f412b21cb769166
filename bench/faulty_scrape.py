"""Scrape /metrics during a run with faults, and print the non-zero narwhal series.

    python bench/faulty_scrape.py

In-process on 127.0.0.1: one producer, consumers d0..d2; d0 answers [DONE] before any token
every time, the producer fails one prefill in ten with 503. 60 streamed requests at
concurrency 4 (max_attempts 2), then one scrape.
"""

from __future__ import annotations

from functools import partial

import httpcore
import msgspec
import trio

from narwhal.core.config import EngineConfig, EngineSpec, FleetConfig, RecoveryConfig, ServingConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.router.service import Router
from narwhal.router.serving import serve

MODEL = "fake-model"


async def main() -> None:
    async with trio.open_nursery() as nursery:
        engines = {"p0": FakeEngine(FakeEngineConfig(model=MODEL, role="prefill"))}
        for i in range(3):
            engines[f"d{i}"] = FakeEngine(FakeEngineConfig(model=MODEL, role="decode"))
        urls = {n: await nursery.start(e.serve) for n, e in engines.items()}
        fleet = FleetConfig(
            model=MODEL,
            engines=tuple(
                EngineSpec(n, u, "prefill" if n == "p0" else "decode") for n, u in urls.items()
            ),
            serving=ServingConfig(max_attempts=2, graceful_timeout_s=0.2),
            engine=EngineConfig(first_token_timeout_s=0.5),
            recovery=RecoveryConfig(eject_after=3, readmit_interval_s=60),
        )
        stop = trio.Event()
        url = await nursery.start(
            partial(serve, fleet, port=0, router=Router(fleet), shutdown_trigger=stop.wait)
        )
        engines["d0"].faults.push(*[Fault(kind="done_first")] * 1000)
        body = msgspec.json.encode(
            {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
        )
        remaining = iter(range(60))
        async with httpcore.AsyncConnectionPool(max_connections=4) as pool:

            async def client() -> None:
                for i in remaining:
                    if i % 10 == 5:  # one prefill in ten fails, spread over the run
                        engines["p0"].faults.push(Fault(kind="status", status=503))
                    await pool.request(
                        "POST",
                        url + "/v1/completions",
                        content=body,
                        headers=[("content-type", "application/json")],
                    )

            async with trio.open_nursery() as load:
                for _ in range(4):
                    load.start_soon(client)
            scrape = await pool.request("GET", url + "/metrics")
        stop.set()
        nursery.cancel_scope.cancel()
    for line in scrape.content.decode().splitlines():
        if line.startswith("narwhal_") and not line.endswith(" 0.0") and "_bucket" not in line:
            print(line)


if __name__ == "__main__":
    trio.run(main)
