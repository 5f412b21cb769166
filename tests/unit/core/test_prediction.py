"""The cost model of policy "predicted" (contract 4.8): the online fit learns an engine's
speed from its legs, shrugs off a stalled leg, relearns an engine that changed speed, and
answers from the priors until it has seen enough."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import PredictionConfig
from narwhal.core.linear_fit import LinearFit
from narwhal.core.prediction import CostModel

CONFIG = PredictionConfig(min_samples=5, half_life_s=60.0)


def close(a: float, b: float, share: float = 0.05) -> bool:
    """Within ``share`` of each other, or 5 ms (below what a client notices)."""
    return abs(a - b) <= max(share * max(abs(a), abs(b)), 0.005)


@given(
    fixed=st.floats(0.0, 0.5),
    rate=st.floats(100.0, 50_000.0),
    per_queued=st.floats(0.0, 2.0),
    seed=st.integers(0, 2**16),
)
def test_noiseless_legs_are_learned_exactly(
    fixed: float, rate: float, per_queued: float, seed: int
) -> None:
    """Prefills of varied lengths behind varied queues: the model then predicts a new
    request's time within a few percent."""
    model = CostModel(CONFIG)
    for i in range(60):
        tokens = (seed * 7919 + i * 104729) % 16_000 + 16
        queued = (seed + i) % 5
        seconds = fixed + tokens / rate + per_queued * queued
        model.saw_prefill("p0", tokens, queued, seconds, now=float(i))
    for tokens, queued in ((500, 0), (8000, 2), (15000, 4)):
        want = fixed + tokens / rate + per_queued * queued
        assert close(model.prefill_s("p0", tokens, queued), want, 0.05), (tokens, queued)


def test_the_priors_answer_until_min_samples() -> None:
    model = CostModel(CONFIG)
    prior = model.prefill_s("p0", 8000, 0)
    assert close(prior - model.prefill_s("p0", 0, 0), 8000 / 8000.0)  # 8000 tokens/s
    for i in range(CONFIG.min_samples - 1):  # four times slower than the prior says
        model.saw_prefill("p0", 8000, 0, 4.0, now=float(i))
    assert model.prefill_s("p0", 8000, 0) == prior
    model.saw_prefill("p0", 8000, 0, 4.0, now=10.0)
    assert model.prefill_s("p0", 8000, 0) > 3 * prior
    view = model.view("p0")["prefill"]
    assert isinstance(view, dict)
    assert view["samples"] == 5
    assert view["learned"] is True


def test_one_stalled_leg_moves_the_estimate_a_bounded_amount() -> None:
    """A handoff stall of 30 s among 0.5 s legs: the estimate stays near 0.5 s."""
    model = CostModel(CONFIG)
    for i in range(40):
        model.saw_prefill("p0", 4000 + (i % 4) * 1000, 0, 0.5 + (i % 4) * 0.1, now=float(i))
    before = model.prefill_s("p0", 5000, 0)
    model.saw_prefill("p0", 5000, 0, 30.0, now=41.0)
    after = model.prefill_s("p0", 5000, 0)
    assert after < 1.5 * before, (before, after)


def test_an_engine_that_turns_slower_is_relearned_within_its_half_life() -> None:
    model = CostModel(CONFIG)
    t = 0.0
    for i in range(200):  # 10 minutes at 2,000 tokens/s
        t += 3.0
        model.saw_prefill("p0", 2000 + (i % 5) * 500, 0, (2000 + (i % 5) * 500) / 2000, now=t)
    assert close(model.prefill_s("p0", 4000, 0), 2.0, 0.1)
    for i in range(20):  # one half-life at 5x slower
        t += 3.0
        model.saw_prefill("p0", 2000 + (i % 5) * 500, 0, (2000 + (i % 5) * 500) / 400, now=t)
    assert model.prefill_s("p0", 4000, 0) > 0.5 * (2.0 + 10.0), model.view("p0")


def test_steps_grow_with_the_batch_and_pairs_learn_their_transfer() -> None:
    model = CostModel(CONFIG)
    for i in range(30):
        running = 1 + i % 16
        model.saw_step("d0", running, 0.01 + 0.002 * running, now=float(i))
        tokens = 1000 + 500 * (i % 8)
        model.saw_transfer("p0", "d0", tokens, 0.005 + tokens / 100_000, now=float(i))
    assert close(model.step_s("d0", 20), 0.05, 0.05)
    assert close(model.transfer_s("p0", "d0", 10_000), 0.105, 0.05)
    # a pair with no samples of its own answers from the fleet's transfers, not the prior
    assert close(model.transfer_s("p1", "d1", 10_000), 0.105, 0.05)
    for i in range(30):  # p1 -> d0 over a slower link: its own fit once it has enough
        model.saw_transfer("p1", "d0", 1000 + 500 * (i % 8), 0.05, now=30.0 + i)
    assert close(model.transfer_s("p0", "d0", 10_000), 0.105, 0.05)
    pairs = model.view("p0")["transfer_to"]
    assert isinstance(pairs, dict)
    assert pairs["d0"]["samples"] == 30


def test_engines_that_left_are_forgotten() -> None:
    model = CostModel(CONFIG)
    for engine in ("p0", "p1"):
        model.saw_prefill(engine, 100, 0, 0.1, now=0.0)
        model.saw_transfer(engine, "d0", 100, 0.1, now=0.0)
    model.retain(["p0", "d0"])
    assert model.view("p1")["prefill"] == CostModel(CONFIG).view("p1")["prefill"]
    assert model.view("p1")["transfer_to"] == {}


@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(-1e3, 1e3)), max_size=60))
def test_the_fit_never_answers_a_non_number(samples: list[tuple[float, float]]) -> None:
    """Whatever the legs said (NaN and infinities included, as dropped), the coefficients
    stay finite and the model's predictions non-negative."""
    fit = LinearFit((0.1, 0.001), half_life_s=10.0)
    for i, (x, y) in enumerate(samples):
        fit.add((1.0, x), y, now=float(i), min_samples=3)
    fit.add((1.0, 1.0), math.nan, now=1e9, min_samples=3)
    fit.add((1.0, math.inf), 1.0, now=1e9, min_samples=3)
    assert all(math.isfinite(c) for c in fit.coef)
    model = CostModel(CONFIG)
    for i, (x, y) in enumerate(samples):
        model.saw_step("d0", abs(x) % 100, y, now=float(i))
    assert model.step_s("d0", 5) >= 0
