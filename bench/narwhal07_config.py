"""Write a Narwhal 0.7.0 fleet file and synthetic profiles for live fake engines.

Run with the peers venv's Python (it imports narwhal-inference 0.7.0, never our package):

    .bench-venv/bin/python bench/narwhal07_config.py OUT_DIR MODEL PREFILL_URLS DECODE_URLS

(each a URL, or several separated by commas)

Narwhal 0.7.0 admits an engine only when a loaded profile's generation digest matches the
live engine's identity (its ``/version`` and ``process_start_time_seconds``), so the
digest is computed here with its own functions from what the engines report right now.
The profile coefficients are synthetic: the benchmark measures routing cost, not its
scheduler's model.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from narwhal.contracts import canonical_digest  # narwhal-inference 0.7.0


def live_identity(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url + "/version", timeout=10) as resp:
        version = json.loads(resp.read())["version"]
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    start = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("process_start_time_seconds")
    )
    return {"engine": {"version": version, "process_start_time_seconds": start}}


def main() -> None:
    out, model, prefill, decode = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    urls = [(url, "prefill") for url in prefill.split(",")]
    urls += [(url, "decode") for url in decode.split(",")]
    engines = [(f"n{i}", url, role) for i, (url, role) in enumerate(urls)]
    profiles = []
    for iid, url, _ in engines:
        profiles.append(
            {
                "iid": iid,
                "ttft_a": 0.0,
                "ttft_b": 1e-05,
                "ttft_c": 0.001,
                "tpot_slope": 1e-05,
                "tpot_intercept": 0.001,
                "decode_min_requests": 1,
                "decode_max_requests": 20000,
                "decode_min_kv_tokens": 1,
                "decode_max_kv_tokens": 50_000_000,
                "kv_capacity_tokens": 50_000_000,
                "decode_fit_mape": 0.01,
                "decode_cv_mape": 0.01,
                "generation_digest": canonical_digest(live_identity(url)),
            }
        )
    (out / "profiles.json").write_text(
        json.dumps(
            {"schema": "narwhal.profiles", "schema_version": 1, "profiles": profiles}, indent=1
        )
    )
    fleet = {
        "schema": "narwhal.fleet",
        "schema_version": 2,
        "model": model,
        "hardware": {"accelerator": "fake", "accelerators_per_engine": 1, "tensor_parallel": 1},
        "engines": [
            {"iid": iid, "url": url, "role": role, "pin": True} for iid, url, role in engines
        ],
        "slo": {"ttft_s": 10.0, "tpot_s": 0.5},
        "engine": {"first_token_timeout_s": 10.0},
        "controller": {"min_prefill": 1, "min_decode": 1},
        "serving": {"max_connections": 20000},
        "profiles": {"path": str(out / "profiles.json")},
    }
    (out / "fleet.json").write_text(json.dumps(fleet, indent=1))
    print(out / "fleet.json")


if __name__ == "__main__":
    main()
