"""The operator's view of the fleet (``GET /narwhal/engines``), sans IO."""

from __future__ import annotations

from typing import Any

from narwhal.core.config import AdmissionConfig, FleetConfig, KvEventsConfig
from narwhal.core.fleet_view import fleet_view
from tests.support.pure_fleet import MODEL, eject, pure_fleet

ADMISSION: dict[str, object] = {"admitted": 2, "dispatched": 1}


def _engines(view: dict[str, object]) -> list[dict[str, Any]]:
    engines = view["engines"]
    assert isinstance(engines, list)
    return engines


def test_the_view_holds_the_fleet_file_the_shells_reports_and_every_engine() -> None:
    config = FleetConfig(model=MODEL, aliases={"fast": MODEL})
    fleet = pure_fleet({"p0": "prefill", "d0": "decode"}, aliases=dict(config.aliases))
    view = fleet_view(config, fleet, 5.0, admission=ADMISSION, maintenance=True)
    assert list(view) == [
        "model",
        "aliases",
        "admitted",
        "dispatched",
        "maintenance",
        "engines",
    ]  # no discovery block without [[discover]]
    assert (view["model"], view["aliases"], view["maintenance"]) == (MODEL, {"fast": MODEL}, True)
    assert [e["id"] for e in _engines(view)] == ["p0", "d0"]
    discovered = fleet_view(
        config, fleet, 5.0, admission=ADMISSION, maintenance=False, discovery={"rounds": 3}
    )
    assert discovered["discovery"] == {"rounds": 3}


async def test_each_engine_shows_its_state_saturation_and_whether_it_is_held_in() -> None:
    config = FleetConfig(model=MODEL, admission=AdmissionConfig(engine_waiting_limit=2))
    fleet = pure_fleet({"p0": "prefill", "d0": "decode", "d1": "decode"})
    p0, _, d1 = fleet.engines
    eject(p0)  # the last producer: held in
    eject(d1)  # another consumer is healthy: out
    async with fleet.reserve(p0, "prefill"), fleet.reserve(p0, "prefill"):  # not started
        view = fleet_view(config, fleet, 5.0, admission={}, maintenance=False)
    rows = {e["id"]: e for e in _engines(view)}
    assert {id: row["held_in"] for id, row in rows.items()} == {
        "p0": True,
        "d0": False,
        "d1": False,
    }
    assert rows["d1"]["breaker"]["state"] == "ejected"
    assert rows["p0"]["inflight"] == {"prefill": 2, "decode": 0}
    assert rows["p0"]["saturation"] == {
        "saturated": "waiting",
        "waiting_scraped": None,
        "ours_not_started": 2,
        "capacity": None,
        "waiting_limit": 2,
    }
    assert rows["d0"]["saturation"]["saturated"] is None


def test_an_engines_kv_event_stream_shows_only_with_kv_events_on() -> None:
    fleet = pure_fleet({"b0": "both", "b1": "both"})
    off = FleetConfig(model=MODEL)
    assert [
        e["kv_events"]
        for e in _engines(fleet_view(off, fleet, 0.0, admission={}, maintenance=False))
    ] == [
        None,
        None,
    ]
    on = FleetConfig(model=MODEL, kv_events=KvEventsConfig(mode="subscribe"))
    fleet.precise.stream("b1")
    rows = _engines(fleet_view(on, fleet, 0.0, admission={}, maintenance=False))
    assert rows[0]["kv_events"] == {"state": "unknown"}  # no stream yet
    assert rows[1]["kv_events"] == fleet.precise.streams["b1"].view()
