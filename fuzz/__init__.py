"""Property tests. ``make test`` runs them at a modest count; ``make fuzz`` at 10x
(``NARWHAL_FUZZ_SCALE=10``)."""

import os

SCALE = int(os.environ.get("NARWHAL_FUZZ_SCALE", "1"))


def examples(count: int) -> int:
    return count * SCALE


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given points (taken modulo its length); pieces may be empty."""
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
