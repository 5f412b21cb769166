"""A fleet of engines in both roles, this tree against another checkout, in one run: what
it costs that an attempt's two legs go to two engines (a handoff across) where a decode
could go back to its own producer, which left the prefill's KV held for the lease.

    python bench/both_roles.py --baseline PATH [--rounds N] [--requests N]

Two ``narwhal fake-engine --role both`` engines (4 slots each, 0.2 ms per uncached prompt
token, a 60 s KV lease) and each router in turn over the same engines, interleaved by
round: ``--requests`` streamed completions of distinct 300-word prompts and 32 tokens at
c=16. Reported per target: TTFT p50/p99 (client side), router CPU per request, the KV
leases its load left held (issued and neither read nor released when it ends: blocks
nobody will read, pinned until the lease) and KV pulls (handoffs across). Nothing is
asserted: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # bench/ is not a package: found through the path above

ENGINE_ARGS = ["--slots", "4", "--prefill-ms-per-token", "0.2", "--kv-lease-s", "60"]


def _stats(url: str) -> dict[str, int]:
    """The engine's KV leases issued so far, those freed by a read or a release, its pulls."""
    with urllib.request.urlopen(url + "/fake/stats", timeout=10) as answer:
        counters = json.load(answer)["counters"]
    freed = counters.get("kv_released", 0) + counters.get("kv_released_unread", 0)
    return {
        "issued": counters.get("kv_leases_issued", 0),
        "freed": freed,
        "pulls": counters.get("kv_pull_ok", 0),
    }


def _one(
    name: str, root: str | None, urls: dict[str, str], scenario: peers.Scenario, tmp: Path
) -> dict[str, float]:
    fleet = (
        f'model = "{peers.MODEL}"\n'
        + "".join(f'[[engines]]\nid = "{e}"\nurl = "{u}"\nrole = "both"\n' for e, u in urls.items())
        + "[engine]\nfirst_token_timeout_s = 60.0\nkv_lease_s = 60.0\n"
    )
    proc, url = peers.serve_narwhal(fleet, tmp, name=name, root=root)
    before = {e: _stats(u) for e, u in urls.items()}
    result = peers.Result(name, scenario.name)
    try:
        peers.run_load(
            peers.Scenario("warm-up", 16, 8, 8, prompt_words=300), peers.Result(name, "w"), url
        )
        cpu0 = peers.tree_cpu(proc.proc.pid)
        peers.run_load(scenario, result, url)
        cpu = peers.tree_cpu(proc.proc.pid) - cpu0
    finally:
        proc.stop()
    after = {e: _stats(u) for e, u in urls.items()}
    ttft = sorted(result.ttft)
    return {
        "ok": result.ok,
        "failed": result.failed,
        "ttft_p50_ms": 1000 * ttft[len(ttft) // 2],
        "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
        "cpu_ms_per_request": 1000 * cpu / max(1, result.ok + result.failed),
        # issued during the load and neither read nor released: held until the lease ends
        "leases_held": sum(
            (after[e]["issued"] - before[e]["issued"]) - (after[e]["freed"] - before[e]["freed"])
            for e in urls
        ),
        "kv_pulls": sum(after[e]["pulls"] - before[e]["pulls"] for e in urls),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="another checkout's narwhal")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    scenario = peers.Scenario("both roles", args.requests, 16, 32, prompt_words=300)
    rows: dict[str, list[dict[str, float]]] = {"narwhal": [], "baseline": []}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        procs, urls = peers.start_fake_fleet(
            [("e0", "both", ENGINE_ARGS), ("e1", "both", ENGINE_ARGS)], tmp
        )
        try:
            for n in range(args.rounds):
                order = [("narwhal", None), ("baseline", args.baseline)]
                for name, root in order if n % 2 == 0 else order[::-1]:
                    row = _one(name, root, urls, scenario, tmp)
                    rows[name].append(row)
                    print(f"round {n + 1} {name}: {row}", flush=True)
        finally:
            for proc in procs:
                proc.stop()
    print(
        "\n| target | TTFT p50 ms | TTFT p99 ms | CPU ms/req | leases held at the end | KV pulls |"
    )
    print("|---|---|---|---|---|---|")
    for name, got in rows.items():
        med = {k: statistics.median(r[k] for r in got) for k in got[0]}
        print(
            f"| {name} | {med['ttft_p50_ms']:.1f} | {med['ttft_p99_ms']:.1f} | "
            f"{med['cpu_ms_per_request']:.2f} | {med['leases_held']:.0f} | {med['kv_pulls']:.0f} |"
        )


if __name__ == "__main__":
    main()
