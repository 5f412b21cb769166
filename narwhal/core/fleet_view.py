"""The operator's view of the fleet (``GET /narwhal/engines``), pure: each engine's state,
saturation and KV-event stream as of ``now``, around what the shells report of themselves
(admission, maintenance, discovery)."""

from __future__ import annotations

from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState
from narwhal.core.fleet import Fleet


def fleet_view(
    config: FleetConfig,
    fleet: Fleet,
    now: float,
    *,
    admission: dict[str, object],
    maintenance: bool,
    discovery: dict[str, object] | None = None,
) -> dict[str, object]:
    """The whole view: the fleet file's model and aliases, ``admission`` (its counts and
    limits), ``maintenance``, every engine, and ``discovery`` when ``[[discover]]`` runs."""
    held = fleet.held_in(now)
    view: dict[str, object] = {
        "model": config.model,
        "aliases": dict(config.aliases),
        **admission,
        "maintenance": maintenance,
        "engines": [engine_view(config, fleet, e, now, e.id in held) for e in fleet.engines],
    }
    if discovery is not None:
        view["discovery"] = discovery
    return view


def engine_view(
    config: FleetConfig, fleet: Fleet, engine: EngineState, now: float, held_in: bool
) -> dict[str, object]:
    """One engine: its state, why it is saturated, its KV-event stream, and what the cost
    model learned of it."""
    interval_s, flow = config.placement.metrics_interval_s, config.admission
    return {
        **engine.snapshot(now, held_in, interval_s),
        "saturation": engine.saturation_view(
            now, interval_s, flow.engine_waiting_limit, flow.kv_usage_limit
        ),
        "kv_events": kv_view(config, fleet, engine.id),
        # the cost model's coefficients in use and their samples (policy "predicted")
        "prediction": fleet.costs.view(engine.id)
        if config.placement.policy == "predicted"
        else None,
    }


def kv_view(config: FleetConfig, fleet: Fleet, engine_id: str) -> dict[str, object] | None:
    """The engine's KV-event stream (None: ``[kv_events]`` is off)."""
    if config.kv_events.mode == "off":
        return None
    stream = fleet.precise.streams.get(engine_id)
    return {"state": "unknown"} if stream is None else stream.view()
