"""Placement is a pure function of fleet state."""

from __future__ import annotations

from narwhal.config import EngineSpec, RecoveryConfig
from narwhal.router.fleet import Fleet
from narwhal.router.placement import pick


def _fleet(*roles: str) -> Fleet:
    specs = tuple(EngineSpec(f"e{i}", f"http://h:{i + 1}", r) for i, r in enumerate(roles))  # type: ignore[arg-type]
    return Fleet(specs, RecoveryConfig())


def test_roles_decide_the_candidates() -> None:
    fleet = _fleet("prefill", "decode", "both")
    assert [e.id for e in fleet.producers] == ["e0", "e2"]
    assert [e.id for e in fleet.consumers] == ["e1", "e2"]


def test_least_in_flight_first() -> None:
    fleet = _fleet("both", "both", "both")
    fleet.engines[0].inflight["decode"] = 2
    fleet.engines[1].inflight["prefill"] = 1
    chosen = pick(fleet.engines)
    assert chosen is not None
    assert chosen.id == "e2"


def test_ties_rotate_and_prefer_another_engine_than_the_producer() -> None:
    fleet = _fleet("both", "both")
    assert [pick(fleet.engines, turn=t).id for t in range(4)] == ["e0", "e1", "e0", "e1"]  # type: ignore[union-attr]
    assert pick(fleet.engines, turn=0, prefer_not="e0").id == "e1"  # type: ignore[union-attr]


def test_avoided_engines_only_when_nothing_else_is_left() -> None:
    fleet = _fleet("both", "both")
    fleet.engines[1].inflight["decode"] = 5
    assert pick(fleet.engines, avoid={"e0"}).id == "e1"  # type: ignore[union-attr]
    assert pick(fleet.engines, avoid={"e0", "e1"}).id == "e0"  # type: ignore[union-attr]
    assert pick([]) is None


async def test_reservations_release_on_every_exit_path() -> None:
    fleet = _fleet("both")
    engine = fleet.engines[0]
    async with fleet.reserve(engine, "prefill"):
        assert engine.inflight == {"prefill": 1, "decode": 0}
    try:
        async with fleet.reserve(engine, "decode"):
            raise RuntimeError("leg failed")
    except RuntimeError:
        pass
    assert fleet.reserved() == 0
