"""The cost model of policy "predicted", pure (docs/contract.md 4.8): what each engine and
each producer-consumer pair costs, learned online from the router's own leg records.

Per engine, two fits (``narwhal.core.linear_fit``):

* **prefill**: a prompt's time on the engine that computes it, from the leg's send to its
  answer (a prefill leg's duration; a local leg's first token), against the tokens it did
  not hold and the queue it was predicted to have ahead: ``fixed + per_token * tokens +
  per_queued * queued``. ``per_queued`` is the engine's learned time per queued request;
* **step**: a decode leg's mean time between tokens against the requests the engine ran
  with it: ``step + per_running * running``.

Per pair (producer, consumer), one fit: **transfer**, the time from the decode leg's send
to its first token (the KV pull and the consumer's first step) against the prompt's tokens
the consumer did not hold. Every pair's samples also go to one fit of the whole fleet's
transfers, which answers for a pair with too few of its own (pairs share the fabric; with
P producers and C consumers a pair sees a P x C-th of the handoffs).

Until a fit has ``min_samples`` samples it answers from the priors of ``[prediction]``;
every fit fades old samples with ``half_life_s``. The priors' transfer in MiB/s needs a KV
size per token, which the router cannot know: ``KV_BYTES_PER_TOKEN`` is a mid-size model's
(an 8B-class model with grouped-query attention in fp16 is 128 KiB, a 1B-class one 32 KiB),
and only the prior uses it.
"""

from __future__ import annotations

from collections.abc import Iterable

from narwhal.core.config import PredictionConfig
from narwhal.core.linear_fit import LinearFit

KV_BYTES_PER_TOKEN = 64 * 1024
MIB = 1024 * 1024
PREFILL_FIXED_S = 0.02  # a prefill's fixed cost before any sample: a scheduler step
TRANSFER_FIXED_S = 0.01  # a handoff's before any sample: the consumer's first step
TYPICAL_PROMPT = 2048  # tokens: the prior time per queued request is such a prompt's
MIN_PER_TOKEN_S = 1e-9  # a fitted rate is never free: a longer prompt never costs less


class EngineModel:
    """One engine's fits and its priors."""

    __slots__ = ("prefill", "step")

    def __init__(self, config: PredictionConfig) -> None:
        per_token = 1.0 / config.prefill_tokens_per_s
        per_queued = PREFILL_FIXED_S + per_token * TYPICAL_PROMPT
        self.prefill = LinearFit((PREFILL_FIXED_S, per_token, per_queued), config.half_life_s)
        self.step = LinearFit((config.decode_step_s, 0.0), config.half_life_s)


class CostModel:
    """Every engine's and pair's fits, made on first use; bounded by the fleet (``retain``
    drops those of engines that left it)."""

    __slots__ = ("_engines", "_pairs", "_transfers", "config")

    def __init__(self, config: PredictionConfig) -> None:
        self.config = config
        self._engines: dict[str, EngineModel] = {}
        self._pairs: dict[tuple[str, str], LinearFit] = {}
        self._transfers = self._transfer_fit()  # every pair's samples

    def _transfer_fit(self) -> LinearFit:
        per_token = KV_BYTES_PER_TOKEN / (self.config.transfer_mib_per_s * MIB)
        return LinearFit((TRANSFER_FIXED_S, per_token), self.config.half_life_s)

    def _engine(self, engine_id: str) -> EngineModel:
        model = self._engines.get(engine_id)
        if model is None:
            model = self._engines[engine_id] = EngineModel(self.config)
        return model

    def _pair(self, producer: str, consumer: str) -> LinearFit:
        fit = self._pairs.get((producer, consumer))
        if fit is None:
            fit = self._pairs[(producer, consumer)] = self._transfer_fit()
        return fit

    def _coef(self, fit: LinearFit) -> list[float]:
        """The fit's coefficients once it has enough samples, its priors before; none
        negative, and the per-token rate never zero."""
        learned = fit.count >= self.config.min_samples
        coef = [max(0.0, c) for c in (fit.coef if learned else fit.prior)]
        coef[1] = max(coef[1], MIN_PER_TOKEN_S)
        return coef

    # ---- predictions ---------------------------------------------------------------------

    def prefill_s(self, engine_id: str, tokens: int, queued: float) -> float:
        """The wait for ``queued`` requests ahead and the compute of ``tokens`` there."""
        fixed, per_token, per_queued = self._coef(self._engine(engine_id).prefill)
        return fixed + per_token * tokens + per_queued * max(0.0, queued)

    def queued_s(self, engine_id: str) -> float:
        """The engine's time per queued request."""
        return self._coef(self._engine(engine_id).prefill)[2]

    def step_s(self, engine_id: str, running: float) -> float:
        """The time between tokens on the engine running ``running`` requests."""
        step, per_running = self._coef(self._engine(engine_id).step)
        return step + per_running * max(0.0, running)

    def transfer_s(self, producer: str, consumer: str, tokens: int) -> float:
        fixed, per_token = self._coef(self._in_use(self._pair(producer, consumer)))
        return fixed + per_token * tokens

    def _in_use(self, pair: LinearFit) -> LinearFit:
        """A pair's own fit once it has enough samples, else the fleet's transfers'."""
        return pair if pair.count >= self.config.min_samples else self._transfers

    # ---- learning ------------------------------------------------------------------------

    def saw_prefill(
        self, engine_id: str, tokens: int, queued: float, seconds: float, now: float
    ) -> None:
        fit = self._engine(engine_id).prefill
        fit.add((1.0, float(tokens), max(0.0, queued)), seconds, now, self.config.min_samples)

    def saw_step(self, engine_id: str, running: float, seconds: float, now: float) -> None:
        fit = self._engine(engine_id).step
        fit.add((1.0, max(0.0, running)), seconds, now, self.config.min_samples)

    def saw_transfer(
        self, producer: str, consumer: str, tokens: int, seconds: float, now: float
    ) -> None:
        sample = (1.0, float(tokens))
        self._pair(producer, consumer).add(sample, seconds, now, self.config.min_samples)
        self._transfers.add(sample, seconds, now, self.config.min_samples)

    def retain(self, engine_ids: Iterable[str]) -> None:
        """Forget the engines (and pairs) not among ``engine_ids``: they left the fleet."""
        keep = set(engine_ids)
        for engine_id in [e for e in self._engines if e not in keep]:
            del self._engines[engine_id]
        for pair in [p for p in self._pairs if p[0] not in keep or p[1] not in keep]:
            del self._pairs[pair]

    # ---- the operator's view -------------------------------------------------------------

    def view(self, engine_id: str) -> dict[str, object]:
        """Its coefficients in use and their samples (``/narwhal/engines``)."""
        model = self._engine(engine_id)
        fixed, per_token, per_queued = self._coef(model.prefill)
        step, per_running = self._coef(model.step)
        pairs = {
            consumer: _pair_view(self._coef(self._in_use(fit)), fit.count)
            for (producer, consumer), fit in sorted(self._pairs.items())
            if producer == engine_id
        }
        return {
            "prefill": {
                "fixed_s": _round(fixed),
                "tokens_per_s": _round(1.0 / per_token),
                "per_queued_s": _round(per_queued),
                "samples": model.prefill.count,
                "learned": model.prefill.count >= self.config.min_samples,
            },
            "decode": {
                "step_s": _round(step),
                "per_running_s": _round(per_running),
                "samples": model.step.count,
                "learned": model.step.count >= self.config.min_samples,
            },
            "transfer_to": pairs,
        }


def _pair_view(coef: list[float], samples: int) -> dict[str, object]:
    fixed, per_token = coef
    return {"fixed_s": _round(fixed), "tokens_per_s": _round(1.0 / per_token), "samples": samples}


def _round(value: float) -> float:
    return float(f"{value:.4g}")
