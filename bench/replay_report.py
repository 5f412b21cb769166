"""What bench/replay_trace.py reports, sans I/O: one run's figures from its clients'
outcomes and its engines' counters, and the markdown table with each figure's ratio to the
best peer of the same (fleet, load)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    at_s: float  # scheduled send, from the replay's start
    tokens: int  # max_tokens asked
    status: str  # "ok", "HTTP 429", "stream ended without [DONE]", "timeout", ...
    ttft_s: float | None = None  # send to the first streamed event
    e2e_s: float | None = None  # send to the stream's end

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, for a whole stream of two or more."""
        if self.status != "ok" or self.ttft_s is None or self.e2e_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


# the /fake/stats counters a run reads, before and after its replay
COUNTERS = ("prompt_tokens", "prompt_tokens_computed", "kv_blocks_pulled", "kv_transfers")


def engine_delta(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Each engine's counters and prefix-cache queries and hits over the replay (the
    warm-up taken out)."""
    out = {}
    for name, now in after.items():
        was = before[name]
        row = {c: now["counters"].get(c, 0) - was["counters"].get(c, 0) for c in COUNTERS}
        for c in ("queries", "hits"):
            row[f"cache_{c}"] = now["prefix_cache"][c] - was["prefix_cache"][c]
        out[name] = row
    return out


def pct(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (bench/peers.py's)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass
class Run:
    target: str
    outcomes: list[Outcome] = field(default_factory=list)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)
    router_cpu_s: float | None = None
    wall_s: float = 0.0
    note: str = ""
    # ours: the median of observed / predicted TTFT over the run (policy "predicted")
    prediction: float | None = None
    slo: tuple[float, float] | None = None  # (TTFT s, TPOT s) a request must meet

    def attained(self) -> float | None:
        """The share of sent requests that met both targets (a failure met neither)."""
        if self.slo is None or not self.outcomes:
            return None
        ttft_s, tpot_s = self.slo
        met = sum(
            1
            for o in self.outcomes
            if o.status == "ok"
            and o.ttft_s is not None
            and o.ttft_s <= ttft_s
            and (o.tpot_s is None or o.tpot_s <= tpot_s)
        )
        return met / len(self.outcomes)

    def failures(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.status != "ok":
                out[o.status] = out.get(o.status, 0) + 1
        return dict(sorted(out.items()))

    def summary(self, prefilling: list[str], fleet: str, load: float) -> dict[str, Any]:
        """The row of this run: ``prefilling`` names the engines whose computed tokens are
        the work split and whose caches give the hit rate."""
        ok = [o for o in self.outcomes if o.status == "ok"]
        ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
        tpot = [t for o in ok if (t := o.tpot_s) is not None]
        computed = {
            n: self.engines[n]["prompt_tokens_computed"] for n in prefilling if n in self.engines
        }
        total = sum(computed.values())
        queries = sum(self.engines[n]["cache_queries"] for n in computed)
        hits = sum(self.engines[n]["cache_hits"] for n in computed)
        everywhere = sum(e["prompt_tokens_computed"] for e in self.engines.values())
        sent = len(self.outcomes)
        return {
            "fleet": fleet,
            "load": load,
            "target": self.target,
            "sent": sent,
            "ok": len(ok),
            "failed": sent - len(ok),
            "failures": self.failures(),
            "ttft_p50_s": _round(pct(ttft, 0.5), 3),
            "ttft_p90_s": _round(pct(ttft, 0.9), 3),
            "ttft_p99_s": _round(pct(ttft, 0.99), 3),
            "tpot_p50_ms": _round(None if not tpot else 1000 * (pct(tpot, 0.5) or 0.0), 1),
            "work_split": {n: round(v / total, 3) for n, v in computed.items()} if total else {},
            "computed_tokens": total,
            "computed_tokens_all_engines": everywhere,
            "hit_rate": _round(hits / queries if queries else None, 4),
            "kv_blocks_pulled": sum(e["kv_blocks_pulled"] for e in self.engines.values()),
            "router_cpu_s": _round(self.router_cpu_s, 2),
            "cpu_ms_per_request": _round(
                None if self.router_cpu_s is None or not sent else 1000 * self.router_cpu_s / sent,
                3,
            ),
            "wall_s": round(self.wall_s, 1),
            "slo_attained": _round(self.attained(), 3),
            "prediction_median": _round(self.prediction, 3),
            "note": self.note,
        }


def histogram_median(metrics_text: str, name: str, labels: str) -> float | None:
    """The median of a Prometheus histogram's samples whose label text holds ``labels``,
    summed over the other labels, interpolated within its bucket (None: no samples)."""
    cumulative: dict[float, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(name + "_bucket{") or labels not in line:
            continue
        le = line.split('le="', 1)[1].split('"', 1)[0]
        bound = math.inf if le == "+Inf" else float(le)
        cumulative[bound] = cumulative.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    total = cumulative.get(math.inf, 0.0)
    if not total:
        return None
    lower, below = 0.0, 0.0
    for bound in sorted(cumulative):
        count = cumulative[bound]
        if count >= total / 2:
            if bound == math.inf or count == below:
                return lower
            return lower + (bound - lower) * (total / 2 - below) / (count - below)
        lower, below = bound, count
    return None


def progress(row: dict[str, Any]) -> str:
    """One line on stderr per run, while the bench goes on."""
    return (
        f"{row['fleet']:4} load={row['load']} {row['target']:26} sent={row['sent']} "
        f"failed={row['failed']} ttft p50/p90/p99={row['ttft_p50_s']}/{row['ttft_p90_s']}/"
        f"{row['ttft_p99_s']} s tpot={row['tpot_p50_ms']} ms split={row['work_split']} "
        f"hit={row['hit_rate']} cpu/req={row['cpu_ms_per_request']} ms "
        f"slo={row['slo_attained']} obs/pred={row['prediction_median']} {row['note']}"
    )


# (column, row key, digits): the figures that get a ratio to the best peer
RATIOED = (
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p90", "ttft_p90_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("TPOT p50", "tpot_p50_ms"),
    ("CPU/req", "cpu_ms_per_request"),
)


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def best_peer(rows: list[dict[str, Any]], key: str, peers: Sequence[str]) -> float | None:
    """The lowest of ``peers``' values of ``key`` (a peer that failed every request, or did
    not run, has none)."""
    values = [r[key] for r in rows if r["target"] in peers and r[key] is not None and r["ok"]]
    return min(values) if values else None


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _split(row: dict[str, Any]) -> str:
    return " / ".join(f"{v:.2f}" for v in row["work_split"].values()) or "—"


def _failures(row: dict[str, Any]) -> str:
    if not row["failed"]:
        return "0"
    kinds = ", ".join(f"{k} x{v}" for k, v in row["failures"].items())
    return f"{row['failed']} ({kinds})"


def table(rows: list[dict[str, Any]], ideal: int, peers: Sequence[str]) -> str:
    """One (fleet, load)'s rows: the figures, then the ratios to the best peer."""
    head = (
        "| router | sent | failed | TTFT p50 s | p90 s | p99 s | TPOT p50 ms | prefill split "
        "| work / ideal | cache hit rate | router CPU ms/req | SLO met | TTFT obs/pred p50 "
        "| note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        work = r["computed_tokens"] / ideal if ideal and r["computed_tokens"] else None
        hit = None if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
        lines.append(
            f"| {r['target']} | {r['sent']} | {_failures(r)} | {_f(r['ttft_p50_s'])} "
            f"| {_f(r['ttft_p90_s'])} | {_f(r['ttft_p99_s'])} | {_f(r['tpot_p50_ms'], 1)} "
            f"| {_split(r)} | {_f(work, 2)} | {hit or '—'} | {_f(r['cpu_ms_per_request'], 2)} "
            f"| {_share(r['slo_attained'])} | {_f(r['prediction_median'], 2)} | {r['note']} |"
        )
    best = {key: best_peer(rows, key, peers) for _, key in RATIOED}
    lines += [
        "",
        f"Ratios to the best of {' and '.join(peers)} in this run (lower is better):",
        "",
        "| router | " + " | ".join(label for label, _ in RATIOED) + " |",
        "|---|" + "---|" * len(RATIOED),
    ]
    for r in rows:
        cells = []
        for _, key in RATIOED:
            value, base = r[key], best[key]
            cells.append(
                "—" if value is None or not base or not r["ok"] else f"{value / base:.2f}x"
            )
        lines.append(f"| {r['target']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BOTH_NOTE = (
    "Every engine computes prompts here, so the work split and the hit rate cover all four; "
    "the hit rate counts every lookup, a decode leg's before its KV pull included (a router "
    "that sends both legs to different engines looks a prompt up twice, one that sends the "
    "request whole once): compare work / ideal across routers."
)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], peers: Sequence[str]) -> str:
    work = meta["work"]
    parts = [
        f"# Trace replay, {meta['trace']}, {meta['date']}",
        "",
        f"Command: `{meta['command']}`. Machine: {meta['machine']}; {meta['seconds']} s in all.",
        f"Slice: minutes {meta['window'][0]:g} to {meta['window'][0] + meta['window'][1]:g} of "
        f"the trace, {meta['requests']} requests, replayed at {meta['speedup']:g}x; every "
        f"length x {meta['scale_tokens']:g} (a 512-token block is "
        f"{round(512 * meta['scale_tokens'])} words), outputs capped at {meta['output_cap']} "
        f"trace tokens before scaling. Prompt tokens {work['prompt_tokens']:,}; an ideal "
        f"router computes {work['ideal_computed']:,} (hit rate {meta['ideal_hit_rate']:.1%}); "
        f"working set {work['working_set_blocks']:,} 16-token blocks.",
    ]
    for setup in meta["setups"]:
        mine = [r for r in rows if r["fleet"] == setup["fleet"] and r["load"] == setup["load"]]
        parts += [
            "",
            f"## Fleet {setup['fleet']}, load {setup['load']:g}",
            "",
            f"Engines: {setup['prefill_ms']:.4f} ms per prompt token not cached, prefix cache "
            f"{setup['cache_blocks']:,} blocks each, KV pull {setup['kv_ms_per_block']:.4f} ms "
            f"per block + 5 ms, {1000 * setup['itl_s']:.0f} ms between streamed tokens alone "
            f"x (1 + {setup['batch_growth']:g} x other streams), KV cache "
            f"{setup['kv_blocks']:,} blocks.",
            *([BOTH_NOTE] if setup["fleet"] == "both" else []),
            "",
            table(mine, work["ideal_computed"], peers),
        ]
    return "\n".join(parts)
