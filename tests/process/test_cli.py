"""The standalone binaries: `narwhal fake-engine` twice, `narwhal serve` on the example fleet."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.processes import fake_fleet, run_narwhal, running


def test_serve_the_example_fleet_in_front_of_fake_engines(tmp_path: Path) -> None:
    with (
        running("fake-engine", "--port", "0", "--role", "prefill") as (_, p_url),
        running("fake-engine", "--port", "0", "--role", "decode") as (_, d_url),
    ):
        fleet = (ROOT / "examples" / "fleet.toml").read_text()
        fleet = fleet.replace("http://127.0.0.1:8101", p_url).replace(
            "http://127.0.0.1:8102", d_url
        )
        path = tmp_path / "fleet.toml"
        path.write_text(fleet)
        journal = tmp_path / "journal.jsonl"
        with running("serve", "--config", str(path), "--port", "0", "--journal", str(journal)) as (
            _,
            url,
        ):
            request = urllib.request.Request(
                url + "/v1/completions",
                data=json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 3}).encode(),
                headers={"content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=20) as resp:
                body = json.loads(resp.read())
                assert resp.headers["x-request-id"]
            assert body["usage"]["completion_tokens"] == 3
            with urllib.request.urlopen(d_url + "/fake/stats", timeout=20) as resp:
                assert json.loads(resp.read())["counters"]["kv_pull_ok"] == 1
            bad = urllib.request.Request(
                url + "/v1/completions",
                data=b'{"model": "other", "prompt": "x"}',
                headers={"content-type": "application/json"},
            )
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(bad, timeout=20)
            assert info.value.code == 404
            info.value.close()
        # one JSON line per request, written as each finished; engine events between them
        everything = [json.loads(line) for line in journal.read_text().splitlines()]
        assert sorted(e["engine"] for e in everything if e.get("event") == "joined") == ["d0", "p0"]
        lines = [x for x in everything if "event" not in x]
        assert [(x["outcome"], x["status"]) for x in lines] == [
            ("completed", 200),
            ("rejected", 404),
        ]
        assert lines[0]["attempts"] == [
            {"number": 1, "producer": "p0", "consumer": "d0", "handoff": "decoded"}
        ]
        assert lines[0]["tokens"] == 3
        assert 0 < lines[0]["prefill_s"] <= lines[0]["first_byte_s"] <= lines[0]["duration_s"]
        # the compatibility field: the same value, right after the field that names it well
        fields = list(lines[0])
        assert fields[fields.index("prefill_s") + 1] == "ttft_s"
        assert lines[0]["ttft_s"] == lines[0]["prefill_s"]


def test_check_on_the_command_line(tmp_path: Path) -> None:
    with fake_fleet(tmp_path, '[engine_contract]\nengine_version = "0.32.0"\n') as fleet:
        ok = run_narwhal("check", "--config", str(fleet))
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert "p0 -> d0 moved KV, 4 tokens, first token" in ok.stdout
        assert ok.stdout.splitlines()[-1] == "PASS: 2/2 engines ok, 1/1 transfers moved KV"
    # the engines are gone now: clear lines, exit 1, no traceback
    down = run_narwhal("check", "--config", str(fleet))
    assert down.returncode == 1
    assert "Traceback" not in down.stdout + down.stderr
    assert "p0 (prefill, " in down.stdout
    assert "unreachable: cannot connect to engine" in down.stdout
    assert "p0 -> d0 skipped" in down.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "m"\n')
    refused = run_narwhal("check", "--config", str(bad))
    assert refused.returncode == 2
    assert "engines: required" in refused.stderr


def test_metrics_are_summed_over_workers(tmp_path: Path) -> None:
    with (
        fake_fleet(tmp_path) as fleet,
        running("serve", "--config", str(fleet), "--port", "0", "--workers", "2") as (_, url),
    ):
        for _ in range(30):  # a new connection each: the kernel spreads them over workers
            request = urllib.request.Request(
                url + "/v1/completions",
                data=b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2}',
                headers={"content-type": "application/json", "connection": "close"},
            )
            with urllib.request.urlopen(request, timeout=20) as resp:
                assert resp.status == 200
        # a request is counted as its handler ends, just after its last byte: the first
        # scrapes may miss the last request; from then on every scrape, whichever worker
        # answers it, reports all 30
        counts = [_completed(url) for _ in range(50)]
        assert 30.0 in counts
        first = counts.index(30.0)
        assert counts[first:] == [30.0] * (50 - first)


def _completed(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=20) as resp:
        text = resp.read().decode()
    line = next(
        x
        for x in text.splitlines()
        if x.startswith("narwhal_requests_total{")
        and 'outcome="completed"' in x
        and 'endpoint="completions"' in x
    )
    return float(line.rsplit(" ", 1)[1])
