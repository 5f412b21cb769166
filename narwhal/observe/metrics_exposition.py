"""The exposition text of ``GET /metrics``: one process's registry, or under ``--workers N``
every worker's files summed (prometheus-client's multiprocess mode), without the series of
engines that left the fleet and with each batched histogram as the histogram it stands for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

from narwhal.observe.batched_histogram import BatchedHistogram


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def exposition(
    own: CollectorRegistry, engines: frozenset[str], batched: Sequence[BatchedHistogram]
) -> bytes:
    """The exposition text of this process's registry ``own``; under multiprocess mode,
    summed over every worker, without the engines not in ``engines``."""
    directory = multiprocess_dir()
    if directory is None:
        return generate_latest(own)
    registry = CollectorRegistry()
    collector = multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    # the workers' files cannot forget a label set: an engine that left the fleet is
    # dropped here, as remove_engine drops it from a single process's registry
    registry.unregister(collector)
    histograms = _AsHistograms(collector, batched)
    registry.register(_CurrentEngines(histograms, engines))
    return generate_latest(registry)


class _CurrentEngines:
    """A collector's metrics without the samples of engines no longer in the fleet."""

    def __init__(self, inner: Any, engines: frozenset[str]) -> None:
        self.inner = inner
        self.engines = engines

    def collect(self) -> Iterable[Any]:
        for metric in self.inner.collect():
            metric.samples = [
                sample
                for sample in metric.samples
                if "engine" not in sample.labels or sample.labels["engine"] in self.engines
            ]
            yield metric


class _AsHistograms:
    """A collector's metrics with each batched histogram's summed counter (its name, type
    counter) as that histogram's family."""

    def __init__(self, inner: Any, batched: Iterable[BatchedHistogram]) -> None:
        self.inner = inner
        self.batched = {histogram.name: histogram for histogram in batched}

    def collect(self) -> Iterator[Any]:
        for metric in self.inner.collect():
            histogram = self.batched.get(metric.name)
            if histogram is None or metric.type != "counter":
                yield metric
                continue
            values = {sample.labels["le"]: sample.value for sample in metric.samples}
            yield histogram.histogram_of(values, sum_first=True)
