"""Policy "predicted" over fake engines with their cost model, under trio's MockClock
(contract 4.8): the model learns each engine's speed from the router's own legs and places
by predicted TTFT; a class's TTFT target that no plan can meet is refused at once."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import msgspec
import trio

from narwhal.core.config import (
    AdmissionConfig,
    ClassTargets,
    PlacementConfig,
    PredictionConfig,
    ServingConfig,
)
from narwhal.core.flow import Priority
from narwhal.core.flow_class import Flow
from narwhal.core.prefix_index import prompt_of
from narwhal.core.requests import parse_request
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.router.service import Router
from tests.support.fleet import MODEL
from tests.support.memory_fleet import RecordingSink, engine_fleet

PREDICTED = PlacementConfig(policy="predicted")
SERVING = ServingConfig(graceful_timeout_s=5.0)


def producer(ms_per_token: float, slots: int = 1) -> FakeEngineConfig:
    return FakeEngineConfig(
        model=MODEL,
        role="prefill",
        slots=slots,
        prefill_ms_per_token=ms_per_token,
        prefix_cache_blocks=4096,
    )


def consumer(ms_per_token: float = 1.0) -> FakeEngineConfig:
    # its own prefill is slow: a local plan pays off only for a short uncached part
    return FakeEngineConfig(
        model=MODEL, role="decode", slots=32, itl_s=0.01, prefill_ms_per_token=ms_per_token
    )


def text(n: int, words: int, shared: str = "") -> str:
    own = " ".join(f"r{n}w{i}" for i in range(words))
    return f"{shared} {own}" if shared else own


async def ask(
    router: Router, n: int, prompt: str, cls: Priority = Priority.DEFAULT
) -> RecordingSink:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    req = parse_request(msgspec.json.encode(body), endpoint="/v1/completions", model=MODEL)
    sink = RecordingSink()
    await router.handle(req, f"r{n}", sink, trio.sleep_forever, flow=Flow(cls))
    return sink


async def test_the_faster_producer_is_learned_and_takes_more_of_the_work(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """p1 computes a prompt five times slower than p0. Requests arrive one every 0.2 s,
    each 500 to 1,500 uncached tokens (0.2 s on p0 on average, 1 s on p1: p0 alone would
    be always busy): once the model has seen both, it sends most prefills to p0, and it
    predicts p1 at least three times slower (p1 gets only a few legs, each after a wait of
    its own that a few samples cannot tell from its compute)."""
    fleet = await engine_fleet(
        nursery,
        {"p0": producer(0.2), "p1": producer(1.0), "d0": consumer(), "d1": consumer()},
        rng=random.Random(3),
        placement=PREDICTED,
        serving=SERVING,
        prediction=PredictionConfig(min_samples=5),  # the slow one gets few legs
    )
    router = fleet.router
    async with trio.open_nursery() as clients:
        for n in range(160):
            clients.start_soon(ask, router, n, text(n, 500 + n * 37 % 1000))
            await trio.sleep(0.2)
    lines = router.journal.lines
    assert all(line.status == 200 for line in lines), Counter(line.message for line in lines)
    later = Counter(line.attempts[-1].producer for line in lines[80:])
    assert later["p0"] > 3 * later["p1"], later
    costs = router.fleet.costs
    for engine in ("p0", "p1"):
        view = costs.view(engine)["prefill"]
        assert isinstance(view, dict)
        assert view["learned"], view
    # in the router's own token estimate (text bytes / 4): p1 learned about 5x slower
    tokens = prompt_of({"prompt": text(0, 1000)}, chat=False).tokens
    slower = costs.prefill_s("p1", tokens, 0) / costs.prefill_s("p0", tokens, 0)
    assert slower >= 3.0, (slower, costs.view("p0"), costs.view("p1"))
    assert all(line.attempts[-1].predicted_ttft_s is not None for line in lines)
    # observed over predicted, on /metrics: the median near 1 once the model has learned
    observed = [(line.first_byte_s or 0.0) - (line.queued_s or 0.0) for line in lines[80:]]
    ratios = sorted(
        o / (line.attempts[-1].predicted_ttft_s or 1.0)
        for o, line in zip(observed, lines[80:], strict=True)
    )
    assert 0.7 <= ratios[len(ratios) // 2] <= 1.3, ratios
    registry = router.metrics.registry
    counted = registry.get_sample_value(
        "narwhal_prediction_error_ratio_count", {"engine": "p0", "figure": "ttft"}
    )
    assert counted is not None
    assert counted > 0


async def test_a_held_long_prefix_wins_over_an_idle_engine_until_its_holder_is_queued(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """A 4,000-word shared prefix is cached on one producer only; a request with it and
    100 words of its own goes to that producer while it is idle, and to the other one
    (computing all of it) when the holder has prompts queued ahead (one slot). The
    consumers compute prompts slowly: after a few warm-up requests the model knows it and
    plans P/D (``min_samples`` 1 here)."""
    fleet = await engine_fleet(
        nursery,
        {"p0": producer(0.5), "p1": producer(0.5), "d0": consumer(), "d1": consumer()},
        rng=random.Random(5),
        placement=PlacementConfig(policy="predicted", metrics_interval_s=0.0),
        serving=SERVING,
        prediction=PredictionConfig(min_samples=1),
    )
    router, shared = fleet.router, " ".join(f"sys{i}" for i in range(4000))
    for n in range(6):  # each engine computes a prompt or two: the model learns them
        await ask(router, 100 + n, text(100 + n, 800))
    warm = len(router.journal.lines)
    await ask(router, 0, text(0, 100, shared))
    holder = router.journal.lines[warm].attempts[-1].producer
    assert holder is not None
    await ask(router, 1, text(1, 100, shared))
    assert router.journal.lines[warm + 1].attempts[-1].producer == holder
    async with trio.open_nursery() as clients:
        for n in range(2, 9):  # arriving at once: the holder's queue grows with each
            clients.start_soon(ask, router, n, text(n, 100, shared))
            await trio.sleep(0.001)
    placed = [line.attempts[-1].producer for line in router.journal.lines[warm + 2 :]]
    assert holder in placed, placed
    assert len(set(placed)) == 2, placed


async def test_a_class_target_no_plan_can_meet_is_refused_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Interactive requests must start within 0.5 s; a prompt whose compute alone is
    predicted at 2 s (16,000 tokens at the prior's 8,000 a second) gets 429 at once,
    without waiting in the queue; a short one is served, and a batch one of the same
    length (no target) too."""
    fleet = await engine_fleet(
        nursery,
        {"p0": producer(0.01, slots=4), "d0": consumer()},
        placement=PREDICTED,
        admission=AdmissionConfig(classes={"interactive": ClassTargets(ttft_slo_s=0.5)}),
        serving=SERVING,
    )
    router = fleet.router
    started = trio.current_time()
    refused = await ask(router, 0, text(0, 16_000), Priority.INTERACTIVE)
    _, status, message = refused.error
    assert status == 429, message
    assert "cannot meet ttft_slo_s=0.5" in message, message
    assert trio.current_time() - started < 0.01  # at once: no queue wait, no engine leg
    assert (await ask(router, 1, text(1, 100), Priority.INTERACTIVE)).finished
    lines = router.journal.lines
    assert [line.status for line in lines] == [429, 200]
    await ask(router, 2, text(2, 16_000), Priority.BATCH)
    assert router.journal.lines[-1].status == 200
    slo = router.metrics.registry.get_sample_value
    assert slo("narwhal_slo_total", {"class": "interactive", "target": "ttft", "met": "no"}) == 1
    assert slo("narwhal_slo_total", {"class": "interactive", "target": "ttft", "met": "yes"}) == 1
    assert slo("narwhal_slo_total", {"class": "batch", "target": "ttft", "met": "yes"}) == 0
