"""An engine's capacity from its reports: the most of its recent ones, so that a report
that lied is forgotten."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.recent_max import RecentMax

SAMPLES = st.lists(
    st.floats(allow_nan=True, allow_infinity=True, min_value=None, max_value=None),
    max_size=60,
)


def clamp(value: float, ceiling: float) -> float:
    return min(value, ceiling) if value > 0 else 0.0


@given(SAMPLES, st.integers(min_value=1, max_value=10))
def test_it_is_the_most_of_the_last_window_samples_clamped(
    samples: list[float], window: int
) -> None:
    recent = RecentMax(window, 100.0)
    for i, value in enumerate(samples):
        got = recent.add(value)
        expected = max(clamp(v, 100.0) for v in samples[max(0, i - window + 1) : i + 1])
        assert got == expected
        assert not math.isnan(got)
    assert len(recent.kept) <= window


def test_a_garbage_report_is_forgotten_once_it_leaves_the_window() -> None:
    recent = RecentMax(3, 4096.0)
    assert recent.add(8) == 8
    assert recent.add(1e12) == 4096.0  # clamped, not believed
    assert recent.add(float("inf")) == 4096.0
    assert recent.add(7) == 4096.0
    assert recent.add(7) == 4096.0
    assert recent.add(6) == 7  # the lies have left the window
