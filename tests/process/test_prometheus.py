"""A real Prometheus scrapes a router under load and answers every query we ship.

Debian's ``prometheus`` server runs on loopback with deploy/alerts.yml as its rule file,
scraping a router (fake engines behind it) every second while requests stream, fail (503
faults on one consumer, which its breaker ejects and readmits) and hang up. Then every
panel query of deploy/grafana-dashboard.json goes through Prometheus's HTTP API and must
succeed with data, and every alert rule must be loaded, evaluated without error and
answer its own expression through the query API. `promtool check rules` and `promtool
check metrics` run in tests/process/test_deploy.py; here promtool also lints the scrape taken
under this load, which has the error, retry and ejection series an idle scrape lacks.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpcore
import msgspec
import pytest
import trio
import yaml

from narwhal.core.config import RecoveryConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.deploy import (
    ALERTS,
    alert_job,
    alert_rules,
    lint_exposition,
    prometheus_tool,
    promtool,
)
from tests.support.fleet import MODEL, Harness, finish, start_fleet
from tests.support.paths import ROOT

pytestmark = pytest.mark.obs

DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
# Grafana's variables, as Grafana would fill them at a 1 s scrape interval
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}


def dashboard_queries() -> list[str]:
    def walk(panels: list[dict[str, Any]]) -> list[str]:
        found = []
        for panel in panels:
            found += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
            found += walk(panel.get("panels", []))
        return found

    return walk(json.loads(DASHBOARD.read_text())["panels"])


def grafana_expand(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable this test does not fill: {expr}"
    return expr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PromAPI:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpcore.AsyncConnectionPool()

    async def get(self, path: str, **params: str) -> Any:
        query = f"?{urlencode(params)}" if params else ""
        resp = await self.http.request("GET", f"{self.url}{path}{query}")
        reply = msgspec.json.decode(resp.content)
        assert resp.status == 200, (path, params, reply)
        assert reply["status"] == "success", (path, params, reply)
        return reply["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result


async def load(harness: Harness, until: trio.Event) -> dict[int, int]:
    """Requests until ``until`` (at most 60 s): streamed and not, 503s from d0's decode
    legs (retried on d1, then d0 ejected, probed, readmitted), rounds where every prefill
    leg gets a 503 (the clients get 502s), a 404, and clients that hang up mid-stream."""
    statuses: dict[int, int] = {}
    host, port = harness.url.removeprefix("http://").rsplit(":", 1)

    async def one(stream: bool) -> None:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
        status = (await harness.post("/v1/completions", body)).status
        statuses[status] = statuses.get(status, 0) + 1

    async def hang_up() -> None:
        body = msgspec.json.encode(
            {"model": MODEL, "prompt": "hi", "max_tokens": 2000, "stream": True}
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        conn = await trio.open_tcp_stream(host, int(port))
        await conn.send_all(head.encode() + body)
        await conn.receive_some(4096)  # the headers and the first tokens, then gone
        await conn.aclose()

    with trio.move_on_after(60):
        round_ = 0
        while not until.is_set():
            round_ += 1
            if round_ % 3 == 1:  # in a row: d0's streak ejects it, the retry goes to d1
                for _ in range(3):
                    harness.engines["d0"].faults.push(
                        Fault(kind="status", status=503, leg="decode")
                    )
            if round_ % 5 == 2:  # every attempt of this round's requests: 5xx to clients
                for _ in range(14):
                    harness.engines["p0"].faults.push(
                        Fault(kind="status", status=503, leg="prefill")
                    )
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i % 2 == 0)
                nursery.start_soon(hang_up)
            assert (await harness.post("/v1/completions", {"model": "x"})).status in (400, 404)
            await trio.sleep(0.1)
    return statuses


async def test_prometheus_answers_every_dashboard_query_and_alert(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    binary = prometheus_tool("prometheus")
    promtool()  # both binaries are found (or the test stops) before anything starts
    started = time.monotonic()
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode", "d1": "decode"},
        engine_config={"itl_s": 0.002},
        serving=ServingConfig(graceful_timeout_s=0.5, max_attempts=2, retry_budget=1000.0),
        recovery=RecoveryConfig(eject_after=2, readmit_interval_s=1.0),
    )
    target = harness.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": alert_job(), "static_configs": [{"targets": [target]}]},
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    server = await trio.lowlevel.open_process(
        [
            binary,
            f"--config.file={config_file}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = PromAPI(f"http://127.0.0.1:{port}")
    stop_load, load_done = trio.Event(), trio.Event()
    try:
        loaded: dict[str, dict[int, int]] = {}

        async def run_load() -> None:
            loaded["statuses"] = await load(harness, stop_load)
            load_done.set()

        nursery.start_soon(run_load)
        # up, and enough scrapes that every rate() has two samples of every series
        with trio.fail_after(60):
            while True:
                await trio.sleep(0.5)
                assert server.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    targets = await api.get("/api/v1/targets")
                except httpcore.ConnectError:
                    continue
                health = [t["health"] for t in targets["activeTargets"]]
                ejected = await api.query("max_over_time(narwhal_engine_ejected[1m]) == 1")
                scrapes = await api.query('count_over_time(up{job="narwhal"}[1m])')
                if health == ["up"] and ejected and float(scrapes[0]["value"][1]) >= 5:
                    break
        # promtool lints a scrape taken under this load
        linted = await lint_exposition((await harness.get("/metrics")).body)
        assert linted == (0, ""), linted

        assert await api.query('narwhal_requests_total{status=~"5.."} > 0')
        empty = []
        queries = dashboard_queries()
        for expr in queries:
            if not await api.query(grafana_expand(expr)):
                empty.append(expr)
        assert not empty, f"dashboard queries with no data under load: {empty}"

        rules = alert_rules()
        loaded_rules = {
            r["name"]: r
            for group in (await api.get("/api/v1/rules"))["groups"]
            for r in group["rules"]
        }
        assert set(loaded_rules) == {r["alert"] for r in rules}
        for name, rule in loaded_rules.items():
            assert rule["health"] == "ok", (name, rule.get("lastError"))
        for rule in rules:
            await api.query(rule["expr"])  # success, data or not (an alert is quiet)
        stop_load.set()
        seconds = time.monotonic() - started
        print(f"{len(queries)} queries, {len(rules)} rules answered after {seconds:.1f} s")
    finally:
        stop_load.set()
        server.terminate()
        with trio.move_on_after(10):
            await server.wait()
        if server.returncode is None:
            server.kill()
            await server.wait()
        log.close()
        await api.http.aclose()
    with trio.fail_after(65):
        await load_done.wait()
    statuses = loaded["statuses"]
    assert statuses.get(200, 0) > 0, statuses
    assert sum(n for status, n in statuses.items() if status >= 500) > 0, statuses
    await finish(harness, disconnects=harness.router.disconnects)
