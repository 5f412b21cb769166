"""What the room rule costs a placement in the common case: ``choose`` over 4 idle producers
(none saturated, prefix affinity on), with ``with_room`` and with it replaced by the identity.

    NARWHAL_PURE=1 python bench/room_rule_cost.py

Run it pure: in the compiled build ``choose`` calls ``with_room`` directly, so the
replacement does not reach it and both figures are the rule's. Figures:
bench/results/placement-room/README.md."""

import random
import sys
import timeit

sys.path.insert(0, ".")
from narwhal.core import placement
from narwhal.core.config import EngineSpec, PlacementConfig, RecoveryConfig
from narwhal.core.fleet import Fleet
from narwhal.core.prefix_index import prompt_of


def main() -> None:
    specs = tuple(EngineSpec(f"p{i}", f"http://127.0.0.1:{9000 + i}", "prefill") for i in range(4))
    fleet = Fleet(specs, RecoveryConfig())
    for engine in fleet.engines:
        engine.up = True
    config = PlacementConfig()
    rng = random.Random(1)
    prompt = prompt_of({"prompt": "hello " * 400}, chat=False)

    def call() -> None:
        placement.choose(
            fleet.producers,
            "prefill",
            config,
            rng=rng,
            now=0.0,
            key="hello",
            ring=fleet.ring,
            prompt=prompt,
            index=fleet.prefixes,
        )

    n = 20000
    on = min(timeit.repeat(call, number=n, repeat=5)) / n * 1e6
    real = placement.with_room
    placement.with_room = lambda pool, *args: list(pool)  # type: ignore[assignment]
    off = min(timeit.repeat(call, number=n, repeat=5)) / n * 1e6
    placement.with_room = real
    print(
        f"choose over 4 idle producers: {on:.2f} us with the room rule, {off:.2f} us "
        f"without ({on / off:.2f}x, {on - off:+.2f} us)"
    )


if __name__ == "__main__":
    main()
