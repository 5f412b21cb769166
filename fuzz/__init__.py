"""Property tests. ``make test`` runs them at a modest count; ``make fuzz`` at 10x
(``NARWHAL_FUZZ_SCALE=10``)."""

import os

SCALE = int(os.environ.get("NARWHAL_FUZZ_SCALE", "1"))


def examples(count: int) -> int:
    return count * SCALE
