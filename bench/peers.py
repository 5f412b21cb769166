"""Routers side by side, in one run, over the same fake engines (issue: benchmarks).

    python bench/peers.py [--quick] [--peers-venv .bench-venv] [--out bench/results]
                          [--baseline PATH] [--rounds N]

Targets, measured in turn per scenario over the same pair of fake engines:
  lower-bound   a minimal client doing prefill then decode itself (kept-alive connections)
  narwhal       this router (``narwhal serve``), the build ``narwhal --version`` names
  narwhal-pure  this router's pure-Python build (NARWHAL_PURE=1, docs/build.md)
  vllm-router   vllm-router 0.1.17 (``--vllm-pd-disaggregation``), from the peers venv
  narwhal-0.7   narwhal-inference 0.7.0, from the peers venv, when it can be configured
  narwhal-main  with ``--baseline PATH``: the narwhal of another checkout (today's main),
                run by this Python with PATH first on its import path: an A/B in one run

Scenarios: (a) c=32, 64-token streams, no inter-token delay; (b) c=1 (time to first token
added over the lower bound); (c) open streams, 50 ms between tokens; (d) 8k-token
prompts, 16 output tokens. ``--quick`` runs fewer requests and skips (c) and (d).

Router CPU is user+system time of the router's process tree (from /proc) over the load
phase only. The load generator reports its own CPU so it can be seen not to be the limit.
Figures are reported as ratios to the peers measured in the same run; nothing here is
asserted: the machine is shared and noisy. With ``--rounds N`` (default 5 with
``--baseline``, else 1) every scenario runs every target N times, interleaved (the order
reverses every other round, over the same pair of engines), and each ratio is computed
within a round, then reported as the median of the rounds with their spread (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import msgspec
import trio

from narwhal.core.faults import EngineFault, Phase
from narwhal.engines.transport import Pool, tcp_connect

URL = re.compile(r"(http://127\.0\.0\.1:\d+)")
TICK = os.sysconf("SC_CLK_TCK")
MODEL = "fake-model"
OPEN_MAX = 9000  # the most open streams this machine's descriptor limit lets us hold
BENCH_KV_LEASE_S = 480.0  # engines and router alike: see start_engines


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: int
    concurrency: int
    tokens: int
    itl_s: float = 0.0
    prompt_words: int = 8


@dataclass
class Streaming:
    """How many streams are between their first token and their end, now and at most."""

    now: int = 0
    peak: int = 0


@dataclass
class Result:
    target: str
    scenario: str
    round: int = 0
    ok: int = 0
    failed: int = 0
    wall_s: float = 0.0
    router_cpu_s: float | None = None
    loadgen_cpu_s: float = 0.0
    rss_mib: float | None = None
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    note: str = ""
    streaming: Streaming = field(default_factory=Streaming)
    errors: dict[str, int] = field(default_factory=dict)  # failed requests, by why

    def cpu_ms_per_request(self) -> float | None:
        if self.router_cpu_s is None or not self.ok:
            return None
        return self.router_cpu_s / (self.ok + self.failed) * 1000


# ---- processes -------------------------------------------------------------------------


KEEP_LOGS = False  # --logs: also keep our router's request journal


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tree_cpu(pid: int) -> float:
    """User+system CPU seconds of a process and its children (threads included)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def tree_rss_mib(pid: int) -> float:
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for kid in map(int, kids):
        out += [kid, *children(kid)]
    return out


class Proc:
    """A started process; stderr drained to a file so a full pipe never blocks it."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = log
        self.handle = log.open("w")
        self.proc = subprocess.Popen(
            argv, stdout=self.handle, stderr=subprocess.STDOUT, cwd=cwd, env=env
        )

    def wait_for_url(self, pattern: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # bounded: the process is starting
            text = self.log.read_text(errors="replace")
            for line in text.splitlines():
                if pattern in line and (match := URL.search(line)):
                    return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.proc.args[0]} did not start: {self.log.read_text()[-800:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.handle.close()


def wait_http(url: str, proc: Proc, timeout_s: float = 60.0) -> None:
    async def probe() -> bool:
        host, port = url.removeprefix("http://").split(":")
        try:
            stream = await tcp_connect(host, int(port))
        except OSError:
            return False
        await stream.aclose()
        return True

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.proc.poll() is None:  # bounded
        if trio.run(probe):
            return
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"{url} did not come up: {proc.log.read_text(errors='replace')[-300:]}")


# ---- load ------------------------------------------------------------------------------


def prompt(words: int, salt: int) -> str:
    base = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    return " ".join(base[(i + salt) % len(base)] for i in range(words))


async def one_request(
    pool: Pool, body: bytes, streaming: Streaming | None = None
) -> tuple[str | None, float | None, float]:
    """POST a streamed completion; (why it failed or None, first data event, end to end)."""
    start = time.perf_counter()
    first: float | None = None
    tail = b""
    async with await pool.request(
        b"POST",
        b"/v1/completions",
        [(b"content-type", b"application/json")],
        body,
        phase=Phase.DECODE,
    ) as resp:
        try:
            while (batch := await resp.next_batch()) is not None:
                if first is None and b"data: {" in batch:
                    first = time.perf_counter() - start
                    if streaming is not None:
                        streaming.now += 1
                        streaming.peak = max(streaming.peak, streaming.now)
                tail = (tail + batch)[-64:]
        finally:
            if streaming is not None and first is not None:
                streaming.now -= 1
        failure = _failure(resp.status, tail)
    return failure, first, time.perf_counter() - start


def _failure(status: int, tail: bytes) -> str | None:
    if status != 200:
        return f"HTTP {status}"
    if not tail.endswith(b"data: [DONE]\n\n"):
        # a stream cut short: ours then ends with an error event, and never with [DONE]
        return "stream ended without [DONE]"
    return None


async def prefill_leg(pool: Pool, body: dict) -> bytes:  # type: ignore[type-arg]
    """A prefill leg as a router sends it (``max_tokens`` 1, ``do_remote_decode``); the
    producer's answer."""
    pre = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    async with await pool.request(
        b"POST",
        b"/v1/completions",
        [(b"content-type", b"application/json")],
        msgspec.json.encode(pre),
        phase=Phase.PREFILL,
    ) as resp:
        return await resp.read_all(1 << 22)


async def lower_bound_request(
    p_pool: Pool,
    d_pool: Pool,
    body: dict,  # type: ignore[type-arg]
    streaming: Streaming,
) -> tuple[str | None, float | None, float]:
    """What a router must do at minimum: prefill, then decode with the descriptor."""
    start = time.perf_counter()
    kv = msgspec.json.decode(await prefill_leg(p_pool, body))["kv_transfer_params"]
    decode_start = time.perf_counter()
    failure, first, _ = await one_request(
        d_pool, msgspec.json.encode({**body, "kv_transfer_params": kv}), streaming
    )
    ttft = None if first is None else decode_start - start + first
    return failure, ttft, time.perf_counter() - start


async def drive(scenario: Scenario, send: Callable[[int], object], result: Result) -> None:
    remaining = iter(range(scenario.requests))

    async def worker() -> None:
        for i in remaining:
            try:
                failure, first, e2e = await send(i)  # type: ignore[misc]
            except (EngineFault, KeyError, msgspec.DecodeError) as exc:
                # a request the target (or the machine) could not serve is a failure to
                # report, not the end of the run; why, with the numbers taken out (ports)
                why = re.sub(r"\d+", "N", str(exc))[:100]
                failure, first, e2e = f"{type(exc).__name__}: {why}", None, 0.0
            if failure is None:
                result.ok += 1
                result.e2e.append(e2e)
                if first is not None:
                    result.ttft.append(first)
            else:
                result.failed += 1
                result.errors[failure] = result.errors.get(failure, 0) + 1

    with trio.fail_after(900):
        async with trio.open_nursery() as nursery:
            for _ in range(scenario.concurrency):
                nursery.start_soon(worker)


def run_load(
    scenario: Scenario, result: Result, url: str | None, engines: tuple[str, str] | None = None
) -> None:
    """Drive one target (``url``) or the lower bound (``engines``) through a scenario."""

    async def main() -> None:
        width = scenario.concurrency + 8

        def pool_for(u: str) -> Pool:
            # thousands of connects at once overflow the SYN queue (tcp_max_syn_backlog);
            # the kernel's retries (1 s, 3 s, 7 s...) then exceed a short timeout
            return Pool(u, tcp_connect, 60.0, width)

        def body(i: int) -> dict:  # type: ignore[type-arg]
            return {
                "model": MODEL,
                "prompt": prompt(scenario.prompt_words, i),
                "max_tokens": scenario.tokens,
                "stream": True,
                "temperature": 0,
            }

        if engines is not None:
            p_pool, d_pool = pool_for(engines[0]), pool_for(engines[1])

            async def send(i: int) -> tuple[str | None, float | None, float]:
                return await lower_bound_request(p_pool, d_pool, body(i), result.streaming)
        else:
            assert url is not None
            pool = pool_for(url)

            async def send(i: int) -> tuple[str | None, float | None, float]:
                return await one_request(pool, msgspec.json.encode(body(i)), result.streaming)

        await drive(scenario, send, result)

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    trio.run(main)
    result.wall_s = time.perf_counter() - t0
    result.loadgen_cpu_s = time.process_time() - cpu0


# ---- targets ---------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    start: Callable[[str, str, Path], tuple[Proc, str]] | None  # None: the lower bound


def engines_toml(prefills: list[str], decodes: list[str]) -> str:
    """The ``[[engines]]`` blocks of a fleet file: producers p0.., consumers d0.."""
    return "".join(
        f'[[engines]]\nid = "{role[0]}{i}"\nurl = "{url}"\nrole = "{role}"\n'
        for role, urls in (("prefill", prefills), ("decode", decodes))
        for i, url in enumerate(urls)
    )


SETTINGS: list[str] = []  # --set: SECTION.KEY=VALUE lines for our targets' fleet files


def sections_toml(settings: list[str]) -> str:
    """``--set admission.queue=false`` as fleet-file sections: ``[admission]\nqueue = false``
    (the same for this tree and the baseline)."""
    sections: dict[str, list[str]] = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        section, _, key = name.partition(".")
        if not key or not value:
            raise SystemExit(f"--set {setting!r}: SECTION.KEY=VALUE, e.g. admission.queue=false")
        sections.setdefault(section, []).append(f"{key} = {value}")
    return "".join(f"[{name}]\n" + "\n".join(lines) + "\n" for name, lines in sections.items())


def start_narwhal(
    p_url: str,
    d_url: str,
    tmp: Path,
    *,
    name: str = "narwhal",
    root: str | None = None,
    pure: bool = False,
    launcher: tuple[str, ...] = ("-m", "narwhal"),
    extra: tuple[str, ...] = (),
    python: str | None = None,
) -> tuple[Proc, str]:
    """This tree's narwhal, or with ``root`` the narwhal of that checkout (``--baseline``);
    ``pure``: its pure-Python build (NARWHAL_PURE=1, docs/build.md); ``launcher``: what
    the interpreter runs, the command line's arguments after it; ``extra``: fleet-file
    lines beyond ``--set``'s (``--variant``); ``python``: what runs ``launcher`` (default
    this interpreter; ``bench/router_instructions.py`` puts callgrind first)."""
    return serve_narwhal(
        f'model = "{MODEL}"\n'
        + engines_toml([p_url], [d_url])
        + "[serving]\nmax_inflight = 20000\n"
        # the peers have no first-token timeout: measure routing, not our 2.5 s default;
        # the engines' 480 s KV lease (start_engines), stated on this side too
        "[engine]\nmax_connections = 20000\nfirst_token_timeout_s = 120.0\n"
        f"kv_lease_s = {BENCH_KV_LEASE_S}\n" + sections_toml([*SETTINGS, *extra]),
        tmp,
        name=name,
        root=root,
        pure=pure,
        launcher=launcher,
        python=python,
    )


def serve_narwhal(
    fleet_text: str,
    tmp: Path,
    *,
    name: str = "narwhal",
    root: str | None = None,
    pure: bool = False,
    launcher: tuple[str, ...] = ("-m", "narwhal"),
    python: str | None = None,
) -> tuple[Proc, str]:
    """``narwhal serve`` on a fleet file of this text; (process, URL). With ``root``, the
    narwhal of that checkout runs (``--baseline``); ``python``: the interpreter (default
    this one), e.g. that checkout's own venv."""
    fleet = tmp / f"{name}-fleet.toml"
    fleet.write_text(fleet_text)
    proc = Proc(
        [
            python or sys.executable,
            *launcher,
            "serve",
            "--config",
            str(fleet),
            "--port",
            "0",
            "--log-level",
            "warning",
            # with --logs: one line per request, which says why each failed one failed
            *(["--journal", str(tmp / f"{name}-journal.jsonl")] if KEEP_LOGS else []),
        ],
        tmp / f"{name}.log",
        # python -m puts its working directory first on the import path, before PYTHONPATH:
        # the baseline runs in its own checkout, or this tree's narwhal would be imported
        cwd=None if root is None else Path(root).absolute(),
        env={
            **os.environ,
            **({} if root is None else {"PYTHONPATH": str(Path(root).absolute())}),
            "NARWHAL_PURE": "1" if pure else "",
        },
    )
    return proc, proc.wait_for_url("narwhal: serving")


def peers_bin(name: str) -> Path:
    # absolute: narwhal-inference 0.7.0 runs with its config folder as working directory
    return (Path(os.environ.get("PEERS_VENV", ".bench-venv")) / "bin" / name).absolute()


def start_vllm_router(p_url: str, d_url: str, tmp: Path) -> tuple[Proc, str]:
    return launch_vllm_router([p_url], [d_url], tmp)


def launch_vllm_router(
    prefills: list[str], decodes: list[str], tmp: Path, extra: tuple[str, ...] = ()
) -> tuple[Proc, str]:
    """vllm-router in PD mode over these engines (``extra``: e.g. its ``--policy``)."""
    port = free_port()
    proc = Proc(
        [
            str(peers_bin("vllm-router")),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            *(arg for url in prefills for arg in ("--prefill", url)),
            *(arg for url in decodes for arg in ("--decode", url)),
            # its default metrics port (29000) may be taken, and then it panics at start
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
            *extra,
        ],
        tmp / "vllm-router.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc)
    return proc, url


def start_narwhal07(p_url: str, d_url: str, tmp: Path) -> tuple[Proc, str]:
    return launch_narwhal07([p_url], [d_url], tmp)


def launch_narwhal07(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
    """narwhal-inference 0.7.0: a fleet file and synthetic profiles bound to the live
    engines' identity, written by its own digest code (bench/narwhal07_config.py)."""
    config_dir = tmp / "narwhal07"
    subprocess.run(
        [
            str(peers_bin("python")),
            str(Path(__file__).with_name("narwhal07_config.py")),
            str(config_dir),
            MODEL,
            ",".join(prefills),
            ",".join(decodes),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    port = free_port()
    proc = Proc(
        [
            str(peers_bin("narwhal-serve")),
            "--fleet",
            str(config_dir / "fleet.json"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--max-concurrent",
            "20000",
        ],
        tmp / "narwhal07.log",
        cwd=config_dir,  # it writes runs/state.json beside itself
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc)
    return proc, url


TARGETS = [
    Target("lower-bound", None),
    Target("narwhal", start_narwhal),
    Target("narwhal-pure", partial(start_narwhal, name="narwhal-pure", pure=True)),
    Target("vllm-router", start_vllm_router),
    Target("narwhal-0.7", start_narwhal07),
]


FAST_ENGINES = False  # --engines fast: bench/fast_engine.py (aiohttp on uvloop), not ours


def start_engines(scenario: Scenario, tmp: Path) -> tuple[list[Proc], str, str]:
    procs, urls = [], []
    for role in ("prefill", "decode"):
        # a long KV lease on both sides (the router's fleet file says the same, start_narwhal),
        # not vLLM 0.32's 30 s default: at 9,000 streams on a slow machine a handoff waits
        # longer than 30 s for its decode, and the bench measures routing, not lease expiry
        args = [
            "--itl-s",
            str(scenario.itl_s),
            "--max-model-len",
            "65536",
            "--kv-lease-s",
            str(BENCH_KV_LEASE_S),
        ]
        start = start_fast_engine if FAST_ENGINES else start_fake_engine
        proc, url = start(role, args, tmp / f"engine-{role}.log")
        procs.append(proc)
        urls.append(url)
    return procs, urls[0], urls[1]


def start_fast_engine(role: str, args: list[str], log: Path) -> tuple[Proc, str]:
    """``bench/fast_engine.py`` (about 0.1 ms a request: the router, not the engine, shows
    in added TTFT) on a free port of 127.0.0.1 in ``role``, from the peers' venv."""
    script = Path(__file__).with_name("fast_engine.py")
    proc = Proc([str(peers_bin("python")), str(script), "--port", "0", "--role", role, *args], log)
    return proc, proc.wait_for_url("fake-engine")


def start_fake_engine(role: str, args: list[str], log: Path) -> tuple[Proc, str]:
    """``narwhal fake-engine`` on a free port of 127.0.0.1 in ``role``; (process, URL)."""
    proc = Proc(
        [sys.executable, "-m", "narwhal", "fake-engine", "--port", "0", "--role", role, *args],
        log,
    )
    return proc, proc.wait_for_url("fake-engine")


def start_fake_fleet(
    engines: list[tuple[str, str, list[str]]], tmp: Path
) -> tuple[list[Proc], dict[str, str]]:
    """``narwhal fake-engine`` for each (name, role, arguments); (processes, URL by name).
    Every one started is stopped again if a later one fails to start."""
    procs, urls = [], {}
    try:
        for name, role, args in engines:
            argv = [*args, "--max-model-len", "65536", "--engine-id", name]
            proc, url = start_fake_engine(role, argv, tmp / f"engine-{name}.log")
            procs.append(proc)
            urls[name] = url
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs, urls


def measure(scenario: Scenario, target: Target, engines: tuple[str, str], tmp: Path) -> Result:
    result = Result(target.name, scenario.name)
    if target.start is None:
        run_load(scenario, result, None, engines)
        return result
    try:
        proc, url = target.start(engines[0], engines[1], tmp)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        result.note = f"not measured: {exc}"[:200]
        return result
    try:
        warm = Scenario(
            "warm-up",
            20,
            min(8, scenario.concurrency),
            scenario.tokens,
            scenario.itl_s,
            scenario.prompt_words,
        )
        run_load(warm, Result(target.name, "warm-up"), url)
        cpu0 = tree_cpu(proc.proc.pid)
        run_load(scenario, result, url)
        result.router_cpu_s = tree_cpu(proc.proc.pid) - cpu0
        result.rss_mib = tree_rss_mib(proc.proc.pid)
    finally:
        proc.stop()
    return result


# ---- report ----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def fmt(value: float | None, scale: float = 1000.0, digits: int = 2) -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}"


def ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "—"
    return f"{value / base:.2f}x"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: list[float], scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """``median (min-max, n rounds)``."""
    if not values:
        return "—"
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid * scale:.{digits}f}{unit}"
    low, high = min(values) * scale, max(values) * scale
    rounds = f"{low:.{digits}f}-{high:.{digits}f}, {len(values)} rounds"
    return f"{mid * scale:.{digits}f}{unit} ({rounds})"


def _ratio(values: list[float]) -> str:
    return "—" if not values else spread(values, unit="x")


def added_ttft(r: Result, base: Result | None) -> float | None:
    p50, lower = pct(r.ttft, 0.5), None if base is None else pct(base.ttft, 0.5)
    return None if p50 is None or lower is None else p50 - lower


class Rounds:
    """One scenario's results by (target, round): every figure is taken within a round."""

    def __init__(self, rows: list[Result]) -> None:
        self.by = {(r.target, r.round): r for r in rows}
        self.rounds = sorted({r.round for r in rows})

    def of(self, target: str) -> list[Result]:
        return [r for n in self.rounds if (r := self.by.get((target, n))) is not None]

    def each(self, target: str, value: Callable[[Result], float | None]) -> list[float]:
        return [v for r in self.of(target) if (v := value(r)) is not None]

    def cpu_ratio(self, target: str, peer: str) -> list[float]:
        out = []
        for r in self.of(target):
            other = self.by.get((peer, r.round))
            cpu, base = r.cpu_ms_per_request(), other.cpu_ms_per_request() if other else None
            if cpu is not None and base:
                out.append(cpu / base)
        return out

    def added(self, target: str) -> list[float]:
        return self.each(target, lambda r: added_ttft(r, self.by.get(("lower-bound", r.round))))

    def ok_failed(self, target: str) -> str:
        rs = self.of(target)
        return f"{sum(r.ok for r in rs)}/{sum(r.failed for r in rs)}" if rs else "—"


def table(results: list[Result]) -> str:
    """Per scenario, each target's figures: medians over the rounds (ok/failed: summed)."""
    lines = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        rows = [r for r in results if r.scenario == scenario]
        rs = Rounds(rows)
        lines += [
            f"\n### {scenario}\n",
            "| target | router CPU ms/req | vs vllm-router | vs Narwhal 0.7 | req/s | TTFT p50 ms "
            "| TTFT p99 ms | added TTFT p50 ms | e2e p50 ms | e2e p99 ms | peak RSS MiB "
            "| streams open at once | loadgen CPU s | ok/failed | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for target in dict.fromkeys(r.target for r in rows):
            mine = rs.of(target)
            errors: dict[str, int] = {}
            for r in mine:
                for kind, count in r.errors.items():
                    errors[kind] = errors.get(kind, 0) + count
            notes = "; ".join(dict.fromkeys(r.note for r in mine if r.note))
            rps = rs.each(target, lambda r: (r.ok + r.failed) / r.wall_s if r.wall_s else None)
            lines.append(
                f"| {target} | {spread(rs.each(target, Result.cpu_ms_per_request))} | "
                f"{_ratio(rs.cpu_ratio(target, 'vllm-router'))} | "
                f"{_ratio(rs.cpu_ratio(target, 'narwhal-0.7'))} | {fmt(median(rps), 1, 0)} | "
                f"{fmt(median(rs.each(target, lambda r: pct(r.ttft, 0.5))))} | "
                f"{fmt(median(rs.each(target, lambda r: pct(r.ttft, 0.99))))} | "
                f"{fmt(median(rs.added(target)))} | "
                f"{fmt(median(rs.each(target, lambda r: pct(r.e2e, 0.5))))} | "
                f"{fmt(median(rs.each(target, lambda r: pct(r.e2e, 0.99))))} | "
                f"{fmt(median(rs.each(target, lambda r: r.rss_mib)), 1, 0)} | "
                f"{max(r.streaming.peak for r in mine)} | "
                f"{sum(r.loadgen_cpu_s for r in mine) / len(mine):.2f} | "
                f"{rs.ok_failed(target)} | {notes}{_errors(errors)} |"
            )
    return "\n".join(lines)


def ab_table(results: list[Result], new: str = "narwhal", old: str = "narwhal-main") -> str:
    """This tree against today's main, ratio by ratio within each round: medians, spread."""
    lines = [
        f"\n## A/B: this tree ({new}) against the baseline ({old})\n",
        "Each ratio is taken within one round (same engines, targets interleaved), then the "
        "median over the rounds, with (min-max, rounds).\n",
        "| scenario | CPU/req new vs main | new vs vllm-router | main vs vllm-router "
        "| added TTFT p50 ms new | main | vllm-router | peak RSS MiB new | main "
        "| ok/failed new | main |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in dict.fromkeys(r.scenario for r in results):
        rs = Rounds([r for r in results if r.scenario == scenario])
        rss = {t: rs.each(t, lambda r: r.rss_mib) for t in (new, old)}
        lines.append(
            f"| {scenario} | {_ratio(rs.cpu_ratio(new, old))} "
            f"| {_ratio(rs.cpu_ratio(new, 'vllm-router'))} "
            f"| {_ratio(rs.cpu_ratio(old, 'vllm-router'))} | {spread(rs.added(new), 1000)} "
            f"| {spread(rs.added(old), 1000)} | {spread(rs.added('vllm-router'), 1000)} "
            f"| {spread(rss[new], digits=0)} | {spread(rss[old], digits=0)} "
            f"| {rs.ok_failed(new)} | {rs.ok_failed(old)} |"
        )
    return "\n".join(lines)


def _errors(errors: dict[str, int]) -> str:
    kinds = ", ".join(f"{kind} x{count}" for kind, count in sorted(errors.items()))
    return f" failures: {kinds}" if kinds else ""


def plot(results_json: Path, path: Path, script: str = "plot.py") -> bool:
    """Draw the plot with the peers venv's matplotlib (bench/plot.py, or another script
    of bench/ that takes the results JSON and the PNG's path); False if it fails."""
    proc = subprocess.run(
        [
            str(peers_bin("python")),
            str(Path(__file__).with_name(script)),
            str(results_json),
            str(path),
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    parser.add_argument(
        "--engines",
        choices=("fake", "fast"),
        default="fake",
        help="fake: narwhal fake-engine (trio); fast: bench/fast_engine.py (aiohttp on uvloop, "
        "about 0.1 ms a request), from the peers' venv",
    )
    parser.add_argument(
        "--only", help="run only the scenarios whose name starts with this (comma-separated)"
    )
    parser.add_argument("--targets", help="comma-separated target names (default: all)")
    parser.add_argument(
        "--baseline",
        help="a checkout of narwhal (today's main) measured as narwhal-main, interleaved",
    )
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds per scenario (default 5 with --baseline)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a fleet-file line for our targets, e.g. admission.queue=false",
    )
    parser.add_argument(
        "--logs",
        help="keep the logs in this folder (the last scenario's; our journal has every one)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:SECTION.KEY=VALUE[;...]: one more target of ours, this tree with these "
        'fleet-file lines, interleaved (e.g. "queue_off:admission.queue=false"); an A/B '
        "table puts narwhal against it",
    )
    args = parser.parse_args()
    os.environ["PEERS_VENV"] = args.peers_venv
    SETTINGS.extend(args.set)
    global FAST_ENGINES
    FAST_ENGINES = args.engines == "fast"
    global KEEP_LOGS
    KEEP_LOGS = bool(args.logs)
    if args.quick:
        scenarios = [
            Scenario("a: c=32, 64 tokens, ITL 0", 300, 32, 64),
            Scenario("b: c=1, 64 tokens, ITL 0", 60, 1, 64),
        ]
    else:
        scenarios = [
            Scenario("a: c=32, 64 tokens, ITL 0", 1000, 32, 64),
            Scenario("b: c=1, 64 tokens, ITL 0", 200, 1, 64),
            # the goal column: 256 open streams
            Scenario("c: 256 open streams, ITL 50 ms", 768, 256, 64, itl_s=0.05),
            Scenario("c: 1,000 open streams, ITL 50 ms", 1000, 1000, 64, itl_s=0.05),
            Scenario("d: 8k-token prompts, 16 tokens", 200, 8, 16, prompt_words=8000),
            # the issue asks for 10,000; a process here may hold 20,000 descriptors
            # (ulimit -n) and the router needs two per stream (client and engine)
            Scenario(f"e: {OPEN_MAX:,} open streams, ITL 50 ms", OPEN_MAX, OPEN_MAX, 16, 0.05),
        ]
    if args.only:
        scenarios = [s for s in scenarios if s.name.startswith(tuple(args.only.split(",")))]
    targets = list(TARGETS)
    if args.baseline:
        start = partial(start_narwhal, name="narwhal-main", root=args.baseline)
        targets.insert(2, Target("narwhal-main", start))
    variants = [v.split(":", 1) for v in args.variant]
    for name, lines in variants:
        start = partial(start_narwhal, name=name, extra=tuple(lines.split(";")))
        targets.append(Target(name, start))
    if args.targets:
        targets = [t for t in targets if t.name in args.targets.split(",")]
    rounds = args.rounds or (5 if args.baseline or variants else 1)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="narwhal-bench-") as tmpdir:
        tmp = Path(args.logs or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        for scenario in scenarios:
            engines, p_url, d_url = start_engines(scenario, tmp)
            try:
                for n in range(rounds):
                    # interleaved: the order reverses every other round, so neither side
                    # always runs first (warmer caches, or a busier machine)
                    for target in targets if n % 2 == 0 else targets[::-1]:
                        result = measure(scenario, target, (p_url, d_url), tmp)
                        result.round = n
                        results.append(result)
                        print(
                            f"{scenario.name:40} round {n + 1}/{rounds} {target.name:12} "
                            f"ok={result.ok} failed={result.failed} "
                            f"cpu/req={fmt(result.cpu_ms_per_request(), 1)} {result.note}",
                            file=sys.stderr,
                            flush=True,
                        )
            finally:
                for proc in engines:
                    proc.stop()
    stamp = time.strftime("%Y-%m-%d")
    host = (
        f"{platform.node()}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    )
    report = (
        f"# Router benchmark, {stamp}\n\nMachine: {host}. Mode: "
        f"{'quick' if args.quick else 'full'}, {rounds} round(s). Engines: {args.engines} "
        f"({'bench/fast_engine.py' if FAST_ENGINES else 'narwhal fake-engine'}) on 127.0.0.1."
        f"\n"
        + table(results)
        + (ab_table(results) if args.baseline else "")
        + (
            ab_table(results, new="narwhal-pure")
            if args.baseline and any(r.target == "narwhal-pure" for r in results)
            else ""
        )
        + "".join(ab_table(results, old=name) for name, _ in variants)
    )
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ab = "-ab" if args.baseline else "".join(f"-{name}" for name, _ in variants)
    name = f"{stamp}-{'quick' if args.quick else 'full'}{ab}"
    (out / f"{name}.md").write_text(report + "\n")
    rows = [{**r.__dict__, "streaming": r.streaming.peak} for r in results]
    (out / f"{name}.json").write_text(json.dumps(rows))
    if not args.quick and plot(out / f"{name}.json", out / f"{name}.png"):
        print(f"plot: {out / name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
