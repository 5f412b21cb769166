"""One consumer among three failing 100% (hung: /health still answers), then healed.

    python bench/breaker_scenario.py [--max-attempts 1]

In-process on 127.0.0.1: one producer, consumers c0..c2, c0 hangs every decode leg
(first-token timeout 0.5 s, eject_after 3, probes every 1 s). Clients send streamed
completions at concurrency 8 for 8 s; c0 is healed at 4 s. Prints the share of client
requests that succeeded, when c0 was ejected, healed and readmitted, and the journal's
engine events.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import httpcore
import msgspec
import trio

from narwhal.core.config import EngineConfig, EngineSpec, FleetConfig, RecoveryConfig, ServingConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from narwhal.router.serving import serve

MODEL = "fake-model"


async def scenario(max_attempts: int, duration_s: float, heal_at_s: float) -> None:
    async with trio.open_nursery() as nursery:
        engines = {"p0": FakeEngine(FakeEngineConfig(model=MODEL, role="prefill"))}
        for i in range(3):
            engines[f"c{i}"] = FakeEngine(FakeEngineConfig(model=MODEL, role="decode", itl_s=0.005))
        urls = {name: await nursery.start(e.serve) for name, e in engines.items()}
        fleet = FleetConfig(
            model=MODEL,
            engines=tuple(
                EngineSpec(n, u, "prefill" if n == "p0" else "decode") for n, u in urls.items()
            ),
            serving=ServingConfig(max_attempts=max_attempts, graceful_timeout_s=0.2),
            engine=EngineConfig(first_token_timeout_s=0.5),
            recovery=RecoveryConfig(eject_after=3, readmit_interval_s=1.0),
        )
        router = Router(fleet, journal=Journal(keep=100_000))
        stop = trio.Event()
        url = await nursery.start(
            partial(serve, fleet, port=0, router=router, shutdown_trigger=stop.wait)
        )
        engines["c0"].faults.push(*[Fault(kind="hang", leg="decode")] * 100_000)
        t0, wall0 = trio.current_time(), time.time()
        outcomes: list[tuple[float, int]] = []
        body = msgspec.json.encode(
            {"model": MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
        )

        async def client(pool: httpcore.AsyncConnectionPool) -> None:
            while trio.current_time() - t0 < duration_s:
                resp = await pool.request(
                    "POST",
                    url + "/v1/completions",
                    content=body,
                    headers=[("content-type", "application/json")],
                )
                ok = resp.status == 200 and resp.content.endswith(b"data: [DONE]\n\n")
                outcomes.append((trio.current_time() - t0, 200 if ok else resp.status))

        async def heal() -> None:
            await trio.sleep(heal_at_s)
            engines["c0"].faults.clear()

        async with (
            httpcore.AsyncConnectionPool(max_connections=8) as pool,
            trio.open_nursery() as load,
        ):
            load.start_soon(heal)
            for _ in range(8):
                load.start_soon(client, pool)
        stop.set()
        events = router.events.events
        nursery.cancel_scope.cancel()
    ok = sum(1 for _, s in outcomes if s == 200)
    print(
        f"max_attempts={max_attempts}: {len(outcomes)} requests, {ok} succeeded "
        f"({100 * ok / max(1, len(outcomes)):.1f}%), "
        f"failures at t<=: {[round(t, 2) for t, s in outcomes if s != 200]}"
    )
    for event in events:
        fields = {k: v for k, v in event.items() if k not in ("event", "at")}
        print(f"  t={event['at'] - wall0:5.2f}s {event['event']} {fields}")
    print(f"  t={heal_at_s:5.2f}s c0 healed (its fault queue cleared)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-attempts", type=int, default=1)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--heal-at", type=float, default=4.0)
    args = parser.parse_args()
    trio.run(scenario, args.max_attempts, args.duration, args.heal_at)


if __name__ == "__main__":
    main()
