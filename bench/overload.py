"""Flow control under overload, routers side by side in one run (``make bench-overload``).

    python bench/overload.py [--quick] [--peers-venv .bench-venv] [--out bench/results]

The fleet, started afresh for every target (``narwhal fake-engine`` with its cost model):
  p0, p1  producers: 2 slots, 1 ms of prefill per prompt token (a 200-token prompt: 200 ms),
          so 20 prefills/s in all
  d0, d1  consumers: 4 slots, 25 ms between tokens, 32 output tokens (0.8 s a stream), so
          10 streams/s in all: the fleet's capacity is 10 requests/s
Every engine queues what its slots cannot take (FIFO, ``vllm:num_requests_waiting``), and
holds KV for 480 s (bench/peers.py's lease: the bench measures scheduling, not expiry).

The load, open loop (Poisson arrivals from a fixed seed; the same schedule to every
target): 30 s at 0.5x capacity (the baseline: TTFT and router CPU per request with room),
60 s at 2x, then 30 s at 0.5x. Every request is of a class: 10% ``interactive``, 30%
``default``, 60% ``batch``; the batch half comes from two tenants offering 10:1. Classes
and tenants travel as ``x-narwhal-priority`` and ``x-narwhal-tenant``; the peers ignore
them. A client gives up after 150 s.

Per class: TTFT p50/p99 (from the scheduled arrival: a client's wait) in each phase;
goodput, the requests that finished with a TTFT within the class's SLO (interactive 1 s,
default 5 s, batch 30 s); sheds (429/503). Per batch tenant: first tokens per second while
both had requests waiting (the overload phase's last two thirds). Router CPU per request
over the first phase (user+system of its process tree, from /proc).

Targets: ``queue`` (this router, the default ``[admission]``), ``queue, waiting limit 1``
(``engine_waiting_limit = 1``), ``no-queue`` (this router, ``admission.queue = false``:
every admitted request to the engines at once, as before), ``vllm-router`` 0.1.17 and
``narwhal-0.7`` (0.7.0) from the peers venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
from peers import (
    MODEL,
    Proc,
    _failure,
    engines_toml,
    launch_narwhal07,
    launch_vllm_router,
    pct,
    plot,
    serve_narwhal,
    start_fake_fleet,
    tree_cpu,
)
from placement import warm_up

from narwhal.core.faults import EngineFault, Phase
from narwhal.engines.transport import Pool, tcp_connect

CAPACITY = 10.0  # requests/s the fleet below finishes (its consumers' slots)
PROMPT_WORDS, OUTPUT_TOKENS = 200, 32
PRODUCER = ["--slots", "2", "--prefill-ms-per-token", "1.0"]
CONSUMER = ["--slots", "4", "--itl-s", "0.025"]
FLEET = [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")]
LEASE_S = 480.0
CLIENT_TIMEOUT_S = 150.0
SLO_S = {"interactive": 1.0, "default": 5.0, "batch": 30.0}
MIX = [("interactive", "i", 0.10), ("default", "d", 0.30), ("batch", "big", 0.60 * 10 / 11)]
MIX += [("batch", "small", 0.60 * 1 / 11)]
PHASES = [("0.5x", 0.5, 30.0), ("2x", 2.0, 60.0), ("0.5x after", 0.5, 30.0)]
QUICK_PHASES = [("0.5x", 0.5, 10.0), ("2x", 2.0, 20.0), ("0.5x after", 0.5, 10.0)]


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the start
    phase: str
    cls: str
    tenant: str
    body: bytes


def schedule(phases: list[tuple[str, float, float]], seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    out, start = [], 0.0
    for name, load, length in phases:
        at = start
        while True:
            at += rng.expovariate(load * CAPACITY)
            if at >= start + length:
                break
            cls, tenant = rng.choices([(c, t) for c, t, _ in MIX], [w for *_, w in MIX])[0]
            words = " ".join(f"w{rng.randrange(50_000)}" for _ in range(PROMPT_WORDS))
            body = {
                "model": MODEL,
                "prompt": words,
                "max_tokens": OUTPUT_TOKENS,
                "stream": True,
                "temperature": 0,
            }
            out.append(Arrival(at, name, cls, tenant, msgspec.json.encode(body)))
        start += length
    return out


@dataclass
class Outcome:
    arrival: Arrival
    status: str  # "ok", "HTTP 429", ...
    ttft: float | None = None  # from the scheduled arrival
    done_at: float | None = None  # seconds from the start


@dataclass
class Run:
    target: str
    outcomes: list[Outcome] = field(default_factory=list)
    cpu_per_request_ms: float | None = None
    wall_s: float = 0.0
    note: str = ""

    def summary(self, phases: list[tuple[str, float, float]]) -> dict[str, Any]:
        classes: dict[str, Any] = {}
        for cls in SLO_S:
            mine = [o for o in self.outcomes if o.arrival.cls == cls]
            row: dict[str, Any] = {"sent": len(mine)}
            for phase, *_ in phases:
                ttfts = [o.ttft for o in mine if o.arrival.phase == phase and o.ttft is not None]
                row[f"ttft_p50_{phase}"] = _ms(pct(ttfts, 0.5))
                row[f"ttft_p99_{phase}"] = _ms(pct(ttfts, 0.99))
            row["goodput"] = sum(
                1 for o in mine if o.status == "ok" and o.ttft is not None and o.ttft <= SLO_S[cls]
            )
            row["shed"] = sum(1 for o in mine if o.status in ("HTTP 429", "HTTP 503"))
            row["failed"] = sum(1 for o in mine if o.status not in ("ok", "HTTP 429", "HTTP 503"))
            classes[cls] = row
        tenants = self.tenant_rates(phases)
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if o.status != "ok":
                errors[o.status] = errors.get(o.status, 0) + 1
        return {
            "target": self.target,
            "classes": classes,
            "goodput": sum(row["goodput"] for row in classes.values()),
            "batch_tenants_per_s": tenants,
            "cpu_per_request_ms": self.cpu_per_request_ms,
            "wall_s": round(self.wall_s, 1),
            "errors": errors,
            "note": self.note,
        }

    def tenant_rates(self, phases: list[tuple[str, float, float]]) -> dict[str, float | None]:
        """Each batch tenant's first tokens per second over the overload phase's last two
        thirds, at the moments when both tenants had a request waiting for its first token
        (sampled every 0.1 s)."""
        waits: dict[str, list[tuple[float, float]]] = {"big": [], "small": []}
        served: dict[str, list[float]] = {"big": [], "small": []}  # their first tokens
        for o in self.outcomes:
            if o.arrival.tenant in waits and o.done_at is not None:
                end = o.arrival.at + o.ttft if o.ttft is not None else o.done_at
                waits[o.arrival.tenant].append((o.arrival.at, end))
                if o.ttft is not None:  # a shed or failed request was not served
                    served[o.arrival.tenant].append(end)
        # the overload phase less its first third, while the backlog builds
        start, length = phases[0][2] + phases[1][2] / 3, phases[1][2] * 2 / 3
        step, both, firsts = 0.1, 0, {"big": 0, "small": 0}
        t = start
        while t < start + length:
            if all(any(a <= t < b for a, b in spans) for spans in waits.values()):
                both += 1
                for tenant, times in served.items():
                    firsts[tenant] += sum(1 for b in times if t <= b < t + step)
            t += step
        if not both:
            return {"big": None, "small": None}
        return {tenant: round(n / (both * step), 3) for tenant, n in firsts.items()}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


async def one(pool: Pool, arrival: Arrival, t0: float) -> Outcome:
    headers = [
        (b"content-type", b"application/json"),
        (b"x-narwhal-priority", arrival.cls.encode()),
        (b"x-narwhal-tenant", arrival.tenant.encode()),
    ]
    sent_at = t0 + arrival.at
    first: float | None = None
    tail = b""
    async with await pool.request(
        b"POST", b"/v1/completions", headers, arrival.body, phase=Phase.DECODE
    ) as resp:
        while (batch := await resp.next_batch()) is not None:
            if first is None and b"data: {" in batch:
                first = trio.current_time() - sent_at
            tail = (tail + batch)[-64:]
        failure = _failure(resp.status, tail)
    return Outcome(arrival, failure or "ok", first if failure is None else None)


async def replay(
    arrivals: list[Arrival], url: str, run: Run, pid: int | None, cpu_at: float
) -> None:
    pool = Pool(url, tcp_connect, 60.0, 4096)
    t0 = trio.current_time()

    async def send(arrival: Arrival) -> None:
        outcome = Outcome(arrival, "timeout")
        with trio.move_on_after(CLIENT_TIMEOUT_S):
            try:
                outcome = await one(pool, arrival, t0)
            except EngineFault as exc:
                outcome = Outcome(arrival, type(exc).__name__)
        outcome.done_at = trio.current_time() - t0
        run.outcomes.append(outcome)

    async def cpu_of_first_phase() -> None:
        if pid is None:
            return
        before = tree_cpu(pid)
        await trio.sleep_until(t0 + cpu_at)
        sent = sum(1 for a in arrivals if a.at < cpu_at)
        run.cpu_per_request_ms = round((tree_cpu(pid) - before) / sent * 1000, 3)

    with trio.fail_after(arrivals[-1].at + CLIENT_TIMEOUT_S + 30):  # bounded, always
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cpu_of_first_phase)
            for arrival in arrivals:
                await trio.sleep_until(t0 + arrival.at)
                nursery.start_soon(send, arrival)
    run.wall_s = trio.current_time() - t0


def ours(queue: bool, waiting_limit: int = 2) -> Any:
    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        return serve_narwhal(
            f'model = "{MODEL}"\n' + engines_toml(prefills, decodes) + "[serving]\n"
            "max_inflight = 20000\nrequest_timeout_s = 150.0\nprefill_timeout_s = 150.0\n"
            # the peers have no first-token timeout: measure scheduling, not our default
            "[engine]\nmax_connections = 20000\nfirst_token_timeout_s = 150.0\n"
            f"kv_lease_s = {LEASE_S}\n"
            f"[admission]\nqueue = {str(queue).lower()}\n"
            f"engine_waiting_limit = {waiting_limit}\n",
            tmp,
            name=f"narwhal-queue-{waiting_limit}" if queue else "narwhal-no-queue",
        )

    return start


TARGETS: list[tuple[str, Any]] = [
    ("queue", ours(True)),
    # the same with one waiting leg per engine, not two: less engine queue ahead of an
    # interactive request, at the cost of an engine idling between legs
    ("queue, waiting limit 1", ours(True, 1)),
    ("no-queue", ours(False)),
    ("vllm-router", launch_vllm_router),
    ("narwhal-0.7", launch_narwhal07),
]


def start_fleet(tmp: Path) -> tuple[list[Proc], dict[str, str]]:
    lease = ["--kv-lease-s", str(LEASE_S)]
    return start_fake_fleet(
        [
            (name, role, [*(PRODUCER if role == "prefill" else CONSUMER), *lease])
            for name, role in FLEET
        ],
        tmp,
    )


def measure(name: str, start: Any, arrivals: list[Arrival], cpu_at: float, tmp: Path) -> Run:
    run = Run(name)
    engines, urls = start_fleet(tmp)
    try:
        prefills = [urls[n] for n, role in FLEET if role == "prefill"]
        decodes = [urls[n] for n, role in FLEET if role == "decode"]
        try:
            proc, url = start(prefills, decodes, tmp)
        except (OSError, RuntimeError) as exc:
            run.note = f"not measured: {exc}"[:200]
            return run
        try:
            warm_up(url)  # connections open, first health checks and scrapes landed
            trio.run(replay, arrivals, url, run, proc.proc.pid, cpu_at)
        finally:
            proc.stop()
    finally:
        for engine in engines:
            engine.stop()
    return run


def table(rows: list[dict[str, Any]], phases: list[tuple[str, float, float]]) -> str:
    names = [p for p, *_ in phases]
    head = [
        "target",
        "class",
        *(f"TTFT p50 / p99 ms, {p}" for p in names),
        "goodput",
        "shed",
        "other failures",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for cls, c in r["classes"].items():
            cells = [r["target"], cls]
            cells += [f"{_f(c[f'ttft_p50_{p}'])} / {_f(c[f'ttft_p99_{p}'])}" for p in names]
            cells += [f"{c['goodput']} of {c['sent']}", str(c["shed"]), str(c["failed"])]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| target | goodput (all classes) | batch tenants, first tokens/s while both wait "
        "(big / small) | router CPU per request at 0.5x, ms |",
        "|---|---|---|---|",
    ]
    for r in rows:
        t = r["batch_tenants_per_s"]
        cpu = _f(r["cpu_per_request_ms"])
        rates = f"{_f(t['big'])} / {_f(t['small'])}"
        lines.append(f"| {r['target']} | {r['goodput']} | {rates} | {cpu} |")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def targets_met(rows: list[dict[str, Any]], phases: list[tuple[str, float, float]]) -> str:
    by = {r["target"]: r for r in rows}
    q, nq = by.get("queue"), by.get("no-queue")
    if q is None or nq is None:
        return "(queue and no-queue both needed)"
    low, high = phases[0][0], phases[1][0]

    def inter(r: dict[str, Any], phase: str) -> float | None:
        value = r["classes"]["interactive"][f"ttft_p99_{phase}"]
        return None if value is None else float(value)

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or not b else f"{a / b:.2f}x"

    ours, before = ratio(inter(q, high), inter(q, low)), ratio(inter(nq, high), inter(nq, low))
    out = [
        f"- interactive TTFT p99 at 2x over its p99 at 0.5x: queue {ours} (target <= 3x), "
        f"no-queue {before} (target: >= 10x)",
    ]
    for peer in ("no-queue", "vllm-router"):
        other = by.get(peer)
        if other is not None:
            times = ratio(q["goodput"], other["goodput"])
            out.append(f"- goodput, queue over {peer}: {times} (target >= 1.5x)")
    t = q["batch_tenants_per_s"]
    share = ratio(t["big"], t["small"])
    out.append(f"- batch tenants while both wait, big / small: {share} (target 0.9-1.1)")
    out.append(
        f"- router CPU per request at 0.5x, queue over no-queue: "
        f"{ratio(q['cpu_per_request_ms'], nq['cpu_per_request_ms'])} (target <= 1.05x)"
    )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--only", default="", help="comma-separated targets")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    os.environ["PEERS_VENV"] = args.peers_venv
    phases = QUICK_PHASES if args.quick else PHASES
    arrivals = schedule(phases, args.seed)
    only = set(filter(None, args.only.split(",")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="narwhal-overload-") as tmp:
        for name, start in TARGETS:
            if only and name not in only:
                continue
            print(
                f"{name}: {len(arrivals)} requests over {sum(p[2] for p in phases):g} s", flush=True
            )
            run = measure(name, start, arrivals, phases[0][2], Path(tmp))
            rows.append(run.summary(phases))
            print(json.dumps(rows[-1]), flush=True)
    stamp = time.strftime("%Y-%m-%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"overload-{stamp}{'-quick' if args.quick else ''}"
    meta = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "phases": phases,
    }
    base.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = "\n\n".join(
        [f"# Overload ({stamp})", table(rows, phases), "## Targets", targets_met(rows, phases)]
    )
    base.with_suffix(".md").write_text(text + "\n")
    plotted = plot(base.with_suffix(".json"), base.with_suffix(".png"), "overload_plot.py")
    print(text)
    print(f"written: {base}.md, .json{', .png' if plotted else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
