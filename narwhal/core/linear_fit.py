"""An online linear fit with exponential forgetting and a prior, pure: the cost model's
learner (``narwhal.core.prediction``).

It keeps the weighted sums of least squares (``XᵀWX`` and ``XᵀWy``, a few floats whatever
the number of samples: bounded memory) and multiplies them by ``0.5 ** (dt / half_life_s)``
before each sample, so a sample ``half_life_s`` old weighs half as much as a new one and an
engine that changes speed is relearned within about that long. A ridge term pulls the
coefficients towards the prior (``PRIOR_WEIGHT`` pseudo-samples' worth): a feature that
never varies (a queue that was always empty) keeps its prior instead of an arbitrary value.

Robust to outliers: once the fit has ``min_samples``, a sample's residual is clipped to
``CLIP`` times the fit's decayed root mean square residual, or to ``SLOWER`` times the
prediction if that is more, before it is added (Huber's winsorising), so one stalled leg
(a 30 s handoff stall, a GC pause) moves the coefficients by a bounded amount instead of
ruining them, while a run of slow legs (an engine 4x slower) still counts whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CLIP = 3.0  # residuals beyond this many RMS residuals are clipped (once fitted) ...
SLOWER = 4.0  # ... unless within this many times the prediction
# the prior's worth, in samples: enough to settle a feature the samples never varied
# (a queue that was always empty keeps its prior), too little to bias what they did
PRIOR_WEIGHT = 0.05
FLAT = 0.05  # a feature whose variance is below this share of its mean square barely varies


class LinearFit:
    """``y ≈ coef · x``, learned online; ``x[0]`` is 1 for an intercept."""

    __slots__ = ("_a", "_b", "_rss", "_w", "at", "coef", "count", "half_life_s", "prior")

    def __init__(self, prior: Sequence[float], half_life_s: float) -> None:
        n = len(prior)
        self.prior = tuple(prior)
        self.half_life_s = half_life_s
        self._a = [[0.0] * n for _ in range(n)]  # XᵀWX
        self._b = [0.0] * n  # XᵀWy
        self._w = 0.0  # the samples' decayed weight
        self._rss = 0.0  # their decayed sum of squared residuals (against the fit then)
        self.coef = list(self.prior)
        self.count = 0  # samples seen, undecayed (what min_samples counts)
        self.at: float | None = None  # when the last sample came

    def predict(self, x: Sequence[float]) -> float:
        return sum(c * v for c, v in zip(self.coef, x, strict=True))

    def rms(self) -> float:
        """The decayed root mean square residual (0 before any sample)."""
        return math.sqrt(self._rss / self._w) if self._w > 0 else 0.0

    def add(self, x: Sequence[float], y: float, now: float, min_samples: int) -> None:
        """One sample at ``now``; a NaN or infinite one is dropped."""
        if not math.isfinite(y) or not all(math.isfinite(v) for v in x):
            return
        self._decay(now)
        residual = y - self.predict(x)
        if self.count >= min_samples:
            # a sample up to SLOWER times the prediction always counts whole: an engine
            # that turned several times slower is relearned, one stalled leg is not
            limit = max(CLIP * self.rms(), (SLOWER - 1) * abs(y - residual))
            if limit > 0 and abs(residual) > limit:
                y -= residual - math.copysign(limit, residual)
                residual = math.copysign(limit, residual)
        n = len(x)
        for i in range(n):
            self._b[i] += x[i] * y
            row = self._a[i]
            for j in range(n):
                row[j] += x[i] * x[j]
        self._w += 1.0
        self._rss += residual * residual
        self.count += 1
        self.coef = self._solve()

    def _decay(self, now: float) -> None:
        if self.at is not None and now > self.at:
            factor = 0.5 ** ((now - self.at) / self.half_life_s)
            for row in self._a:
                for j in range(len(row)):
                    row[j] *= factor
            self._b = [v * factor for v in self._b]
            self._w *= factor
            self._rss *= factor
        self.at = now if self.at is None else max(self.at, now)

    def _solve(self) -> list[float]:
        """Ridge towards the prior: (XᵀWX + λD) c = XᵀWy + λD·prior, D scaling each feature
        by its spread in the samples (its variance; the intercept by 1) so that λ is in
        samples whatever the units. A feature that barely varies is scaled by a share of
        its mean square instead: its deviation from the prior goes to the intercept."""
        n = len(self.prior)
        a = [row[:] for row in self._a]
        b = self._b[:]
        w = max(self._w, 1e-12)
        for i in range(n):
            square = a[i][i] / w
            spread = square - (a[0][i] / w) ** 2 if i else 1.0
            scale = max(spread, FLAT * square, 1e-12)
            ridge = PRIOR_WEIGHT * scale
            a[i][i] += ridge
            b[i] += ridge * self.prior[i]
        solved = gauss(a, b)
        return solved if solved is not None else list(self.prior)


def gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (None: singular)."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))
        x[r] = s / a[r][r]
    return x if all(math.isfinite(v) for v in x) else None
