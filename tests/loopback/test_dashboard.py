"""Every query of the shipped Grafana dashboard names metrics the router really exports."""

from __future__ import annotations

import json
import re

import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fleet import finish, start_fleet
from tests.support.paths import ROOT

DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "increase",
    "histogram_quantile",
    "le",
    "on",
    "without",
    "max",
    "min",
    "avg",
}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # by (engine, phase)
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in PROMQL_WORDS}


async def test_dashboard_queries_name_exported_metrics(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    for engine in harness.router.fleet.engines:  # the engines' own queues, scraped once
        assert await harness.router.scraper.scrape(engine)
    text = (await harness.get("/metrics")).body.decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.update(sample.name for sample in family.samples)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) >= 14
    for expr in queries:
        names = _metric_names(expr)
        assert names, expr
        assert names <= exported, f"{expr}: {names - exported} not exported"
    await finish(harness)
