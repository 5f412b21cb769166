"""Histograms observed per token and added per request: ``BatchedHistogram``, exported as
the ``Histogram`` prometheus-client would export, and ``RequestBuckets``, one request's
counts of it, added once (the per-token path takes no lock and calls no metric).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
)
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import INF, floatToGoString


class BatchedHistogram(Collector):
    """An unlabelled histogram whose observations come in batches (``RequestBuckets``),
    through prometheus-client's public API: its counts are the children of a counter (one
    per bucket, and ``le="sum"`` for the sum) kept out of every registry, and as a
    collector it exports them as the histogram family a ``Histogram`` exports, the same
    bytes (``_bucket``, ``_count``, ``_sum``, ``_created``). Under multiprocess mode the
    counts are in the workers' files as every value is, and ``Metrics.render`` turns the
    summed counter into the same histogram family (``histogram_of``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        registry: CollectorRegistry | None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        # the upper bounds, +Inf last, as a Histogram makes them
        self.bounds = [*map(float, buckets), *([] if buckets[-1] == INF else [INF])]
        self._les = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]
        self._counter = Counter(name, documentation, ("le",), registry=None)
        self._per_bucket = [self._counter.labels(le) for le in self._les]
        self._total = self._counter.labels("sum")
        self._since = time.time()  # the family's _created, as a Histogram's
        if registry is not None:
            registry.register(self)

    def add(self, counts: Sequence[int], total: float) -> None:
        """``counts[i]`` observations in the bucket of ``bounds[i]``, summing ``total``."""
        for bucket, count in zip(self._per_bucket, counts, strict=True):
            if count:
                bucket.inc(count)
        self._total.inc(total)

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation)]

    def collect(self) -> Iterable[Metric]:
        values: dict[str, float] = {}
        created = False  # whether the counter says _created series are exported
        for metric in self._counter.collect():
            for sample in metric.samples:
                if sample.name == self.name + "_total":
                    values[sample.labels["le"]] = sample.value
                else:
                    created = True
        family = self.histogram_of(values)
        if created:
            family.add_sample(self.name + "_created", {}, self._since)
        return [family]

    def histogram_of(self, values: dict[str, float], *, sum_first: bool = False) -> Metric:
        """The histogram family of the counts ``values`` (by ``le``; the sum at
        ``"sum"``): as a ``Histogram`` collects it, or with ``sum_first``, as prometheus-
        client's multiprocess collector merges a histogram's files (its order)."""
        total = values.get("sum", 0.0)
        cumulative, count = [], 0.0
        for le in self._les:
            count += values.get(le, 0.0)
            cumulative.append((le, count))
        if not sum_first:
            return HistogramMetricFamily(
                self.name, self.documentation, buckets=cumulative, sum_value=total
            )
        family = Metric(self.name, self.documentation, "histogram")
        family.add_sample(self.name + "_sum", {}, total)
        for le, value in cumulative:
            family.add_sample(self.name + "_bucket", {"le": le}, value)
        family.add_sample(self.name + "_count", {}, count)
        return family


class RequestBuckets:
    """One request's observations of a histogram, counted here and added to it once
    (``flush``): the per-token path takes no lock and calls no metric
    (``bench/results/relay-reactor.md``). Each observation lands in the bucket
    prometheus-client's ``observe`` would pick (the first
    upper bound it does not exceed)."""

    __slots__ = ("_bounds", "_counts", "_histogram", "_sum")

    def __init__(self, histogram: BatchedHistogram) -> None:
        self._histogram = histogram
        self._bounds = histogram.bounds
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def add(self, total: float, k: int = 1) -> None:
        """``k`` observations of ``total / k`` each (tokens that came in one read)."""
        self._counts[bisect_left(self._bounds, total / k)] += k
        self._sum += total

    def flush(self) -> None:
        """Add the counts to the histogram (nothing when nothing was observed); idempotent."""
        counts = self._counts
        if not any(counts):
            return
        self._histogram.add(counts, self._sum)
        self._counts = [0] * len(counts)
        self._sum = 0.0
