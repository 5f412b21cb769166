"""Placement policies side by side, in one run, over the same fake fleet (issue item 5).

    python bench/placement.py [--quick] [--peers-venv .bench-venv] [--out bench/results]
                              [--set KEY=VALUE]...   (a [placement] line for our targets)

The fleet, started afresh for every (policy, workload) run so that every prefix cache
starts cold and every queue empty (``narwhal fake-engine`` with its cost model):

  p0, p1  producers: 4 slots (prompts computed at once; the rest wait in a FIFO queue),
          0.2 ms of prefill per prompt token the prefix cache does not hold (a 1,500-token
          system prompt: 300 ms; 20k prompt tokens/s with all slots busy: a GPU engine on a
          mid-sized model), a prefix cache of 480 16-token blocks: five of the eight
          1,500-token system prompts, so a producer can hold its share of them (the ring
          gives p0 three and p1 five) but not all eight. p1 is 2x slower (``--slowdown 2``).
  d0, d1  consumers: 16 slots, 5 ms between generated tokens; d1 2x slower. They compute no
          prompt (the KV comes from the producer), so they have no prefix cache and the hit
          rate is the producers'.

Fair to every router: the same engines, restarted cold for each run; each workload's
schedule (arrival times and prompts: open loop, Poisson arrivals from a fixed seed) drawn
once and replayed to every target; the engines' cost is the only thing that differs
between a good and a bad placement (no router pays for anything but its own CPU). The rate
(8 requests/s) keeps this shared 2-core machine from being the bottleneck; the fleet's
capacity at that rate is ample unless placement wastes it (cache misses on the slow
producer, legs behind another tenant's queue). One token is one whitespace-separated word
(the fake engine's tokenizer); 16 output tokens per request.

Workloads (30 s of arrivals each, 10 s with ``--quick``):
  uniform        unique 200-token prompts
  shared-prefix  80% of requests: one of 8 system prompts (1,500 tokens) and a unique
                 40-token question; 20%: a unique 300-token prompt
  burst          unique 200-token prompts, and from 5 s to 25 s another tenant (another
                 router, or clients that bypass ours) keeps 12 2,000-token prefills (400 ms
                 each) going straight to p0, the fast producer: its four slots busy and
                 eight waiting; a router sees that load only in p0's /metrics (or its own
                 legs there slowing down)

Targets:
  round_robin            ours, ``[placement] policy = "round_robin"``, no prefix affinity
  least_loaded           ours, ``policy = "least_loaded"``, no prefix affinity
  least_loaded+affinity  ours, ``least_loaded`` and ``prefix_affinity = true`` (the default)
  (all three with the default ``metrics_interval_s = 1.0``, ``affinity_load_factor = 1.25``)
  least_loaded+affinity 0.25s   the default but for ``metrics_interval_s = 0.25``: how much
                         of a burst's first second lands on the loaded engine before a
                         scrape shows its queue
  vllm-router cache_aware, vllm-router power_of_two   vllm-router 0.1.17 in PD mode,
                         ``--policy`` for both roles
  narwhal-0.7            narwhal-inference 0.7.0 with its own (profile-priced) placement and
                         the synthetic profiles of bench/narwhal07_config.py

Reported per (workload, target): TTFT p50/p99 (client side: from sending the request to the
first streamed token), throughput (completed requests over the time from the first arrival
to the last completion), the producers' prefix-cache hit rate (the change of
``vllm:prefix_cache_hits_total`` over the change of ``vllm:prefix_cache_queries_total``
summed over p0 and p1 during the measured phase, in prompt tokens, the other tenant's
included), each producer's share of the prompt tokens this router sent (the tenant's taken
out), our placement decisions by reason, each engine's peak waiting queue (sampled every
0.5 s), the slowest requests (TTFT, arrival) and the machine's load average. Nothing is
asserted: the machine is shared and noisy; the targets of the issue are checked and printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
from peers import (
    MODEL,
    Proc,
    Result,
    engines_toml,
    fmt,
    launch_narwhal07,
    launch_vllm_router,
    one_request,
    pct,
    plot,
    prefill_leg,
    serve_narwhal,
    start_fake_fleet,
)

from narwhal.engines.transport import ConnectFailed, Pool, TransportError, tcp_connect

OUTPUT_TOKENS = 16
RATE = 8.0  # requests per second: what this shared 2-core machine drives without being the limit
REQUEST_TIMEOUT_S = 60.0  # a request not done by then is a failure ("timeout")
PRODUCER = ["--slots", "4", "--prefill-ms-per-token", "0.2", "--prefix-cache-blocks", "480"]
CONSUMER = ["--slots", "16", "--itl-s", "0.005"]
FLEET = [  # (name, role, slowdown)
    ("p0", "prefill", 1.0),
    ("p1", "prefill", 2.0),
    ("d0", "decode", 1.0),
    ("d1", "decode", 2.0),
]
SYSTEM_PROMPTS, SYSTEM_WORDS, QUESTION_WORDS = 8, 1500, 40
METRIC = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)(?:\{[^}]*\})? (\S+)$", re.M)
DECISIONS = re.compile(
    r'^narwhal_placement_decisions_total\{leg="(\w+)",reason="(\w+)"\} (\S+)$', re.M
)
WAITING = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.M)
LEGS = re.compile(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", re.M)


# ---- workloads -------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """Another tenant's prefills straight to one producer, from ``start_s`` to ``end_s``."""

    engine: str  # a name of FLEET
    workers: int  # closed loop: each sends its next prefill when the last one is done
    words: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Workload:
    name: str
    rate: float  # arrivals per second (Poisson)
    requests: int
    prompt: Callable[[random.Random, int], str]
    tenant: Tenant | None = None

    def schedule(self, seed: int) -> list[tuple[float, bytes]]:
        """(arrival in seconds from the start, request body), the same for every target."""
        rng = random.Random(seed)
        at, out = 0.0, []
        for i in range(self.requests):
            body = {
                "model": MODEL,
                "prompt": self.prompt(rng, i),
                "max_tokens": OUTPUT_TOKENS,
                "stream": True,
                "temperature": 0,
            }
            out.append((at, msgspec.json.encode(body)))
            at += rng.expovariate(self.rate)
        return out


def words(rng: random.Random, count: int, tag: str) -> str:
    """``count`` words no other prompt shares from its first block on (``tag`` leads)."""
    return " ".join([tag, *(f"w{rng.randrange(1 << 20):x}" for _ in range(count - 1))])


SYSTEM = [" ".join(f"s{k}t{i % 97}" for i in range(SYSTEM_WORDS)) for k in range(SYSTEM_PROMPTS)]


def uniform_prompt(rng: random.Random, i: int) -> str:
    return words(rng, 200, f"u{i}")


def shared_prompt(rng: random.Random, i: int) -> str:
    if rng.random() < 0.8:
        return SYSTEM[rng.randrange(SYSTEM_PROMPTS)] + " " + words(rng, QUESTION_WORDS, f"q{i}")
    return words(rng, 300, f"x{i}")


def workloads(quick: bool) -> list[Workload]:
    scale = 1 / 3 if quick else 1.0
    count = int(RATE * 30 * scale)  # 30 s of arrivals per workload (10 s with --quick)
    return [
        Workload("uniform", RATE, count, uniform_prompt),
        Workload("shared-prefix", RATE, count, shared_prompt),
        Workload(
            "burst",
            RATE,
            count,
            uniform_prompt,
            Tenant("p0", 12, 2000, 5 * scale, 25 * scale),
        ),
    ]


# ---- targets ---------------------------------------------------------------------------

Start = Callable[[list[str], list[str], Path], tuple[Proc, str]]


PLACEMENT_KEYS: list[str] = []  # --set: more [placement] lines for our three targets


def ours(policy: str, affinity: bool, interval_s: float = 1.0) -> Start:
    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        extra = "".join(
            f"{line}\n" for line in [f"metrics_interval_s = {interval_s}", *PLACEMENT_KEYS]
        )
        return serve_narwhal(
            f'model = "{MODEL}"\n' + engines_toml(prefills, decodes) + "[serving]\n"
            "max_inflight = 20000\n"
            # the peers have no first-token timeout: measure placement, not our 2.5 s default
            "[engine]\nfirst_token_timeout_s = 120.0\n"
            f'[placement]\npolicy = "{policy}"\nprefix_affinity = {str(affinity).lower()}\n'
            + extra,
            tmp,
        )

    return start


def vllm_router(policy: str) -> Start:
    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        return launch_vllm_router(prefills, decodes, tmp, ("--policy", policy))

    return start


TARGETS: list[tuple[str, Start]] = [
    ("round_robin", ours("round_robin", False)),
    ("least_loaded", ours("least_loaded", False)),
    ("least_loaded+affinity", ours("least_loaded", True)),
    # the scrape's lag decides who meets a sudden burst first: the same at 4 scrapes a second
    ("least_loaded+affinity 0.25s", ours("least_loaded", True, 0.25)),
    ("vllm-router cache_aware", vllm_router("cache_aware")),
    ("vllm-router power_of_two", vllm_router("power_of_two")),
    ("narwhal-0.7", launch_narwhal07),
]


# ---- one run ---------------------------------------------------------------------------


@dataclass
class Run(Result):
    """One (workload, target) run: ``scenario`` is the workload; ``ttft``, ``ok``,
    ``failed``, ``errors`` as in bench/peers.py."""

    hit_rate: float | None = None
    prefill_share: dict[str, float] = field(default_factory=dict)  # of prompt tokens
    tenant_done: int = 0
    placements: dict[str, float] = field(default_factory=dict)  # ours: decisions by reason
    peak_waiting: dict[str, float] = field(default_factory=dict)  # each engine's, sampled
    slowest: list[tuple[int, float]] = field(default_factory=list)  # (TTFT ms, arrival s)
    load_avg: float = 0.0  # the machine's, over the last minute, at the run's end

    def summary(self) -> dict[str, Any]:
        return {
            "workload": self.scenario,
            "target": self.target,
            "ttft_p50_ms": _ms(pct(self.ttft, 0.5)),
            "ttft_p99_ms": _ms(pct(self.ttft, 0.99)),
            "req_per_s": round(self.ok / self.wall_s, 2) if self.wall_s else None,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "prefill_share": self.prefill_share,
            "ok": self.ok,
            "failed": self.failed,
            "tenant_prefills": self.tenant_done,
            "placements": self.placements,
            "peak_waiting": self.peak_waiting,
            "slowest": self.slowest,
            "load_avg": self.load_avg,
            "errors": self.errors,
            "note": self.note,
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return str(resp.read().decode())


def counters(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each producer's prefix cache counters and prompt tokens, from its /metrics."""
    out = {}
    for name, url in urls.items():
        text = get(url, "/metrics")
        found = {m.group(1): float(m.group(2)) for m in METRIC.finditer(text)}
        found["prompt_tokens"] = sum(float(m.group(1)) for m in LEGS.finditer(text))
        out[name] = found
    return out


def placements(url: str) -> dict[str, float]:
    """Our router's placement decisions by leg and reason (nothing from the peers)."""
    try:
        text = get(url, "/metrics")
    except OSError:  # vllm-router answers 405 on /metrics, Narwhal 0.7 has its own
        return {}
    found = ((f"{m[1]}/{m[2]}", float(m[3])) for m in DECISIONS.finditer(text))
    return {key: value for key, value in found if value}


def pool_for(url: str, width: int = 1024) -> Pool:
    host, port = url.removeprefix("http://").split(":")
    return Pool(host, int(port), tcp_connect, 60.0, width)


async def tenant_loop(tenant: Tenant, url: str, run: Run, t0: float, seed: int) -> None:
    """The other tenant: prefills (``max_tokens`` 1, ``do_remote_decode``) straight to
    ``url``, as another router's prefill legs; unique prompts, so nothing is cached."""
    pool = pool_for(url, tenant.workers + 2)
    rng = random.Random(seed)
    await trio.sleep_until(t0 + tenant.start_s)

    async def worker(w: int) -> None:
        n = 0
        while trio.current_time() < t0 + tenant.end_s and n < 10_000:  # bounded
            n += 1
            body = {"model": MODEL, "prompt": words(rng, tenant.words, f"t{w}n{n}")}
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                await prefill_leg(pool, body)
                run.tenant_done += 1

    async with trio.open_nursery() as nursery:
        for w in range(tenant.workers):
            nursery.start_soon(worker, w)


async def sample_queues(engines: dict[str, str], run: Run) -> None:
    """Each engine's ``vllm:num_requests_waiting`` every 0.5 s; the peak is kept."""
    while True:  # cancelled with the run
        for name, url in engines.items():
            text = await trio.to_thread.run_sync(get, url, "/metrics")
            found = WAITING.search(text)
            if found:
                value = float(found.group(1))
                run.peak_waiting[name] = max(run.peak_waiting.get(name, 0.0), value)
        await trio.sleep(0.5)


async def replay(
    schedule: list[tuple[float, bytes]],
    url: str,
    run: Run,
    tenant: tuple[Tenant, str] | None,
    engines: dict[str, str],
) -> None:
    """Send every request at its time (open loop), each bounded by REQUEST_TIMEOUT_S."""
    pool = pool_for(url)
    last_done = 0.0

    async def send(at: float, body: bytes) -> None:
        nonlocal last_done
        failure: str | None = "timeout"
        first = None
        with trio.move_on_after(REQUEST_TIMEOUT_S):
            try:
                failure, first, _ = await one_request(pool, body)
            except (ConnectFailed, TransportError) as exc:
                failure = type(exc).__name__
        if failure is None:
            run.ok += 1
            if first is not None:
                run.ttft.append(first)
                run.slowest = sorted([*run.slowest, (round(first * 1000), round(at, 2))])[-8:]
        else:
            run.failed += 1
            run.errors[failure] = run.errors.get(failure, 0) + 1
        last_done = trio.current_time()

    t0 = trio.current_time()
    limit = schedule[-1][0] + REQUEST_TIMEOUT_S + 30
    with trio.fail_after(limit):
        async with trio.open_nursery() as outer:
            outer.start_soon(sample_queues, engines, run)
            async with trio.open_nursery() as nursery:
                if tenant is not None:
                    nursery.start_soon(tenant_loop, tenant[0], tenant[1], run, t0, len(schedule))
                for at, body in schedule:
                    await trio.sleep_until(t0 + at)
                    nursery.start_soon(send, at, body)
            outer.cancel_scope.cancel()
    run.wall_s = last_done - t0


def warm_up(url: str) -> None:
    """A few short requests through the target (connections, first scrapes); prompts
    shorter than a block, so no cache is touched."""
    body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2, "stream": True}

    async def main() -> None:
        pool = pool_for(url, 8)
        with trio.fail_after(60):
            for _ in range(8):
                await one_request(pool, msgspec.json.encode(body))

    trio.run(main)
    time.sleep(1.5)  # a scrape of every engine has landed (our metrics_interval_s is 1 s)


def start_fleet(tmp: Path) -> tuple[list[Proc], dict[str, str]]:
    return start_fake_fleet(
        [
            (name, role, [*(PRODUCER if role == "prefill" else CONSUMER), "--slowdown", str(slow)])
            for name, role, slow in FLEET
        ],
        tmp,
    )


def measure(workload: Workload, target: str, start: Start, tmp: Path, seed: int) -> Run:
    run = Run(target, workload.name)
    engines, urls = start_fleet(tmp)
    try:
        prefills = [urls[n] for n, role, _ in FLEET if role == "prefill"]
        decodes = [urls[n] for n, role, _ in FLEET if role == "decode"]
        try:
            proc, url = start(prefills, decodes, tmp)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            run.note = f"not measured: {exc}"[:200]
            return run
        try:
            warm_up(url)
            producers = {n: urls[n] for n, role, _ in FLEET if role == "prefill"}
            before = counters(producers)
            tenant = workload.tenant
            trio.run(
                replay,
                workload.schedule(seed),
                url,
                run,
                None if tenant is None else (tenant, urls[tenant.engine]),
                urls,
            )
            after = counters(producers)
            run.placements = placements(url)
        finally:
            proc.stop()
    finally:
        for engine in engines:
            engine.stop()
    delta = {n: {k: after[n].get(k, 0.0) - before[n].get(k, 0.0) for k in after[n]} for n in after}
    queries = sum(d.get("vllm:prefix_cache_queries_total", 0.0) for d in delta.values())
    hits = sum(d.get("vllm:prefix_cache_hits_total", 0.0) for d in delta.values())
    run.hit_rate = hits / queries if queries else None
    routed = {n: d["prompt_tokens"] for n, d in delta.items()}
    if workload.tenant is not None:  # what this router sent: the tenant's prefills out
        name = workload.tenant.engine
        routed[name] = max(0.0, routed[name] - run.tenant_done * workload.tenant.words)
    total = sum(routed.values()) or 1.0
    run.prefill_share = {n: round(t / total, 3) for n, t in routed.items()}
    run.load_avg = round(os.getloadavg()[0], 1)
    return run


# ---- report ----------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        lines += [
            f"\n### {workload}\n",
            "| policy | TTFT p50 ms | TTFT p99 ms | req/s | prefix-cache hit rate "
            "| prompt tokens p0/p1 | ok/failed | load avg | note |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(cells(r)) + " |" for r in rows if r["workload"] == workload]
    return "\n".join(lines)


def cells(r: dict[str, Any]) -> list[str]:
    """One row of the table: a run's figures, and in its note what went wrong and how
    often our affinity spilled."""
    notes = [r["note"], *(f"{why} x{n}" for why, n in sorted(r["errors"].items()))]
    decisions = r["placements"]
    homed = decisions.get("prefill/spill", 0) + decisions.get("prefill/affinity", 0)
    if homed:
        notes.append(f"spilled {decisions.get('prefill/spill', 0) / homed:.0%} of prefills")
    hit = r["hit_rate"]
    return [
        r["target"],
        fmt(r["ttft_p50_ms"], 1, 1),
        fmt(r["ttft_p99_ms"], 1, 1),
        fmt(r["req_per_s"], 1, 1),
        "—" if hit is None else f"{hit:.1%}",
        "/".join(f"{r['prefill_share'].get(n, 0):.0%}" for n in ("p0", "p1")),
        f"{r['ok']}/{r['failed']}",
        str(r["load_avg"]),
        " ".join(n for n in notes if n),
    ]


def targets_met(rows: list[dict[str, Any]]) -> str:
    """The issue's targets, checked on this run's figures."""
    by = {(r["workload"], r["target"]): r for r in rows}

    def val(workload: str, target: str, key: str) -> float | None:
        r = by.get((workload, target))
        v = None if r is None else r[key]
        return None if v is None else float(v)

    lines = ["\n### Targets (issue item 5)\n"]
    rr = val("shared-prefix", "round_robin", "ttft_p50_ms")
    peers = [
        v
        for t in ("vllm-router cache_aware", "vllm-router power_of_two", "narwhal-0.7")
        if (v := val("shared-prefix", t, "ttft_p50_ms")) is not None
    ]
    for ours_name in ("least_loaded", "least_loaded+affinity", "least_loaded+affinity 0.25s"):
        p50 = val("shared-prefix", ours_name, "ttft_p50_ms")
        if p50 is None or rr is None:
            continue
        best = min(peers) if peers else None
        lines.append(
            f"- shared-prefix, {ours_name}: TTFT p50 {p50:.1f} ms vs round_robin {rr:.1f} ms "
            f"({1 - p50 / rr:+.0%} lower; target 30%: "
            f"{'met' if p50 <= 0.7 * rr else 'NOT met'}); best peer "
            f"{'—' if best is None else f'{best:.1f} ms'} (target no worse: "
            f"{'met' if best is None or p50 <= best else 'NOT met'})"
        )
    rr99 = val("burst", "round_robin", "ttft_p99_ms")
    for ours_name in ("least_loaded", "least_loaded+affinity", "least_loaded+affinity 0.25s"):
        p99 = val("burst", ours_name, "ttft_p99_ms")
        if p99 is None or rr99 is None:
            continue
        lines.append(
            f"- burst, {ours_name}: TTFT p99 {p99:.1f} ms vs round_robin {rr99:.1f} ms "
            f"({rr99 / p99:.2f}x better; target 2x: {'met' if rr99 >= 2 * p99 else 'NOT met'})"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter workloads (smoke)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    parser.add_argument("--targets", help="comma-separated target names (default: all)")
    parser.add_argument("--only", help="run only the workloads whose name starts with this")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--logs", help="keep the processes' logs in this folder")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [placement] line for our targets (TOML), e.g. affinity_load_factor=2.0",
    )
    args = parser.parse_args()
    PLACEMENT_KEYS.extend(args.set)
    os.environ["PEERS_VENV"] = args.peers_venv
    chosen = [t for t in TARGETS if not args.targets or t[0] in args.targets.split(",")]
    loads = [w for w in workloads(args.quick) if not args.only or w.name.startswith(args.only)]
    rows: list[dict[str, Any]] = []
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="narwhal-placement-") as tmpdir:
        tmp = Path(args.logs or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        for w_index, workload in enumerate(loads):
            for name, start in chosen:
                run = measure(workload, name, start, tmp, args.seed * 100 + w_index)
                rows.append(run.summary())
                print(
                    f"{workload.name:14} {name:26} p50={fmt(rows[-1]['ttft_p50_ms'], 1, 1)} "
                    f"p99={fmt(rows[-1]['ttft_p99_ms'], 1, 1)} hit={rows[-1]['hit_rate']} "
                    f"share={run.prefill_share} {run.placements} queue={run.peak_waiting} "
                    f"slowest={run.slowest} "
                    f"ok={run.ok} failed={run.failed} "
                    f"{run.note}",
                    file=sys.stderr,
                    flush=True,
                )
    stamp = time.strftime("%Y-%m-%d")
    host = f"{platform.node()}, {os.cpu_count()} cores"
    command = "python bench/placement.py " + " ".join(sys.argv[1:])
    report = (
        f"# Placement benchmark, {stamp}\n\n"
        f"Command: `{command}`. Machine: {host}. "
        f"Mode: {'quick' if args.quick else 'full'}; {time.monotonic() - began:.0f} s in all.\n"
        "Fleet: p0, p1 producers (4 slots, 0.2 ms per uncached prompt token, prefix cache of "
        "480 blocks; p1 2x slower), d0, d1 consumers (16 slots, 5 ms ITL; d1 2x slower), "
        "fresh for every run; see the docstring of bench/placement.py.\n"
        + table(rows)
        + "\n"
        + targets_met(rows)
    )
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"placement-{stamp}{'-quick' if args.quick else ''}"
    (out / f"{name}.md").write_text(report + "\n")
    (out / f"{name}.json").write_text(
        json.dumps({"command": command, "rows": rows}, indent=1) + "\n"
    )
    if plot(out / f"{name}.json", out / f"{name}.png", "placement_plot.py"):
        print(f"plot: {out / name}.png")
    else:
        print("no plot (the peers venv's matplotlib failed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
