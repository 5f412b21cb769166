"""The inter-token latency histogram, added to once per request through prometheus-client's
public API (``narwhal.observe.batched_histogram.BatchedHistogram``), is exported as the
``Histogram`` it stands for would be, byte for byte, when a scrape sums the workers of
``--workers N`` (prometheus-client's multiprocess mode, chosen when the interpreter starts:
each side runs in a fresh one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from narwhal.observe.metrics import Metrics

GAPS = "[0.0004, 0.003, 0.003, 0.07, 0.2, 1.5, 7.0, 0.0125]"  # one read each: one request

OURS = f"""
from narwhal.observe.batched_histogram import RequestBuckets
from narwhal.observe.metrics import Metrics
metrics = Metrics(["e0"], model="m")
gaps = RequestBuckets(metrics.token_gap)
for gap in {GAPS}:
    gaps.add(gap)
gaps.flush()
print(metrics.render().decode(), end="")
"""

THEIRS = f"""
import os
from prometheus_client import CollectorRegistry, Histogram, generate_latest, multiprocess
from narwhal.observe.metric_series import GAP_BUCKETS
histogram = Histogram(
    "narwhal_inter_token_latency_seconds",
    {Metrics([]).token_gap.documentation!r},
    buckets=GAP_BUCKETS,
    registry=None,
)
for gap in {GAPS}:
    histogram.observe(gap)
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
print(generate_latest(registry).decode(), end="")
"""

NAME = "narwhal_inter_token_latency_seconds"


def family(exposition: str) -> list[str]:
    """The histogram's lines: its HELP and TYPE, and its samples."""
    lines = exposition.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# HELP {NAME} "))
    end = next((i for i in range(start + 2, len(lines)) if lines[i].startswith("# ")), len(lines))
    return lines[start:end]


def scrape(program: str, folder: Path) -> str:
    folder.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_batched_histogram_sums_over_workers_as_a_histogram_does(tmp_path: Path) -> None:
    ours = family(scrape(OURS, tmp_path / "ours"))
    theirs = family(scrape(THEIRS, tmp_path / "theirs"))
    assert ours[1] == f"# TYPE {NAME} histogram"
    assert f'{NAME}_bucket{{le="0.005"}} 3.0' in ours  # 0.0004, and 0.003 twice
    assert f"{NAME}_count 8.0" in ours
    assert ours == theirs
