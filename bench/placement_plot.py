"""Plot TTFT p50 and p99 per policy per workload from a results JSON written by
bench/placement.py. Runs with the peers venv's Python (it has matplotlib).

    .bench-venv/bin/python bench/placement_plot.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OURS = ("round_robin", "least_loaded", "least_loaded+affinity")


def main() -> None:
    with open(sys.argv[1]) as f:
        rows = json.load(f)["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        mine = [r for r in rows if r["workload"] == workload]
        names = [r["target"] for r in mine]
        xs = range(len(mine))
        colours = ["#0f766e" if n.startswith(OURS) else "#94a3b8" for n in names]
        ax.bar([x - 0.2 for x in xs], [r["ttft_p50_ms"] or 0 for r in mine], 0.4, color=colours)
        ax.bar(
            [x + 0.2 for x in xs],
            [r["ttft_p99_ms"] or 0 for r in mine],
            0.4,
            color=colours,
            alpha=0.45,
            hatch="//",
        )
        ax.set_xticks(list(xs), names, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT ms (solid p50, hatched p99; log scale)")
        ax.set_title(workload)
    fig.suptitle("Placement policies over the same fake fleet (2 producers, 2 consumers)")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
