"""Plot TTFT per target per workload from a results JSON written by bench/placement.py.
Runs with the peers venv's Python (it has matplotlib).

    .bench-venv/bin/python bench/placement_plot.py RESULTS.json OUT.png

One panel per workload: TTFT p50 (solid) and p99 (hatched) per target; for the conditional
workloads also ITL p99 of running decodes (dotted), and for short prompts the figures its
targets judge: the short prompts' TTFT p50 and the long prompts' TTFT p99. A target that was
not measured gets an empty slot and says so under its bars.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OURS = ("round_robin", "least_loaded", "always-P/D", "conditional")


def bars(row: dict[str, Any]) -> list[tuple[str, float | None, dict[str, Any]]]:
    """(label, ms, style) of each bar of one target."""
    p50, p99 = "ttft_p50_ms", "ttft_p99_ms"
    if row.get("ttft_short_p50_ms") is not None or row.get("ttft_long_p99_ms") is not None:
        p50, p99 = "ttft_short_p50_ms", "ttft_long_p99_ms"
    out = [
        ("TTFT p50" if p50 == "ttft_p50_ms" else "short TTFT p50", row.get(p50), {}),
        (
            "TTFT p99" if p99 == "ttft_p99_ms" else "long TTFT p99",
            row.get(p99),
            {"alpha": 0.45, "hatch": "//"},
        ),
    ]
    if row.get("conditional"):
        out.append(("ITL p99", row.get("itl_p99_ms"), {"alpha": 0.3, "hatch": ".."}))
    return out


def panel(ax: Any, workload: str, mine: list[dict[str, Any]]) -> None:
    names = [r["target"] for r in mine]
    width = 0.8 / max(len(bars(r)) for r in mine)
    for x, row in enumerate(mine):
        colour = "#0f766e" if row["target"].startswith(OURS) else "#94a3b8"
        shown = bars(row)
        for i, (label, value, style) in enumerate(shown):
            offset = (i - (len(shown) - 1) / 2) * width
            ax.bar(
                x + offset,
                value or 0,
                width,
                color=colour,
                label=label if x == 0 else None,
                **style,
            )
        if all(value is None for _, value, _ in shown):
            # x in data, y in axes units: the log axis has no room at 0
            ax.text(
                x,
                0.03,
                "not measured",
                rotation=90,
                ha="center",
                va="bottom",
                fontsize=7,
                transform=ax.get_xaxis_transform(),
            )
    ax.set_xticks(list(range(len(mine))), names, rotation=35, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log scale)")
    ax.set_title(workload)
    ax.legend(fontsize=7)


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = json.load(f)["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.6 * len(workloads), 4.8), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        panel(ax, workload, [r for r in rows if r["workload"] == workload])
    fig.suptitle("Placement over the same fake fleet (2 producers, 2 consumers)", fontsize=10)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
