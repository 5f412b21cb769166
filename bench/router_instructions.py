"""Router CPU per request as instructions, counted by callgrind: this tree against another
checkout, over the same fast engines, without the noise of a shared machine's clock.

    python bench/router_instructions.py --baseline PATH [--requests N] [--rounds K]
                                        [--concurrency C] [--tokens T] [--itl-s S]
                                        [--set SECTION.KEY=VALUE] [--top N] [--keep DIR]

``bench/peers.py`` times the router's process (user+system seconds from /proc); on a
shared VM the same tree varies by a third from one run to the next, more than the
differences an A/B looks for. Here each router runs under ``valgrind --tool=callgrind``
with instrumentation off while it starts and warms up; it is switched on
(``callgrind_control -i on``) for the load phase only, and the dump's total of
instructions executed (``Ir``) is divided by the requests served. The count depends on
the code, not on the machine's load (the batching of reads may change a little with
timing, the same for both trees). Rounds interleave the two trees.

With ``--top N`` the N functions whose own count per request differs most between the
trees are listed (``callgrind_annotate``; Python code shows as the interpreter's loop): the
profile of the change. ``--keep DIR`` keeps the last round's dumps.
Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import peers

TOTALS = re.compile(r"^totals:\s+(\d+)", re.M)
ANNOTATED = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+(?:\*\s+)?(\S.*)$")


def callgrind_prefix(out: Path) -> tuple[str, ...]:
    """The launcher: callgrind, off until the load, then this Python running narwhal."""
    return (
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "narwhal",
    )


def control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], capture_output=True, timeout=300, check=True)


def one_run(
    name: str, root: str | None, scenario: peers.Scenario, engines: tuple[str, str], tmp: Path
) -> tuple[float, Path]:
    """Instructions per request of one router (this tree, or ``root``'s), and its dump;
    ``name`` is unique to the run."""
    out = tmp / f"callgrind.{name}.out"
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    proc, url = peers.start_narwhal(
        *engines, tmp, name=name, root=root, python=valgrind, launcher=callgrind_prefix(out)
    )
    try:
        warm = peers.Scenario("warm-up", 40, 40, scenario.tokens, scenario.itl_s)
        peers.run_load(warm, peers.Result(name, "warm-up"), url)
        pid = str(proc.proc.pid)
        control("-z", pid)
        control("-i", "on", pid)
        result = peers.Result(name, scenario.name)
        peers.run_load(scenario, result, url)
        control("-i", "off", pid)
        control("-d", pid)
    finally:
        proc.stop()
    if result.failed:
        raise RuntimeError(f"{name}: {result.failed} requests failed: {result.errors}")
    # the dump asked for after the load (out.1); the one at exit (out) holds next to nothing
    dump = max(tmp.glob(f"callgrind.{name}.out*"), key=total_ir)
    return total_ir(dump) / result.ok, dump


def total_ir(dump: Path) -> int:
    match = TOTALS.search(dump.read_text(errors="replace"))
    return int(match.group(1)) if match else 0


def self_costs(dump: Path) -> dict[str, int]:
    """Instructions spent in each function itself, by file name and function (the
    checkout's folder left out, so the two trees' functions meet)."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dump)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    # the function table: after its header, up to the annotated sources' first rule
    table = text.split("file:function", 1)[-1].split("\n", 2)[-1].split("\n--", 1)[0]
    costs: dict[str, int] = {}
    for line in table.splitlines():
        if match := ANNOTATED.match(line):
            where = match.group(2).split(" [", 1)[0]
            file, _, func = where.rpartition(":")
            key = f"{file.rsplit('/', 1)[-1]}:{func}"
            costs[key] = costs.get(key, 0) + int(match.group(1).replace(",", ""))
    return costs


def differences(new: Path, old: Path, requests: int, top: int) -> str:
    a, b = self_costs(new), self_costs(old)
    rows = sorted(set(a) | set(b), key=lambda f: abs(a.get(f, 0) - b.get(f, 0)), reverse=True)[:top]
    lines = ["| function (self) | this tree | baseline | difference |", "|---|---|---|---|"]
    for f in rows:
        x, y = a.get(f, 0) / requests, b.get(f, 0) / requests
        lines.append(f"| `{f[:100]}` | {x:,.0f} | {y:,.0f} | {x - y:+,.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="a checkout of narwhal, built")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--itl-s", type=float, default=0.0, help="the engines' inter-token delay")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a fleet-file line for both routers, e.g. admission.queue=false",
    )
    parser.add_argument("--top", type=int, default=0)
    parser.add_argument("--keep", help="copy the last round's dumps into this folder")
    args = parser.parse_args()
    peers.FAST_ENGINES = True
    peers.SETTINGS.extend(args.set)
    settings = "".join(f", {line}" for line in args.set)
    scenario = peers.Scenario(
        f"c={args.concurrency}, {args.tokens} tokens, ITL {args.itl_s:g} s{settings}",
        args.requests,
        args.concurrency,
        args.tokens,
        args.itl_s,
    )
    counts: dict[str, list[float]] = {"this": [], "baseline": []}
    dumps: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        procs, p_url, d_url = peers.start_engines(scenario, tmp)
        try:
            for n in range(args.rounds):
                order = [("this", None), ("baseline", args.baseline)]
                for name, root in order if n % 2 == 0 else order[::-1]:
                    t0 = time.monotonic()
                    run = f"{name}-{n + 1}"
                    per_request, dumps[name] = one_run(run, root, scenario, (p_url, d_url), tmp)
                    counts[name].append(per_request)
                    took = time.monotonic() - t0
                    print(f"round {n + 1} {name}: {per_request:,.0f} Ir/request ({took:.0f} s)")
            ratios = [a / b for a, b in zip(counts["this"], counts["baseline"], strict=True)]
            print(f"\nscenario: {scenario.name}, {args.requests} requests a round")
            for name, values in counts.items():
                print(f"{name}: {statistics.median(values):,.0f} Ir/request {values}")
            print(
                f"this/baseline: {statistics.median(ratios):.3f}x {[round(r, 3) for r in ratios]}"
            )
            if args.top:
                print()
                print(differences(dumps["this"], dumps["baseline"], args.requests, args.top))
            if args.keep:
                for name, dump in dumps.items():
                    shutil.copy(dump, Path(args.keep) / f"callgrind.{name}.out")
        finally:
            for proc in procs:
                proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
