"""A bounded outside reproduction of the front door's descriptor-reuse race.

    python bench/fd_race.py [--rounds 20] [--clients 16] [--pollers 3] [--queue on|off]
                            [--tree PATH] [--pure] [--timeout-s 10] [--logs DIR]

The defect: a client connection's read loop (``narwhal/frontdoor/connection.py``
``_read_socket`` -> ``narwhal/lowlevel/fast_io.py`` ``read_when_ready(fd, ...)``) holds the socket's
descriptor NUMBER across its wait. When the client's FIN wakes the loop and, in the same
scheduler batch, the app closes the socket (after a ``Connection: close`` answer: every
urllib client), the kernel hands the freed number to the next socket the process opens (an
engine connection, a newly accepted client), and the stale loop waits on or reads that
socket: an engine leg fails with 500 ``router error: BusyResourceError``, or a new client's
request is swallowed and never answered.

What it does, every loop and wait bounded in count and time, on 127.0.0.1 only: one prefill
and one decode ``narwhal fake-engine`` (no delay between tokens) for the whole run, then per
round a fresh ``narwhal serve`` process of ``--tree`` (its own ``.venv/bin/python`` when it
has one, its checkout as working directory and first on ``PYTHONPATH``; checked before the
first round and, for the compiled build, in each router's memory map), waited for until
``GET /ready`` answers 200. Then, at once, ``--clients`` threads each POST one
``/v1/completions`` with urllib (``Connection: close``; every fourth streamed) while
``--pollers`` threads GET ``/metrics`` and ``/ready`` in turn until the completions are
done. A fresh router per round: its engine connections are all new, so the freed numbers
are taken again at once. The router is then stopped (SIGTERM to its pid, SIGKILL after
10 s) and the next round starts.

Counted per round and in total: completions answered 200, answered 500 (the body's
message, e.g. ``router error: BusyResourceError``), answered otherwise (another status, a
200 stream without ``[DONE]``, a body cut short), never answered (no status line before
``--timeout-s``, or the connection reset or closed with no answer; "before the request was
sent" marks a failed connect or send); polls answered 200 and poll errors (any other
answer, or none); the ``BusyResourceError`` tracebacks in the router's log (``--logs DIR``
keeps the logs) and the router's exit status. Prints a markdown table and a final line.
Exit status 1 when any request, completion or poll, was answered 500 or never answered: a
test or CI job can run it as is. A run is about 1 to 2.5 minutes on 2 busy cores (a round
with an unanswered request waits out its ``--timeout-s``).

Measured at 352eac4 (2 shared cores, defaults: 20 rounds, 16 clients, 3 pollers), two runs
each, completions answered 500 / never answered / polls never answered: compiled, queue
off 6/2/8 and 4/1/6; compiled, queue on 1/1/10 and 0/0/15; pure, queue off 5/0/4 and
7/0/7; pure, queue on 1/2/14 and 0/0/8: every run exits 1. With the queue on the
completions meet it less often (fewer engine connections opened at once) and the swallowed
polls carry the reproduction. The same tree with ``_read_socket`` checking
``socket.fileno()`` again after the wake, before the read (pure build): 0 in 2 x 20 rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers  # bench/ is not a package: found through the path above

THIS_TREE = Path(__file__).resolve().parent.parent
STREAM_EVERY = 4  # every fourth completion is streamed
MAX_TOKENS = 8
READY_BOUND_S = 30.0
POLLS_MAX = 2000  # per poller and round
STOP_BOUND_S = 10.0  # the router's SIGTERM, then SIGKILL (peers.Proc.stop)


@dataclass
class Tally:
    """What one round (or the whole run) saw."""

    ok: int = 0
    s500: int = 0
    other: int = 0
    unanswered: int = 0
    polls_ok: int = 0
    poll_errors: int = 0
    poll_unanswered: int = 0  # of the poll errors: no answer at all
    wall_s: float = 0.0
    router_rc: int | None = None
    busy_logged: int = 0  # BusyResourceError tracebacks in the router's log
    why: Counter[str] = field(default_factory=Counter)  # every failed request, by why

    def add(self, other: Tally) -> None:
        for name in ("ok", "s500", "other", "unanswered", "polls_ok", "poll_errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.poll_unanswered += other.poll_unanswered
        self.busy_logged += other.busy_logged
        self.wall_s += other.wall_s
        self.why.update(other.why)

    def failed(self) -> bool:
        """Any request, completion or poll, answered 500 or never answered."""
        poll_500 = sum(n for why, n in self.why.items() if why.startswith("poll 500"))
        return bool(self.s500 or self.unanswered or self.poll_unanswered or poll_500)


# ---- one request -------------------------------------------------------------------------


def _why(exc: BaseException) -> str:
    """An exception's name; urllib wraps what failed before the request was sent (the
    connect, the send: ``URLError(TimeoutError)``), not what failed waiting for the answer."""
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        return f"{type(exc.reason).__name__} before the request was sent"
    return type(exc).__name__


def _message(body: bytes) -> str:
    """An error answer's message, the numbers taken out (ports, ids)."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body[:80].decode(errors="replace")
    return re.sub(r"\d+", "N", message)[:80]


def fetch(url: str, timeout_s: float, data: bytes | None = None) -> tuple[int | None, bytes, str]:
    """One urllib request (``Connection: close``, as urllib always sends): (status or None
    when never answered, body, why it failed after or without the status line, or "")."""
    headers = {"content-type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    status: int | None = None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            status = answer.status
            return status, answer.read(), ""
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read(), ""
        except (OSError, http.client.HTTPException) as cut:
            return exc.code, b"", _why(cut)
    except (OSError, http.client.HTTPException) as exc:
        return status, b"", _why(exc)


def completion(base: str, i: int, timeout_s: float, tally: Tally, lock: threading.Lock) -> None:
    stream = i % STREAM_EVERY == STREAM_EVERY - 1
    body = {
        "model": peers.MODEL,
        "prompt": f"race {i} the quick brown fox jumps over the lazy dog",
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }
    status, data, cut = fetch(base + "/v1/completions", timeout_s, json.dumps(body).encode())
    kind = "stream" if stream else "plain"
    if status is None:
        outcome, why = "unanswered", f"{kind}: no answer ({cut})"
    elif status == 500:
        outcome, why = "s500", f"{kind} 500: {_message(data)}"
    elif status != 200:
        outcome, why = "other", f"{kind} {status}: {_message(data)}"
    elif cut:
        outcome, why = "other", f"{kind} 200, body cut ({cut})"
    elif stream and not data.endswith(b"data: [DONE]\n\n"):
        last = data.rstrip().rsplit(b"data: ", 1)[-1]
        outcome, why = "other", f"stream 200 without [DONE]: {_message(last)}"
    elif not stream and b'"choices"' not in data:
        outcome, why = "other", f"plain 200 without choices: {_message(data)}"
    else:
        outcome, why = "ok", ""
    with lock:
        setattr(tally, outcome, getattr(tally, outcome) + 1)
        if why:
            tally.why[why] += 1


def poller(
    base: str, n: int, stop: threading.Event, timeout_s: float, tally: Tally, lock: threading.Lock
) -> None:
    """GET /metrics and /ready in turn until ``stop``, at most POLLS_MAX times."""
    for k in range(POLLS_MAX):
        if stop.is_set():
            return
        path = ("/metrics", "/ready")[(k + n) % 2]
        status, _, cut = fetch(base + path, timeout_s)
        with lock:
            if status == 200 and not cut:
                tally.polls_ok += 1
                continue
            tally.poll_errors += 1
            if status is None:
                tally.poll_unanswered += 1
                tally.why[f"poll {path}: no answer ({cut})"] += 1
            else:
                tally.why[f"poll {status} {path}" + (f" cut ({cut})" if cut else "")] += 1


# ---- one round ---------------------------------------------------------------------------


def wait_ready(base: str, router: peers.Proc) -> None:
    deadline = time.monotonic() + READY_BOUND_S
    while time.monotonic() < deadline and router.proc.poll() is None:  # bounded
        status, _, _ = fetch(base + "/ready", 2.0)
        if status == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{base}/ready not 200 after {READY_BOUND_S} s: {router.log}")


def load(base: str, args: argparse.Namespace, tally: Tally) -> None:
    """The completions, all released at once, and the pollers until they are done."""
    lock = threading.Lock()
    stop = threading.Event()
    go = threading.Barrier(args.clients + 1, timeout=30)

    def client(i: int) -> None:
        go.wait()
        completion(base, i, args.timeout_s, tally, lock)

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    pollers = [
        threading.Thread(
            target=poller, args=(base, n, stop, args.timeout_s, tally, lock), daemon=True
        )
        for n in range(args.pollers)
    ]
    for thread in [*pollers, *clients]:
        thread.start()
    go.wait()
    # bounded: a request's socket timeout is per operation; a streamed answer of
    # MAX_TOKENS tokens with no delay between them is a few operations
    deadline = time.monotonic() + 3 * args.timeout_s + 10
    for thread in clients:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    stop.set()
    for thread in pollers:
        thread.join(timeout=max(0.0, deadline + args.timeout_s - time.monotonic()))
    with lock:
        lost = sum(thread.is_alive() for thread in clients)
        if lost:  # past every bound: counted as never answered
            tally.unanswered += lost
            tally.why["no answer past the round's bound"] += lost


def check_tree(pid: int, tree: Path, compiled: bool) -> None:
    """The router runs the tree's code: its working directory (first on its import path)
    is the tree, and the compiled build maps the tree's extensions, the pure one none."""
    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
    maps = Path(f"/proc/{pid}/maps").read_text()
    ours = f"{tree}/narwhal/compiled__mypyc"
    if cwd != tree:
        raise RuntimeError(f"router {pid} runs in {cwd}, not {tree}")
    if compiled and ours not in maps:
        raise RuntimeError(f"router {pid} has not loaded {ours}*.so")
    if not compiled and "/narwhal/compiled__mypyc" in maps:
        raise RuntimeError(f"router {pid} loaded a compiled narwhal, not the pure build")


def one_round(
    n: int,
    args: argparse.Namespace,
    fleet: str,
    tmp: Path,
    python: str,
    compiled: bool,
) -> Tally:
    tally = Tally()
    t0 = time.monotonic()
    router, base = peers.serve_narwhal(
        fleet, tmp, name=f"router-{n}", root=str(args.tree), pure=args.pure, python=python
    )
    try:
        check_tree(router.proc.pid, args.tree, compiled)
        wait_ready(base, router)
        load(base, args, tally)
    finally:
        router.stop()  # SIGTERM its pid; SIGKILL after STOP_BOUND_S
        tally.router_rc = router.proc.returncode
        log = router.log.read_text(errors="replace")
        tally.busy_logged = log.count("trio.BusyResourceError:")
        tally.wall_s = time.monotonic() - t0
    return tally


# ---- the run -----------------------------------------------------------------------------


def tree_build(python: str, tree: Path, pure: bool) -> str:
    """Which narwhal the router will import, asked of the same interpreter, working
    directory and environment (peers.serve_narwhal's); it must be the tree's."""
    probe = (
        "import narwhal, narwhal.process.build as b; print(narwhal.__file__); print(b.describe())"
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "NARWHAL_PURE": "1" if pure else ""}
    out = subprocess.run(
        [python, "-c", probe], cwd=tree, env=env, capture_output=True, text=True, timeout=60
    )
    lines = out.stdout.splitlines()
    if out.returncode != 0 or len(lines) < 2:
        raise SystemExit(f"{python} cannot import narwhal in {tree}: {out.stderr[-500:]}")
    where = Path(lines[0]).resolve()
    if not where.is_relative_to(tree):
        raise SystemExit(f"{python} in {tree} imports narwhal from {where}, not the tree")
    return lines[1]


def fleet_text(p_url: str, d_url: str, queue: bool) -> str:
    return (
        f'model = "{peers.MODEL}"\n'
        + peers.engines_toml([p_url], [d_url])
        + "[serving]\ngraceful_timeout_s = 1.0\n"
        + f"[admission]\nqueue = {'true' if queue else 'false'}\n"
    )


def row(name: str, t: Tally) -> str:
    rc = "" if t.router_rc is None else str(t.router_rc)
    counts = (t.ok, t.s500, t.other, t.unanswered, t.polls_ok, t.poll_errors, t.busy_logged)
    cells = (name, *map(str, counts), rc)
    return "| " + " | ".join(cells) + f" | {t.wall_s:.1f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16, help="completions per round")
    parser.add_argument("--pollers", type=int, default=3, help="threads polling /metrics, /ready")
    parser.add_argument("--queue", choices=("on", "off"), default="off", help="[admission] queue")
    parser.add_argument("--tree", type=Path, default=THIS_TREE, help="the checkout that runs")
    parser.add_argument("--pure", action="store_true", help="NARWHAL_PURE=1 for the router")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per request")
    parser.add_argument("--logs", help="keep the routers' and engines' logs in this folder")
    args = parser.parse_args()
    args.tree = args.tree.resolve()
    venv_python = args.tree / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    build = tree_build(python, args.tree, args.pure)
    compiled = build.startswith("compiled")
    print(
        f"fd_race: {args.tree} ({build}) by {python}; queue {args.queue}; {args.rounds} rounds"
        f" of {args.clients} urllib completions and {args.pollers} pollers; "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    total = Tally()
    rows = []
    with tempfile.TemporaryDirectory(prefix="narwhal-fd-race-") as tmpdir:
        tmp = Path(args.logs or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        engines, urls = peers.start_fake_fleet([("p0", "prefill", []), ("d0", "decode", [])], tmp)
        try:
            fleet = fleet_text(urls["p0"], urls["d0"], args.queue == "on")
            for n in range(args.rounds):
                tally = one_round(n, args, fleet, tmp, python, compiled)
                total.add(tally)
                rows.append(row(str(n + 1), tally))
                print(
                    f"round {n + 1}/{args.rounds}: 200 {tally.ok}, 500 {tally.s500}, "
                    f"other {tally.other}, unanswered {tally.unanswered}, "
                    f"poll errors {tally.poll_errors}"
                    + (f" {dict(tally.why)}" if tally.why else ""),
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for proc in engines:
                proc.stop()
    print(
        "| round | 200 | 500 | other | unanswered | polls 200 | poll errors "
        "| BusyResourceError logged | router exit | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(row("total", total))
    for why, count in total.why.most_common():
        print(f"- {count} x {why}")
    verdict = "REPRODUCED" if total.failed() else "not reproduced"
    print(
        f"fd_race {verdict}: {total.s500} x 500, {total.unanswered} unanswered, "
        f"{total.ok} x 200, {total.other} other, {total.poll_errors} poll errors "
        f"({total.poll_unanswered} unanswered) in {args.rounds} rounds of {args.clients} "
        f"(queue {args.queue}, {build}, {total.wall_s:.0f} s)"
    )
    return 1 if total.failed() else 0


if __name__ == "__main__":
    raise SystemExit(main())
