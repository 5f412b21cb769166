"""Soak (issue 6): many requests with mixed engine faults, watching the router for growth.

Two producers and two consumers (fake engines, separate processes) break about 5% of
requests in mixed ways (5xx, reset mid-body, missing descriptor, close mid-stream, in-stream
error, silence, malformed chunk). The router runs as its own process, so /proc gives its
RSS and open descriptors; ``narwhal_tasks`` on /metrics gives its live trio tasks.

    python bench/soak.py --requests 20000 --concurrency 64     # make soak

Reports RSS growth after the warm-up, the RSS slope (MiB per 100k requests, least squares
over the samples after the warm-up), and descriptors and tasks after the drain against
their idle baseline. Exit status 1 when a bound of the issue is not met.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpcore
import msgspec
import trio
from rough import start

MIB = 1024 * 1024
WARMUP = 2000
SAMPLE_EVERY = 500
PRODUCER_FAULTS = [
    {"kind": "status", "status": 503, "rate": 0.01},
    {"kind": "close_mid_body", "rate": 0.005},
    {"kind": "no_descriptor", "rate": 0.005},
]
CONSUMER_FAULTS = [
    {"kind": "tokens_then_close", "tokens": 3, "rate": 0.01},
    {"kind": "stream_error", "tokens": 2, "code": 500, "rate": 0.005},
    {"kind": "status", "status": 503, "leg": "decode", "rate": 0.005},
    {"kind": "tokens_then_silence", "tokens": 2, "rate": 0.005},
    {"kind": "malformed_chunk", "tokens": 2, "rate": 0.005},
]
FLEET = """\
model = "fake-model"
[[engines]]
id = "p0"
url = "{p0}"
role = "prefill"
[[engines]]
id = "p1"
url = "{p1}"
role = "prefill"
[[engines]]
id = "d0"
url = "{d0}"
role = "decode"
[[engines]]
id = "d1"
url = "{d1}"
role = "decode"
[serving]
request_timeout_s = 10.0
prefill_timeout_s = 2.0
max_attempts = 2
[engine]
first_token_timeout_s = 2.0
decode_read_timeout_s = 0.5
[recovery]
readmit_interval_s = 1.0
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sockets(pid: int) -> str:
    """The router's sockets and their states, and its descriptors by kind (what is left)."""
    out = subprocess.run(
        ["lsof", "-nP", "-a", "-p", str(pid), "-i"], capture_output=True, text=True, check=False
    ).stdout
    fds = f"/proc/{pid}/fd"
    kinds = Counter(os.readlink(f"{fds}/{fd}").split(":")[0] for fd in os.listdir(fds))
    return "\n".join(out.splitlines()[1:]) + f"\ndescriptor kinds: {dict(kinds)}"


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def tasks(pool: httpcore.AsyncConnectionPool, url: str) -> int:
    text = (await pool.request("GET", url + "/metrics")).content.decode()
    for line in text.splitlines():
        if line.startswith("narwhal_tasks "):
            return int(float(line.split()[1]))
    raise RuntimeError("no narwhal_tasks on /metrics")


async def arm(url: str, faults: list[dict[str, object]]) -> None:
    async with httpcore.AsyncConnectionPool() as pool:
        resp = await pool.request("POST", url + "/fake/faults", content=msgspec.json.encode(faults))
        assert resp.status == 200, resp.content


async def injected(url: str) -> int:
    """Faults this engine struck (legs: a retried request can meet more than one)."""
    async with httpcore.AsyncConnectionPool() as pool:
        stats = msgspec.json.decode((await pool.request("GET", url + "/fake/stats")).content)
    return sum(v for k, v in stats["counters"].items() if k.startswith("fault_"))


async def soak(url: str, pid: int, requests: int, concurrency: int) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    samples: list[tuple[int, float]] = []
    done = 0
    remaining = iter(range(requests))
    async with httpcore.AsyncConnectionPool() as admin:
        idle_tasks, idle_fds = await tasks(admin, url), open_fds(pid)

    # like httpx and the openai client: idle connections expire after 5 s, below the router's
    # client_idle_timeout_s, so the client never reuses one the router is closing (without
    # it, a connection left idle for 15 s met the router's close: "server disconnected")
    pool = httpcore.AsyncConnectionPool(max_connections=concurrency, keepalive_expiry=5.0)
    async with pool:

        async def worker() -> None:
            nonlocal done
            for i in remaining:
                stream = i % 2 == 0
                body = {"model": "fake-model", "prompt": f"soak {i} the quick brown fox"}
                body |= {"max_tokens": 16, "stream": stream}
                outcomes[await _one(pool, url + "/v1/completions", body)] += 1
                done += 1
                if done % SAMPLE_EVERY == 0:
                    samples.append((done, rss_mib(pid)))

        with trio.fail_after(3600):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)

    # drain: the client's connections are closed; the router's idle engine connections expire
    async with httpcore.AsyncConnectionPool() as admin:
        with trio.move_on_after(15):
            while True:  # bounded by the scope above: polls another process's state
                after_tasks, after_fds = await tasks(admin, url), open_fds(pid)
                if after_tasks <= idle_tasks and after_fds <= idle_fds:
                    break
                await trio.sleep(0.5)
    if after_fds > idle_fds:
        print(f"router sockets still open after the drain:\n{sockets(pid)}")
    return {
        "outcomes": outcomes,
        "samples": samples,
        "idle_tasks": idle_tasks,
        "idle_fds": idle_fds,
        "after_tasks": after_tasks,
        "after_fds": after_fds,
    }


async def _one(pool: httpcore.AsyncConnectionPool, url: str, body: dict[str, Any]) -> str:
    headers = [("content-type", "application/json")]
    with trio.move_on_after(30):  # bounded: a hang is counted, not waited out
        try:
            parts: list[bytes] = []
            async with pool.stream(
                "POST", url, headers=headers, content=msgspec.json.encode(body)
            ) as resp:
                try:
                    parts += [part async for part in resp.aiter_stream()]
                except httpcore.RemoteProtocolError:
                    last = b"".join(parts).rsplit(b"data: ", 1)[-1]
                    if not (body["stream"] and b'"error"' in last):
                        raise
                    return "200+terminal error"  # the terminal event, then the cut (contract 6)
        except (httpcore.NetworkError, httpcore.RemoteProtocolError) as exc:
            return f"connection error ({type(exc).__name__})"  # the router broke a connection
        return _outcome(resp.status, b"".join(parts), body["stream"])
    return "hung"


def _outcome(status: int, data: bytes, stream: bool) -> str:
    if status != 200:
        return str(status)
    if not stream:
        return "200"
    if data.endswith(b"data: [DONE]\n\n"):
        return "200"
    if b'"error"' in data.rsplit(b"data: ", 1)[-1]:
        return "200+terminal error"
    return "200 CUT"  # a stream cut without a terminal event: an invariant broken


def slope_per_100k(samples: list[tuple[int, float]]) -> float:
    points = [(n, r) for n, r in samples if n >= WARMUP]
    if len(points) < 2:
        return 0.0
    mean_n = sum(n for n, _ in points) / len(points)
    mean_r = sum(r for _, r in points) / len(points)
    num = sum((n - mean_n) * (r - mean_r) for n, r in points)
    den = sum((n - mean_n) ** 2 for n, _ in points)
    return num / den * 100_000


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--router-log", default="soak-router.log", help="the router's stderr")
    args = parser.parse_args()
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = {}
        for eid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
            proc, urls[eid] = start("fake-engine", "--port", "0", "--role", role)
            procs.append(proc)
            faults = PRODUCER_FAULTS if role == "prefill" else CONSUMER_FAULTS
            trio.run(arm, urls[eid], faults)
        with tempfile.TemporaryDirectory() as tmp:
            fleet = Path(tmp) / "fleet.toml"
            fleet.write_text(FLEET.format(**urls))
            router_log = Path(args.router_log)
            router, url = start("serve", "--config", str(fleet), "--port", "0", log=router_log)
            procs.append(router)
            t0 = time.perf_counter()
            result = trio.run(soak, url, router.pid, args.requests, args.concurrency)
            wall = time.perf_counter() - t0
            result["injected"] = sum(trio.run(injected, u) for u in urls.values())
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return report(args, result, wall)


def report(args: argparse.Namespace, result: dict[str, Any], wall: float) -> int:
    samples: list[tuple[int, float]] = result["samples"]
    outcomes: Counter[str] = result["outcomes"]
    warm = next((r for n, r in samples if n >= WARMUP), samples[0][1])
    end = samples[-1][1]
    growth, slope = end - warm, slope_per_100k(samples)
    failed = sum(v for k, v in outcomes.items() if k != "200")
    fds = (result["idle_fds"], result["after_fds"])
    tasks = (result["idle_tasks"], result["after_tasks"])
    every = max(1, len(samples) // 10)
    rows = [
        ("outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())), "no hung/CUT"),
        ("faults the engines struck", f"{result['injected']} legs", "about 5% of requests"),
        ("requests the client saw fail", f"{failed} ({failed / args.requests:.1%})", ""),
        (f"router RSS after {WARMUP} / at the end", f"{warm:.1f} / {end:.1f} MiB", ""),
        ("RSS growth after warm-up", f"{growth:+.1f} MiB", "<= 20 MiB"),
        ("RSS slope", f"{slope:+.2f} MiB per 100k requests", ""),
        ("open descriptors idle / after drain", f"{fds[0]} / {fds[1]}", "back to idle"),
        ("trio tasks idle / after drain", f"{tasks[0]} / {tasks[1]}", "back to idle"),
        (
            "RSS samples (requests: MiB)",
            ", ".join(f"{n}: {r:.1f}" for n, r in samples[::every]),
            "",
        ),
    ]
    cores = os.cpu_count()
    print(f"soak: {args.requests} requests at c={args.concurrency}, {cores} cores, {wall:.0f} s")
    print("| figure | value | bound |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    broken = sum(v for k, v in outcomes.items() if k.startswith("connection error"))
    ok = (
        growth <= 20
        and broken == 0
        and outcomes["hung"] == 0
        and outcomes["200 CUT"] == 0
        and fds[1] <= fds[0]
        and tasks[1] <= tasks[0]
    )
    print("every bound met" if ok else "A BOUND IS NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
