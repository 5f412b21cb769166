"""The fast part of the fault matrix: every scenario, a few requests each (``make faults``
runs 200 per scenario at concurrency 32)."""

from __future__ import annotations

import pytest

from tests.matrix.fault_matrix import SCENARIOS, Scenario, run_scenario, table


def test_the_matrix_has_the_scenarios_issue_6_names() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) >= 25
    assert sum(n.startswith("bad descriptor") for n in names) >= 10


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name.replace(" ", "-"))
async def test_every_invariant_holds(scenario: Scenario) -> None:
    report = await run_scenario(scenario, requests=16, concurrency=8)
    assert report.passed, table([report])
