"""What the admission queue costs: queue on against ``[admission] queue = false``, ratio by
ratio within each round of one ``bench/peers.py`` run (its JSON), for this tree and, when
the run had ``--baseline``, for the baseline too.

    python bench/queue_ratios.py bench/results/saturation/2026-12-04-a-queue-on-off.json

Per pair: each side's medians over the rounds (router CPU per request, TTFT p50, req/s, the
most streams open at once), then each on/off ratio's median with its spread (min-max).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

PAIRS = (("narwhal-main", "narwhal-main-noqueue"), ("narwhal", "narwhal-noqueue"))


def figures(row: dict[str, Any]) -> dict[str, float]:
    n = row["ok"] + row["failed"]
    return {
        "cpu_ms_per_req": row["router_cpu_s"] / n * 1000,
        "ttft_p50_ms": statistics.median(row["ttft"]) * 1000,
        "req_per_s": n / row["wall_s"],
        "streams": row["streaming"],
    }


def main(path: str, scenario: str = "a:") -> int:
    text = Path(path).read_text()
    rows = [r for r in json.loads(text) if r["scenario"].startswith(scenario)]
    by = {(r["target"], r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    for on, off in PAIRS:
        pairs = [(by[on, n], by[off, n]) for n in rounds if (on, n) in by and (off, n) in by]
        if not pairs:
            continue
        print(f"{on} (queue on) against {off} (queue = false), {len(pairs)} rounds:")
        for name, side in ((on, 0), (off, 1)):
            f = [figures(pair[side]) for pair in pairs]
            print(
                f"  {name:22} CPU {statistics.median(x['cpu_ms_per_req'] for x in f):.2f} ms/req"
                f"  TTFT p50 {statistics.median(x['ttft_p50_ms'] for x in f):.1f} ms"
                f"  {statistics.median(x['req_per_s'] for x in f):.0f} req/s"
                f"  streams open at once {max(x['streams'] for x in f):.0f}"
            )
        for key in ("cpu_ms_per_req", "ttft_p50_ms", "req_per_s"):
            ratios = [figures(a)[key] / figures(b)[key] for a, b in pairs]
            print(
                f"  on/off {key}: {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
