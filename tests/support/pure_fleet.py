"""A fleet's pure state (``narwhal.core.fleet.Fleet``) in one call, for the core's tests:
engines by id and role, each serving the names it lists."""

from __future__ import annotations

from narwhal.core.breaker import BreakerState
from narwhal.core.config import EngineSpec, RecoveryConfig, Role
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import BreakerClass
from narwhal.core.fleet import Fleet
from narwhal.core.served_models import Served

MODEL = "tiny"


def serving(*names: str) -> Served:
    """``name`` is a base model, ``name:parent`` an adapter of ``parent``."""
    return Served({n.partition(":")[0]: n.partition(":")[2] or None for n in names})


def pure_fleet(
    engines: dict[str, Role | tuple[Role, Served]],
    aliases: dict[str, str] | None = None,
    model: str = MODEL,
) -> Fleet:
    """Engines in the given order, each of its role; one given a list serves it (the others
    serve ``model``, as before any engine answered)."""
    specs = tuple(
        EngineSpec(id, f"http://127.0.0.1:{9000 + i}", role if isinstance(role, str) else role[0])
        for i, (id, role) in enumerate(engines.items())
    )
    fleet = Fleet(specs, RecoveryConfig())
    fleet.configure_models(model, aliases or {})
    for engine, role in zip(fleet.engines, engines.values(), strict=True):
        if not isinstance(role, str):
            fleet.note_models(engine, role[1])
    return fleet


def eject(engine: EngineState, cause: BreakerClass = BreakerClass.STREAM) -> None:
    """Engine-side failures until its breaker ejects it."""
    while engine.breaker.state is BreakerState.CLOSED:
        engine.breaker.record_failure(cause, "failed", 0.0)
