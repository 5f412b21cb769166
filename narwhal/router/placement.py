"""Placement: which producer and which consumer, as a pure function of fleet state."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from narwhal.router.fleet import EngineState


def pick(
    candidates: Sequence[EngineState],
    *,
    turn: int = 0,
    avoid: Collection[str] = (),
    prefer_not: str | None = None,
) -> EngineState | None:
    """The least-loaded candidate not in ``avoid``.

    Ties go to an engine other than ``prefer_not`` (a consumer distinct from the producer
    keeps prefill and decode apart), then rotate with ``turn`` so equal engines share load.
    Engines in ``avoid`` are used only when nothing else is left.
    """
    n = len(candidates)
    best: EngineState | None = None
    best_key: tuple[int, int, int, int] | None = None
    for engine in candidates:
        key = (
            engine.id in avoid,
            engine.load,
            engine.id == prefer_not,
            (engine.index - turn) % n if n else 0,
        )
        if best_key is None or key < best_key:
            best, best_key = engine, key
    return best
