"""A first rough figure: the router's CPU and wall time for N streamed completions.

Starts two fake engines and the router as separate processes on 127.0.0.1 (so /proc gives
the router's own CPU), then drives N streamed completions of T tokens at concurrency C
with a small httpcore client, and prints a table. The real benchmark (peers side by side,
ratios) is its own issue; this is the baseline it starts from.

    python bench/rough.py --requests 1000 --concurrency 32 --tokens 64
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpcore
import msgspec
import trio

URL = re.compile(r"(http://127\.0\.0\.1:\d+)")
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start(*args: str, log: Path | None = None) -> tuple[subprocess.Popen[str], str]:
    """Start ``narwhal ARGS``; its stderr goes to ``log`` (or nowhere) once it is up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", *args], stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    for _ in range(50):
        line = proc.stderr.readline()
        match = URL.search(line)
        if match and ("fake-engine" in line or "narwhal: serving" in line):
            # keep draining: a full pipe would block the process (one log line per request)
            threading.Thread(target=_drain, args=(proc.stderr, log), daemon=True).start()
            return proc, match.group(1)
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start")


def _drain(stream: Any, log: Path | None) -> None:
    if log is None:
        stream.read()
        return
    with log.open("a") as out:
        for line in stream:
            out.write(line)


async def drive(url: str, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    body = msgspec.json.encode(
        {
            "model": "fake-model",
            "prompt": "The quick brown fox",
            "max_tokens": tokens,
            "stream": True,
        }
    )
    headers = [("content-type", "application/json")]
    latencies: list[float] = []
    failures = 0
    remaining = iter(range(requests))
    async with httpcore.AsyncConnectionPool(max_connections=concurrency) as pool:

        async def worker() -> None:
            nonlocal failures
            for _ in remaining:
                t0 = time.perf_counter()
                async with pool.stream(
                    "POST", url + "/v1/completions", headers=headers, content=body
                ) as resp:
                    data = b"".join([part async for part in resp.aiter_stream()])
                if resp.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
                    failures += 1
                latencies.append(time.perf_counter() - t0)

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
    latencies.sort()
    return {
        "failures": failures,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


async def output_reads(url: str) -> float:
    """Engine reads that carried output after the first token (the router's metrics)."""
    async with httpcore.AsyncConnectionPool() as pool:
        text = (await pool.request("GET", url + "/metrics")).content.decode()
    for line in text.splitlines():
        if line.startswith("narwhal_inter_token_latency_seconds_count"):
            return float(line.split()[-1]) + 1050  # + the first token's read, per request
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--profile", help="write a py-spy collapsed profile of the router here")
    parser.add_argument(
        "--resume-streams",
        type=int,
        default=0,
        help="[recovery] resume_streams: > 0 measures what keeping the token ids costs",
    )
    args = parser.parse_args()
    procs: list[subprocess.Popen[str]] = []
    try:
        producer, p_url = start("fake-engine", "--port", "0", "--role", "prefill")
        consumer, d_url = start("fake-engine", "--port", "0", "--role", "decode")
        procs += [producer, consumer]
        with tempfile.TemporaryDirectory() as tmp:
            fleet = Path(tmp) / "fleet.toml"
            fleet.write_text(
                f'model = "fake-model"\n[[engines]]\nid = "p0"\nurl = "{p_url}"\nrole = "prefill"\n'
                f'[[engines]]\nid = "d0"\nurl = "{d_url}"\nrole = "decode"\n'
                f"[recovery]\nresume_streams = {args.resume_streams}\n"
            )
            router, url = start("serve", "--config", str(fleet), "--port", "0")
            procs.append(router)
            trio.run(drive, url, 50, 8, args.tokens)  # warm-up: connections, imports
            if args.profile:
                spy = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "--pid",
                        str(router.pid),
                        "--format",
                        "raw",
                        "--output",
                        args.profile,
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                procs.append(spy)
            cpu0 = {p.pid: cpu_seconds(p.pid) for p in procs}
            t0 = time.perf_counter()
            load_cpu0 = time.process_time()
            result = trio.run(drive, url, args.requests, args.concurrency, args.tokens)
            wall = time.perf_counter() - t0
            load_cpu = time.process_time() - load_cpu0
            cpu = {p.pid: cpu_seconds(p.pid) - cpu0[p.pid] for p in procs}
            peak = rss_mib(router.pid)
            reads = trio.run(output_reads, url)
    finally:
        for proc in procs:
            # py-spy writes its profile on SIGINT; the servers drain on SIGTERM
            proc.send_signal(signal.SIGINT if proc.args[0] == "py-spy" else signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    n = args.requests
    print(
        f"{n} streamed {args.tokens}-token completions at c={args.concurrency}, "
        f"{os.cpu_count()} cores"
    )
    print("| what | value |\n|---|---|")
    print(f"| wall time | {wall:.2f} s ({n / wall:.0f} req/s) |")
    print(f"| router CPU | {cpu[router.pid]:.2f} s = {cpu[router.pid] / n * 1000:.2f} ms/request |")
    print(f"| producer CPU | {cpu[producer.pid]:.2f} s |")
    print(f"| consumer CPU | {cpu[consumer.pid]:.2f} s |")
    print(f"| load generator CPU | {load_cpu:.2f} s |")
    print(f"| latency p50 / p99 | {result['p50_ms']:.1f} / {result['p99_ms']:.1f} ms |")
    print(f"| router peak RSS | {peak:.0f} MiB |")
    print(f"| engine reads carrying output, per request | {reads / (n + 50):.1f} |")
    print(f"| failures | {result['failures']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
