"""An engine's own account of its load, read from its ``/metrics`` (contract 4.4), pure.

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
# the adapters it runs and waits on, and its slots: one series per change of them, the
# newest (its value is when it was set) the one that holds
LORA_INFO = "vllm:lora_requests_info"
_SERIES = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, CACHE_CONFIG, LORA_INFO)
MAX_ADAPTER_LABEL = 64 * 1024  # a label of adapter names: more is not a list of them
_WANTED = tuple(f"{name}{end}" for name in _SERIES for end in ("{", " ", "_total{", "_total "))


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """Its LoRA adapters, as its newest ``vllm:lora_requests_info`` series says."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int

    @property
    def loaded(self) -> frozenset[str]:
        """The adapters in its slots (or about to be): those its requests run or wait on."""
        return self.running | self.waiting

    def view(self) -> dict[str, object]:
        return {
            "running": sorted(self.running),
            "waiting": sorted(self.waiting),
            "max_lora": self.max_lora,
        }


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
    lora: LoraInfo | None = None  # None: it exports no adapter series (LoRA off)

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
            "lora": None if self.lora is None else self.lora.view(),
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
    lora: tuple[float, LoraInfo] | None = None
    try:
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG:
                    blocks.extend(_blocks(sample.labels))
                elif sample.name == LORA_INFO:
                    info = _lora(sample.labels)
                    newest = lora is None or sample.value >= lora[0]
                    if info is not None and math.isfinite(sample.value) and newest:
                        lora = (sample.value, info)
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
        lora=None if lora is None else lora[1],
    )


def _lora(labels: dict[str, str]) -> LoraInfo | None:
    """A ``vllm:lora_requests_info`` sample's adapters and slots (None: not that series)."""
    raw = labels.get("max_lora", "")
    if not raw.isdigit() or len(raw) > 6:
        return None
    names = []
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        label = labels.get(key, "")
        if len(label) > MAX_ADAPTER_LABEL:
            return None
        names.append(frozenset(n for n in label.split(",") if n))
    return LoraInfo(names[0], names[1], int(raw))


def _blocks(labels: dict[str, str]) -> list[int]:
    """A ``vllm:cache_config_info`` sample's ``num_gpu_blocks`` (one per data-parallel
    rank), when it is a plain count."""
    raw = labels.get("num_gpu_blocks", "")
    return [int(raw)] if raw.isdigit() and len(raw) <= 12 else []
