"""Router CPU per request on long prompts that share a first block (a Mooncake-like shape).

    python bench/long_prompt_cpu.py [--requests 400] [--concurrency 8] [--tokens 16]
        [--prompt-kb 48] [--shared-kb 2] [--sessions 0] [--rounds 3] [--producers 2]
        [--consumers 2] [--engines fast|fake] [--baseline PATH] [--pure] [--profile FILE]
        [--spy FILE] [--targets a,b] [--out FILE] [--peers-venv .bench-venv]

The production trace this copies (Mooncake's conversation trace) has prompts of about 12k
tokens, 48 KB of text on average, and every prompt starts with the same block. Here each
request's prompt is ``--prompt-kb`` KB of words: its first ``--shared-kb`` KB are the same
for every request, the rest its own. Requests alternate between ``/v1/completions`` (one
prompt string) and ``/v1/chat/completions`` (the shared part as the system message, the
rest as the user's), streamed, ``--tokens`` tokens each, ``--concurrency`` at once, over
``--producers`` + ``--consumers`` fake engines on 127.0.0.1 in P/D mode. With
``--sessions S`` the requests are S conversations instead, each turn's prompt the last
turn's and 1 KB more.

Targets, measured in turn over the same engines (the order reverses every other round):
  narwhal                    this tree, ``narwhal serve`` with its defaults
  narwhal-base               with ``--baseline PATH``: the narwhal of that checkout, run by
                             this interpreter with PATH first on its import path (its own
                             compiled modules, if it has them: build them there first)
  narwhal-pure               with ``--pure``: this tree's pure-Python build (NARWHAL_PURE=1)
  vllm-router cache_aware    vllm-router 0.1.17, ``--vllm-pd-disaggregation --policy ...``
  vllm-router round_robin

Router CPU is user+system time of the router's process tree from /proc, read before and
after the measured requests only (a warm-up of ``--warmup`` requests with other prompts
comes first), divided by the requests sent. Ratios are taken within a round, then the
median over the rounds (min-max). ``--profile FILE``: after the rounds, one more run of
narwhal's pure build under cProfile on the CPU clock, the stats written to FILE (``python
-m pstats FILE``); ``--spy FILE``: the same sampled by py-spy (``$PY_SPY``, else ``py-spy``
on the PATH; a throwaway venv's will do), collapsed stacks. ``--out FILE``: the report
written there too. Nothing is asserted: the machine is shared and noisy; compare within one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio
from peers import (
    MODEL,
    Proc,
    children,
    engines_toml,
    launch_vllm_router,
    serve_narwhal,
    start_fake_engine,
    start_fast_engine,
)

from narwhal.core.faults import EngineFault, Phase
from narwhal.engines.transport import Pool, tcp_connect

WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "narwhal", "sea", "ice",
    "tusk", "deep", "cold", "blue", "swims", "north", "far", "river", "stone", "light", "once",
    "upon", "a", "time", "in", "parameters", "of", "to", "and", "ward", "zip", "context",
    "cache", "prefill", "decode", "block", "token", "engine", "router", "prompt", "reply",
    "conversation", "turn",
)  # fmt: skip
PATHS = (b"/v1/completions", b"/v1/chat/completions")
TICK = os.sysconf("SC_CLK_TCK")
# ``python -c PROFILED FILE serve ...``: narwhal under cProfile on the process's CPU clock
# (its default, wall time, charges a write with every wait for the CPU on a busy machine)
PROFILED = (
    "import cProfile, runpy, sys, time\n"
    "out = sys.argv.pop(1)\n"
    "profile = cProfile.Profile(time.process_time)\n"
    "try:\n"
    "    profile.runcall(runpy.run_module, 'narwhal', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    profile.dump_stats(out)\n"
)


def text(rng: random.Random, size: int) -> str:
    """About ``size`` bytes of space-separated words (ASCII: a byte a character)."""
    out: list[str] = []
    length = 0
    while length < size:  # bounded: every word adds at least two bytes
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:size]


def bodies(count: int, salt: int, args: argparse.Namespace) -> list[tuple[bytes, bytes]]:
    """(path, body) per request: even ones completions, odd ones chat; one shared head.
    With ``--sessions S``, request i is turn i // S of conversation i % S: its prompt is
    the turn before's and 1 KB more (a conversation is all chat or all completions)."""
    shared = text(random.Random(0), args.shared_kb * 1024)
    rest = args.prompt_kb * 1024 - len(shared)
    sessions = args.sessions
    turns = -(-count // sessions) if sessions else 1
    texts = [text(random.Random(f"{salt}-s{k}"), rest + turns * 1024) for k in range(sessions)]
    out = []
    for i in range(count):
        if sessions:
            own, chat = texts[i % sessions][: rest + i // sessions * 1024], i % sessions % 2 == 1
        else:
            own, chat = text(random.Random(f"{salt}-{i}"), rest), i % 2 == 1
        body: dict[str, object] = {"model": MODEL, "max_tokens": args.tokens, "stream": True}
        if chat:
            body["messages"] = [
                {"role": "system", "content": shared},
                {"role": "user", "content": own},
            ]
        else:
            body["prompt"] = shared + own
        out.append((PATHS[chat], msgspec.json.encode(body)))
    return out


async def one(pool: Pool, path: bytes, body: bytes) -> str | None:
    """One streamed request; why it failed, or None."""
    tail = b""
    headers = [(b"content-type", b"application/json")]
    async with await pool.request(b"POST", path, headers, body, phase=Phase.DECODE) as resp:
        while (batch := await resp.next_batch()) is not None:  # bounded by the stream's end
            tail = (tail + batch)[-64:]
        if resp.status != 200:
            return f"HTTP {resp.status}"
    return None if tail.endswith(b"data: [DONE]\n\n") else "no [DONE]"


def load(url: str, work: list[tuple[bytes, bytes]], concurrency: int) -> dict[str, int]:
    """Send ``work`` through the router at ``url``; failures by why (``ok``: the rest)."""
    counts: dict[str, int] = {}

    async def main() -> None:
        pool = Pool(url, tcp_connect, 60.0, concurrency + 4)
        queue = iter(work)

        async def worker() -> None:
            for path, body in queue:  # bounded: the list's length
                try:
                    why = await one(pool, path, body)
                except EngineFault as exc:
                    why = f"{type(exc).__name__}"
                key = why or "ok"
                counts[key] = counts.get(key, 0) + 1

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)

    trio.run(main)
    return counts


def cpu_of(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process and its children, threads included."""
    user = system = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / TICK
        system += int(fields[12]) / TICK
    return user, system


@dataclass
class Row:
    target: str
    round: int
    cpu_ms: float  # router CPU per request
    sys_ms: float  # the system time part of it
    wall_s: float
    counts: dict[str, int]


Start = Callable[[list[str], list[str], Path], tuple[Proc, str]]


def narwhal(
    name: str,
    root: str | None = None,
    pure: bool = False,
    launcher: tuple[str, ...] = ("-m", "narwhal"),
) -> Start:
    """``narwhal serve`` with its defaults over these engines (``root``: another checkout's
    narwhal; ``launcher``: what the interpreter runs before ``serve``)."""

    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        fleet = (
            f'model = "{MODEL}"\n' + engines_toml(prefills, decodes) + "[serving]\n"
            "max_inflight = 20000\n[engine]\nfirst_token_timeout_s = 120.0\n"
        )
        return serve_narwhal(fleet, tmp, name=name, root=root, pure=pure, launcher=launcher)

    return start


def build_of(root: str | None, pure: bool) -> str:
    """What ``narwhal --version`` says of the build that target runs."""
    proc = subprocess.run(
        [sys.executable, "-m", "narwhal", "--version"],
        cwd=None if root is None else Path(root).absolute(),
        env={
            **os.environ,
            **({} if root is None else {"PYTHONPATH": str(Path(root).absolute())}),
            "NARWHAL_PURE": "1" if pure else "",
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else proc.stderr[-200:]


def vllm_router(policy: str) -> Start:
    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        return launch_vllm_router(prefills, decodes, tmp, ("--policy", policy))

    return start


def measure(
    name: str,
    start: Start,
    engines: tuple[list[str], list[str]],
    work: tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]]],
    args: argparse.Namespace,
    tmp: Path,
    n: int,
    spy: str | None = None,
) -> Row:
    """One target, started, warmed, measured and stopped; with ``spy``, py-spy samples it
    during the measured requests into that file (collapsed stacks)."""
    proc, url = start(engines[0], engines[1], tmp)
    sampler: subprocess.Popen[bytes] | None = None
    try:
        warm, measured = work
        load(url, warm, args.concurrency)
        if spy is not None:
            sampler = subprocess.Popen(
                [
                    *(os.environ.get("PY_SPY", "py-spy"), "record", "--pid", str(proc.proc.pid)),
                    *("--format", "raw", "--rate", "500", "--nonblocking", "--output", spy),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # it attaches
        (user0, sys0), t0 = cpu_of(proc.proc.pid), time.perf_counter()
        counts = load(url, measured, args.concurrency)
        wall = time.perf_counter() - t0
        user, system = cpu_of(proc.proc.pid)
    finally:
        if sampler is not None:
            sampler.send_signal(signal.SIGINT)  # it writes its file and exits
            sampler.wait(timeout=30)
        proc.stop()
    per = 1000 / len(measured)
    return Row(name, n, (user + system - user0 - sys0) * per, (system - sys0) * per, wall, counts)


def start_fleet(args: argparse.Namespace, tmp: Path) -> tuple[list[Proc], list[str], list[str]]:
    start = start_fast_engine if args.engines == "fast" else start_fake_engine
    procs: list[Proc] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    try:
        for role, count in (("prefill", args.producers), ("decode", args.consumers)):
            for i in range(count):
                extra = ["--max-model-len", "131072", "--kv-lease-s", "480", "--itl-s", "0"]
                argv = [*extra, "--engine-id", f"{role[0]}{i}"]
                proc, url = start(role, argv, tmp / f"engine-{role[0]}{i}.log")
                procs.append(proc)
                urls[role].append(url)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs, urls["prefill"], urls["decode"]


def spread(values: list[float], digits: int = 2, unit: str = "") -> str:
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.{digits}f}{unit}"
    return f"{mid:.{digits}f}{unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(rows: list[Row], names: list[str]) -> str:
    peers = [n for n in names if n.startswith("vllm-router")]
    ours = [n for n in names if n.startswith("narwhal")]
    head = ["target", "router CPU ms/req", "of it system", *(f"vs {p}" for p in peers)]
    if "narwhal-base" in names:
        head.append("vs narwhal-base")
    lines = ["| " + " | ".join([*head, "req/s", "ok/failed"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 2))
    by = {(r.target, r.round): r for r in rows}

    def ratios(target: str, peer: str) -> list[float]:
        return [
            r.cpu_ms / by[(peer, r.round)].cpu_ms
            for r in rows
            if r.target == target and (peer, r.round) in by
        ]

    for name in names:
        mine = [r for r in rows if r.target == name]
        cells = [name, spread([r.cpu_ms for r in mine]), spread([r.sys_ms for r in mine])]
        others = [*peers, *(["narwhal-base"] if "narwhal-base" in names else [])]
        cells += [spread(ratios(name, p), unit="x") if name in ours else "" for p in others]
        rps = [sum(r.counts.values()) / r.wall_s for r in mine if r.wall_s]
        ok = sum(r.counts.get("ok", 0) for r in mine)
        failed = sum(v for r in mine for k, v in r.counts.items() if k != "ok")
        cells += [spread(rps, 0), f"{ok}/{failed}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-kb", type=int, default=48)
    parser.add_argument("--shared-kb", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--sessions", type=int, default=0, help="conversations: each turn's prompt extends the last"
    )
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--engines", choices=("fast", "fake"), default="fast")
    parser.add_argument("--baseline", help="another checkout of narwhal, run as narwhal-base")
    parser.add_argument("--pure", action="store_true", help="also this tree's pure build")
    parser.add_argument("--profile", help="cProfile narwhal's pure build into this file")
    parser.add_argument(
        "--spy", help="py-spy ($PY_SPY) samples narwhal's pure build into this file"
    )
    parser.add_argument("--targets", help="comma-separated target names (default: all)")
    parser.add_argument("--out", help="write the report (markdown) here too")
    parser.add_argument("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    args = parser.parse_args()
    os.environ["PEERS_VENV"] = args.peers_venv
    targets: list[tuple[str, Start]] = [("narwhal", narwhal("narwhal"))]
    if args.baseline:
        targets.append(("narwhal-base", narwhal("narwhal-base", root=args.baseline)))
    if args.pure:
        targets.append(("narwhal-pure", narwhal("narwhal-pure", pure=True)))
    targets += [
        ("vllm-router cache_aware", vllm_router("cache_aware")),
        ("vllm-router round_robin", vllm_router("round_robin")),
    ]
    if args.targets:
        targets = [t for t in targets if t[0] in args.targets.split(",")]
    names = [name for name, _ in targets]
    work = (bodies(args.warmup, 1, args), bodies(args.requests, 2, args))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="narwhal-long-prompt-") as tmpdir:
        tmp = Path(tmpdir)
        procs, prefills, decodes = start_fleet(args, tmp)
        try:
            for n in range(args.rounds):
                for name, start in targets if n % 2 == 0 else targets[::-1]:
                    row = measure(name, start, (prefills, decodes), work, args, tmp, n)
                    rows.append(row)
                    print(
                        f"round {n + 1}/{args.rounds} {name:26} cpu/req={row.cpu_ms:6.2f} ms "
                        f"(sys {row.sys_ms:5.2f}) "
                        f"{row.counts}",
                        file=sys.stderr,
                        flush=True,
                    )
            if args.profile:
                out = str(Path(args.profile).absolute())
                launcher = ("-c", PROFILED, out)
                start = narwhal("narwhal-profiled", pure=True, launcher=launcher)
                row = measure(
                    "narwhal-pure (cProfile)", start, (prefills, decodes), work, args, tmp, 0
                )
                print(
                    f"profile: {out} ({row.cpu_ms:.2f} ms/req under the profiler)", file=sys.stderr
                )
            if args.spy:
                start = narwhal("narwhal-sampled", pure=True)
                out = str(Path(args.spy).absolute())
                row = measure(
                    "narwhal-pure (py-spy)", start, (prefills, decodes), work, args, tmp, 0, out
                )
                print(f"py-spy: {out} ({row.cpu_ms:.2f} ms/req sampled)", file=sys.stderr)
        finally:
            for proc in procs:
                proc.stop()
    host = f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}"
    builds = [f"narwhal: {build_of(None, False)}"]
    if args.baseline:
        builds.append(f"narwhal-base ({args.baseline}): {build_of(args.baseline, False)}")
    text_out = (
        f"Machine: {host}. {args.requests} requests ({args.warmup} warm-up) per target and "
        f"round, {args.rounds} round(s), c={args.concurrency}, {args.tokens} tokens, "
        f"{args.prompt_kb} KB prompts sharing their first {args.shared_kb} KB"
        + (f" in {args.sessions} conversations (+1 KB a turn)" if args.sessions else "")
        + f", half completions and half chat, {args.producers}P+{args.consumers}D {args.engines} "
        f"engines. Builds: {'; '.join(builds)}.\n\n" + report(rows, names)
    )
    print(text_out)
    if args.out:
        Path(args.out).write_text(text_out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
