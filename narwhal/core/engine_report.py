"""An engine's own account of its load, read from its ``/metrics`` (SPEC 4.4), pure.

vLLM exports the queue it runs (``vllm:num_requests_running``), the queue it holds back
(``vllm:num_requests_waiting``), how full its KV cache is (``vllm:kv_cache_usage_perc``,
0..1 despite the name) and its prefix cache counters (``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, in tokens). Placement adds the part of that queue which is
not this router's own legs, so load from other routers and from clients that bypass this
one counts too, and our own legs count once.

The exposition is parsed with prometheus-client's parser, over the lines of these series
only: a vLLM engine exports hundreds of histogram lines placement never reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

STALE_INTERVALS = 3  # a report older than this many scrape intervals is ignored
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
CACHE_CONFIG = "vllm:cache_config_info"  # its num_gpu_blocks label: the KV cache's size
_SERIES = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, CACHE_CONFIG)
_WANTED = tuple(f"{name}{end}" for name in _SERIES for end in ("{", " ", "_total{", "_total "))


class ReportError(ValueError):
    """The text is not an engine's metrics: unparsable, or without its queue."""


@dataclass(frozen=True, slots=True)
class EngineReport:
    at: float  # trio time the scrape was answered
    running: float
    waiting: float
    kv_usage: float  # 0..1
    prefix_queries: float | None = None  # tokens looked up in the prefix cache, ever
    prefix_hits: float | None = None  # of them, found
    ours: int = 0  # this router's legs on the engine when the scrape was answered
    kv_blocks: int | None = None  # its KV cache's size in blocks (vllm:cache_config_info)

    @property
    def others(self) -> float:
        """The engine's queue that is not this router's: the engine counts our legs too,
        and they are weighed from our own count, which is never stale."""
        return max(0.0, self.queued - self.ours)

    @property
    def queued(self) -> float:
        return self.running + self.waiting

    @property
    def prefix_hit_ratio(self) -> float | None:
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries

    def fresh(self, now: float, interval_s: float) -> bool:
        return interval_s > 0 and now - self.at <= STALE_INTERVALS * interval_s

    def view(self, now: float, interval_s: float) -> dict[str, object]:
        """The operator's view (``/narwhal/engines``)."""
        ratio = self.prefix_hit_ratio
        return {
            "running": self.running,
            "waiting": self.waiting,
            "ours": self.ours,
            "kv_cache_usage": round(self.kv_usage, 4),
            "prefix_cache_hit_ratio": None if ratio is None else round(ratio, 4),
            "age_s": round(now - self.at, 3),
            "stale": not self.fresh(now, interval_s),
        }


def parse_report(text: str, at: float, ours: int = 0) -> EngineReport:
    """The report in a ``/metrics`` exposition. Several label sets of one series (vLLM's
    data-parallel ranks) add up; KV usage takes the fullest. Raise ``ReportError`` when
    the text does not parse or has no queue series."""
    lines = [line for line in text.splitlines() if line.startswith(_WANTED)]
    values: dict[str, list[float]] = {}
    blocks: list[int] = []
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG:
                    blocks.extend(_blocks(sample.labels))
                elif math.isfinite(sample.value):  # float: the parser gives an int for "3"
                    values.setdefault(sample.name.removesuffix("_total"), []).append(
                        float(sample.value)
                    )
    # the parser's ways to refuse a line, and an integer too large for a float
    except (ValueError, TypeError, IndexError, OverflowError) as exc:
        raise ReportError(f"unparsable metrics: {exc}") from None
    if RUNNING not in values and WAITING not in values:
        raise ReportError(f"no {RUNNING} or {WAITING} in the engine's metrics")

    def total(name: str) -> float | None:
        found = values.get(name)
        return None if found is None else sum(found)

    return EngineReport(
        at=at,
        running=total(RUNNING) or 0.0,
        waiting=total(WAITING) or 0.0,
        kv_usage=min(1.0, max([0.0, *values.get(KV_USAGE, ())])),
        prefix_queries=total(PREFIX_QUERIES),
        prefix_hits=total(PREFIX_HITS),
        ours=ours,
        kv_blocks=sum(blocks) if blocks else None,
    )


def _blocks(labels: dict[str, str]) -> list[int]:
    """A ``vllm:cache_config_info`` sample's ``num_gpu_blocks`` (one per data-parallel
    rank), when it is a plain count."""
    raw = labels.get("num_gpu_blocks", "")
    return [int(raw)] if raw.isdigit() and len(raw) <= 12 else []
