"""The plot of bench/overload.py's results: per target, each class's TTFT p99 in every
phase (log scale), and goodput by class. Run with the peers venv's matplotlib.

    python bench/overload_plot.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

CLASSES = ("interactive", "default", "batch")


def main(results: str, out: str) -> None:
    with open(results) as f:
        data = json.load(f)
    rows, phases = data["rows"], [p[0] for p in data["meta"]["phases"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        xs = [
            c * (len(phases) + 1) + p + i * width
            for c in range(len(CLASSES))
            for p in range(len(phases))
        ]
        ys = [
            (row["classes"][cls][f"ttft_p99_{phase}"] or 0) / 1000
            for cls in CLASSES
            for phase in phases
        ]
        left.bar(xs, ys, width, label=row["target"])
        right.bar(
            [c + i * width for c in range(len(CLASSES))],
            [row["classes"][cls]["goodput"] for cls in CLASSES],
            width,
            label=row["target"],
        )
    ticks = [
        c * (len(phases) + 1) + p + 0.4 for c in range(len(CLASSES)) for p in range(len(phases))
    ]
    left.set_xticks(ticks, [f"{cls}\n{phase}" for cls in CLASSES for phase in phases], fontsize=7)
    left.set_yscale("log")
    left.set_ylabel("TTFT p99 (s)")
    left.set_title("TTFT p99 by class and phase")
    left.legend()
    right.set_xticks([c + 0.4 for c in range(len(CLASSES))], CLASSES)
    right.set_ylabel("requests within the class's TTFT SLO")
    right.set_title("Goodput by class (interactive 1 s, default 5 s, batch 30 s)")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
