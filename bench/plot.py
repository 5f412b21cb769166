"""Plot router CPU per request (scenario a) and added TTFT (scenario b) from a results
JSON written by bench/peers.py. Runs with the peers venv's Python (it has matplotlib).

    .bench-venv/bin/python bench/plot.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def p50(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


def main() -> None:
    with open(sys.argv[1]) as f:
        results = [r for r in json.load(f) if r.get("round", 0) == 0]  # one round's bars
    a = [r for r in results if r["scenario"].startswith("a") and r["router_cpu_s"] is not None]
    b = {r["target"]: r for r in results if r["scenario"].startswith("b")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [r["target"] for r in a]
    axes[0].bar(
        names,
        [r["router_cpu_s"] / max(1, r["ok"] + r["failed"]) * 1000 for r in a],
        color=["#0f766e" if n == "narwhal" else "#94a3b8" for n in names],
    )
    axes[0].set_ylabel("ms of router CPU per request")
    axes[0].set_title("a: c=32, 64-token streams")
    base = p50(b["lower-bound"]["ttft"]) if "lower-bound" in b else 0.0
    names_b = [t for t in b if t != "lower-bound" and b[t]["ttft"]]
    axes[1].bar(
        names_b,
        [(p50(b[t]["ttft"]) - base) * 1000 for t in names_b],
        color=["#0f766e" if n == "narwhal" else "#94a3b8" for n in names_b],
    )
    axes[1].set_ylabel("ms added to TTFT p50 over the two-leg lower bound")
    axes[1].set_title("b: c=1")
    fig.suptitle("Routers over the same fake engines, one run")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
