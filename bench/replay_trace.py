"""Routers replaying a production trace (Mooncake FAST'25), side by side in one run
(``make bench-replay``).

    python bench/replay_trace.py [--trace conversation|synthetic|PATH] [--minutes 3]
        [--speedup 4] [--scale-tokens 0.125] [--load 0.6,0.9] [--fleet pd,both]
        [--variant "NAME:SECTION.KEY=VALUE[;SECTION.KEY=VALUE...]"]...
        [--targets NAME,...] [--peers-venv .bench-venv] [--out bench/results/replay]

The trace (bench/traces/, committed: nothing is fetched at run time) is replayed open loop:
each request is sent at its trace arrival divided by ``--speedup``, whatever the answers
before it, for ``--minutes`` of trace (at most ``--max-requests``). Its prompt is rebuilt
with exactly the trace's shared prefixes (bench/trace_workload.py: each 512-token hash id a
fixed block of words, the last block cut to the input length), sent to
``/v1/completions`` streamed, ``max_tokens`` its output length capped at ``--output-cap``
(512) trace tokens. ``--scale-tokens S`` multiplies every length by S (a block becomes
512 x S words), so a 2-core machine can carry the trace's 12,000-token prompts; time per
token is divided by S, so a request takes as long as its trace-sized self would.

Fleets (``--fleet``), started afresh for every router so that every cache starts cold and
every queue empty (``narwhal fake-engine`` with its cost model):
  pd    p0, p1 producers (``--slots 4``: four prompts computed at once, the rest wait),
        d0, d1 consumers (``--slots 256``, decode streams; a prompt a router leaves on a
        consumer is computed there too, four at a time, slowing its streams by
        ``--prefill-interference 0.25`` each)
  both  e0..e3, each in both roles (``--slots 256 --prefill-slots 4``, the same
        interference): no engine is only a producer
Every engine: prefill time per prompt token its prefix cache does not hold, set by
``--load`` (below); a prefix cache of ``--cache-fraction`` (0.25) of the slice's working
set (its distinct 16-token blocks) each; a KV pull of ``--kv-cost`` (0.1) x a block's
prefill time per block the consumer does not hold, plus 5 ms; ``--itl-ms`` (20 ms) per
trace token between generated tokens alone, times 1 + ``--batch-growth`` (0.01) x the
other streams decoding on the engine; a KV cache (``--kv-blocks``) three times the blocks
its share of the running prompts takes on average, so that KV usage alone never saturates
it; the KV lease of bench/peers.py (480 s).

``--load L`` sets the prefill time per token so that an ideal router (one that computes
only what no earlier request computed: an unbounded cache shared by all) keeps the
prefill engines (pd: the two producers; both: all four) busy L of the time over the slice:
capacity is engines x 4 prompts at once / (ms per token). A real router computes more (its
caches are bounded and split), so at 0.9 producers can saturate.

Targets, each over its own fresh fleet, the same schedule:
  narwhal                  this tree's ``narwhal serve`` with its [placement] and
                           [admission] defaults (the fleet file of bench/placement.py:
                           first-token timeout 120 s, as the peers have none)
  NAME (``--variant``)     the same fleet file with SECTION.KEY = VALUE overrides (a TOML
                           value: strings quoted; a bare word is taken as a string), e.g.
                           ``--variant "queue_off:admission.queue=false"``; a router that
                           refuses its fleet file (a key it does not know yet) is a row
                           that says so, and the run goes on
  vllm-router round_robin, vllm-router cache_aware   vllm-router 0.1.17 (``--policy``),
                           in P/D mode over pd; over both in its regular mode, each
                           request whole on one engine (in P/D mode it keeps one entry
                           per URL: an engine cannot be both a producer and a consumer)
  narwhal-0.7              narwhal-inference 0.7.0 (bench/narwhal07_config.py; it has no
                           both role: there every engine is listed as each)

Reported per (fleet, load, router): requests sent, failed (by status), TTFT p50/p90/p99
(client side, from the scheduled send to the first streamed event), TPOT p50 (per request,
(end - first token) / (tokens - 1), in ms per streamed token), the prefill engines' work
split (prompt tokens each computed, from ``/fake/stats`` ``prompt_tokens_computed``, over
the total they computed), the work against the ideal's, the prefix-cache hit rate (hits
over queries of the prefill engines' caches, in prompt tokens), router CPU seconds per
request (user + system of its process tree from /proc, over the replay), and each figure
as a ratio to the best of vllm-router cache_aware and Narwhal 0.7.0 in the same run.
Written to ``--out`` as a dated markdown table and JSON. Nothing is asserted: the machine
is shared and noisy. Every loop is bounded; only 127.0.0.1; only processes it started are
stopped, by their handles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import replay_report as report
import trace_workload as tw
import trio
from peers import BENCH_KV_LEASE_S, MODEL, Proc, one_request, start_fake_fleet, tree_cpu
from placement import get, not_measured, warm_up
from replay_report import Outcome
from replay_targets import FLEETS, Fleet, Start, targets

from narwhal.core.faults import EngineFault
from narwhal.engines.transport import Pool, tcp_connect

PREFILL_SLOTS = 4  # prompts an engine computes at once (producers: their slots)
DECODE_SLOTS = 256
INTERFERENCE = 0.25  # a prompt computed beside streams stretches their steps by this each
KV_PULL_MS = 5.0  # a pull's fixed cost (bench/placement.py's consumers)
KV_HEADROOM = 3.0  # the KV cache over the blocks a share of the running prompts takes
CLIENT_TIMEOUT_S = 300.0  # a request not done by then is a failure ("timeout")
MAX_MODEL_LEN = 1 << 20  # the trace's longest prompts (190k tokens) fit unscaled
PEERS = ("vllm-router cache_aware", "narwhal-0.7")  # the ratios' baseline: the best of these


# ---- the fleet's costs ---------------------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """Every engine's cost model for one (fleet, load)."""

    prefill_ms: float  # per replay token not cached
    cache_blocks: int
    kv_ms_per_block: float
    itl_s: float
    batch_growth: float
    kv_blocks: int

    def args(self, role: str) -> list[str]:
        common = [
            *("--prefill-ms-per-token", f"{self.prefill_ms:.6f}"),
            *("--prefix-cache-blocks", str(self.cache_blocks)),
            *("--kv-blocks", str(self.kv_blocks)),
            *("--kv-lease-s", str(BENCH_KV_LEASE_S)),
            *("--max-model-len", str(MAX_MODEL_LEN)),
        ]
        if role == "prefill":
            return [*common, "--slots", str(PREFILL_SLOTS)]
        return [
            *common,
            *("--slots", str(DECODE_SLOTS), "--prefill-slots", str(PREFILL_SLOTS)),
            *("--prefill-interference", str(INTERFERENCE)),
            *("--itl-s", f"{self.itl_s:.6f}", "--decode-batch-growth", str(self.batch_growth)),
            *("--kv-ms-per-block", f"{self.kv_ms_per_block:.6f}", "--kv-pull-ms", str(KV_PULL_MS)),
        ]


def calibrate(
    requests: list[tw.TraceRequest],
    scale: tw.Scale,
    fleet: Fleet,
    load: float,
    args: argparse.Namespace,
) -> Costs:
    """The costs that put the ideal router's prefill engines at ``load`` (module doc)."""
    work = tw.work(requests, scale)
    duration_s = args.minutes * 60 / args.speedup
    prefilling = len(fleet.named("prefill", "both"))
    prefill_ms = tw.prefill_ms_for_load(work, duration_s, prefilling, PREFILL_SLOTS, load)
    itl_s = args.itl_ms / 1000 / scale.factor
    # the running prompts' blocks on one decoding engine, on average: arrivals a second x
    # a stream's length, over the decoding engines, x a prompt's blocks
    outputs = [scale.output_tokens(r) for r in requests]
    streams = len(requests) / duration_s * tw.mean(outputs) * itl_s
    streams /= len(fleet.named("decode", "both"))
    blocks = work.prompt_tokens / max(1, work.requests) / tw.ENGINE_BLOCK
    return Costs(
        prefill_ms=prefill_ms,
        cache_blocks=max(1, round(args.cache_fraction * work.working_set_blocks)),
        kv_ms_per_block=args.kv_cost * tw.ENGINE_BLOCK * prefill_ms,
        itl_s=itl_s,
        batch_growth=args.batch_growth,
        kv_blocks=max(4096, math.ceil(KV_HEADROOM * streams * blocks)),
    )


def start_fleet(fleet: Fleet, costs: Costs, tmp: Path) -> tuple[list[Proc], dict[str, str]]:
    """The fleet's engines, fresh; every one started is stopped again if a later one fails."""
    return start_fake_fleet([(name, role, costs.args(role)) for name, role in fleet.engines], tmp)


# ---- the replay ------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    at_s: float  # from the replay's start
    body: bytes
    tokens: int  # max_tokens


def schedule(requests: list[tw.TraceRequest], scale: tw.Scale, speedup: float) -> list[Send]:
    """Every request's send time and body, built once and replayed to every router."""
    cache: dict[int, str] = {}
    out = []
    for req in requests:
        tokens = scale.output_tokens(req)
        body = {
            "model": MODEL,
            "prompt": tw.prompt_text(req, scale, cache),
            "max_tokens": tokens,
            "stream": True,
            "temperature": 0,
        }
        out.append(Send(req.at_ms / 1000 / speedup, msgspec.json.encode(body), tokens))
    return out


async def replay(sends: list[Send], url: str, outcomes: list[Outcome]) -> None:
    """Send each request at its time, whatever came before (open loop); each bounded by
    CLIENT_TIMEOUT_S, the whole by the last send plus that and a margin."""
    pool = Pool(url, tcp_connect, 60.0, 4096)
    t0 = trio.current_time()

    async def send(item: Send) -> None:
        outcome = Outcome(item.at_s, item.tokens, "timeout")
        with trio.move_on_after(CLIENT_TIMEOUT_S):
            try:
                failure, first, e2e = await one_request(pool, item.body)
                outcome = Outcome(item.at_s, item.tokens, failure or "ok", first, e2e)
            except EngineFault as exc:
                outcome = Outcome(item.at_s, item.tokens, type(exc).__name__)
        outcomes.append(outcome)

    with trio.fail_after(sends[-1].at_s + CLIENT_TIMEOUT_S + 30):
        async with trio.open_nursery() as nursery:
            for item in sends:
                await trio.sleep_until(t0 + item.at_s)
                nursery.start_soon(send, item)


def predicted_median(url: str) -> float | None:
    """Ours with policy "predicted": the median of observed over predicted TTFT, from its
    ``/metrics`` (None for a router that exports none)."""
    try:
        text = get(url, "/metrics")
    except (OSError, RuntimeError):
        return None
    name = "narwhal_prediction_error_ratio"
    return report.histogram_median(text, name, 'figure="ttft"')


def engine_stats(urls: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {name: json.loads(get(url, "/fake/stats")) for name, url in urls.items()}


def measure(
    target: tuple[str, Start],
    fleet: Fleet,
    costs: Costs,
    sends: list[Send],
    tmp: Path,
    slo: tuple[float, float] | None = None,
) -> report.Run:
    name, start = target
    run = report.Run(target=name, slo=slo)
    engines, urls = start_fleet(fleet, costs, tmp)
    try:
        try:
            proc, url = start(fleet, urls, tmp)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            run.note = not_measured(exc)
            return run
        try:
            warm_up(url)  # connections open, first health checks and scrapes landed
            before, cpu0, t0 = engine_stats(urls), tree_cpu(proc.proc.pid), time.monotonic()
            trio.run(replay, sends, url, run.outcomes)
            run.router_cpu_s = tree_cpu(proc.proc.pid) - cpu0
            run.wall_s = time.monotonic() - t0
            run.engines = report.engine_delta(before, engine_stats(urls))
            run.prediction = predicted_median(url)
        finally:
            proc.stop()
    finally:
        for engine in engines:
            engine.stop()
    return run


# ---- the command line ------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--trace", default="conversation", help="conversation, synthetic, or a JSONL path")
    add("--start-minute", type=float, default=0.0, help="where in the trace the slice begins")
    add("--minutes", type=float, default=3.0, help="trace minutes replayed")
    add("--max-requests", type=int, default=2500, help="at most this many requests")
    add("--speedup", type=float, default=4.0, help="arrivals compressed by this factor")
    add("--scale-tokens", type=float, default=0.125, help="every length times this")
    add("--output-cap", type=int, default=512, help="outputs capped at this many trace tokens")
    add("--load", default="0.6,0.9", help="ideal prefill utilisations, comma-separated")
    add("--fleet", default="pd", help="pd, both, or both comma-separated")
    add("--cache-fraction", type=float, default=0.25, help="prefix cache / working set")
    add("--kv-cost", type=float, default=0.1, help="a block's pull / its prefill time")
    add("--itl-ms", type=float, default=20.0, help="ms per trace token, a stream alone")
    add("--batch-growth", type=float, default=0.01, help="step growth per other stream")
    add(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE[;...]",
        help="our router with fleet-file overrides, e.g. queue_off:admission.queue=false",
    )
    add("--targets", help="comma-separated target names (default: all)")
    add(
        "--slo",
        default="",
        metavar="TTFT_S,TPOT_MS",
        help="targets every request is held to, client-side: the share that met both",
    )
    add("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    add("--out", default="bench/results/replay")
    add("--name", default="", help="a suffix for the results' file name")
    add("--logs", help="keep the processes' logs in this folder")
    return parser.parse_args()


def slo_of(text: str) -> tuple[float, float] | None:
    """``--slo 2.0,150`` -> (2.0 s, 0.15 s)."""
    if not text:
        return None
    ttft, tpot = (float(x) for x in text.split(","))
    return ttft, tpot / 1000


def slice_of(args: argparse.Namespace) -> list[tw.TraceRequest]:
    path = tw.NAMED.get(args.trace, Path(args.trace))
    requests = tw.load_trace(path, args.start_minute * 60, args.minutes * 60, args.max_requests)
    if not requests:
        raise SystemExit(f"no request of {path} in that window")
    return requests


def main() -> int:
    args = parse_args()
    os.environ["PEERS_VENV"] = args.peers_venv
    scale = tw.Scale(args.scale_tokens, args.output_cap)
    scale.check()
    requests = slice_of(args)
    chosen = targets(args.variant, args.targets)
    sends = schedule(requests, scale, args.speedup)
    loads = [float(x) for x in args.load.split(",") if x.strip()]
    fleets = [FLEETS[f.strip()] for f in args.fleet.split(",") if f.strip()]
    work = tw.work(requests, scale)
    slo = slo_of(args.slo)
    began = time.monotonic()
    runs: list[dict[str, Any]] = []
    setups: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="narwhal-replay-") as tmpdir:
        tmp = Path(args.logs or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        for fleet in fleets:
            for load in loads:
                costs = calibrate(requests, scale, fleet, load, args)
                setups.append({"fleet": fleet.name, "load": load, **costs.__dict__})
                for target in chosen:
                    run = measure(target, fleet, costs, sends, tmp, slo)
                    row = run.summary(fleet.named("prefill", "both"), fleet.name, load)
                    runs.append(row)
                    print(report.progress(row), file=sys.stderr, flush=True)
    meta = {
        "command": "python bench/replay_trace.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "seconds": round(time.monotonic() - began),
        "trace": args.trace,
        "window": [args.start_minute, args.minutes],
        "requests": len(requests),
        "speedup": args.speedup,
        "scale_tokens": args.scale_tokens,
        "output_cap": args.output_cap,
        "work": work.__dict__,
        "ideal_hit_rate": round(work.ideal_hit_rate, 4),
        "args": {k: v for k, v in vars(args).items() if k not in ("logs",)},
        "setups": setups,
    }
    text = report.markdown(meta, runs, PEERS)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"replay-{Path(args.trace).stem}-{meta['date']}" + (f"-{args.name}" if args.name else "")
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": runs}, indent=1) + "\n")
    print(f"written: {out / stem}.md, .json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
