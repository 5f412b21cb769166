"""What one held stream holds in the router, by the file that allocated it: the Python
objects behind ``bench/held_streams.py``'s resident memory per stream.

    python bench/held_stream_objects.py [--streams N] [--frames K] [--top T] [--root PATH]

The router runs under tracemalloc (``--frames`` frames a trace) with a SIGUSR1 handler
that writes a snapshot. Streams are held open as ``held_streams`` holds them (a first
token, then silence): ``--streams`` of them, a snapshot, as many more, a snapshot. The
difference, divided by the streams, is what one stream holds; it is shown by file (the
allocation's innermost frame), and ``--top`` lines by the first frame in narwhal's code.
Every stream ends when the second snapshot is written, or after 300 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).parent))
import held_streams  # bench/ is not a package: found through the path above
import peers

AS_ROUTER = "--as-router"
SNAPSHOTS = "NARWHAL_BENCH_SNAPSHOTS"
SNAPSHOT_WAIT_S = 120.0


def serve_traced() -> None:
    """The router's process: tracemalloc on, a snapshot written at each SIGUSR1."""
    frames = int(sys.argv[2])
    folder = Path(os.environ[SNAPSHOTS])
    taken = 0

    def snapshot(_signum: int, _frame: object) -> None:
        nonlocal taken
        taken += 1
        path = folder / f"snapshot-{taken}"
        tracemalloc.take_snapshot().dump(str(path) + ".part")
        Path(str(path) + ".part").rename(path)  # whole, or not there

    tracemalloc.start(frames)
    signal.signal(signal.SIGUSR1, snapshot)
    sys.argv = ["narwhal", *sys.argv[3:]]
    from narwhal.process.cli import main

    main()


def take(pid: int, folder: Path, number: int) -> tracemalloc.Snapshot:
    os.kill(pid, signal.SIGUSR1)
    path = folder / f"snapshot-{number}"
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    while not path.exists():  # bounded: the router writes it between two events
        if time.monotonic() > deadline:
            raise RuntimeError("the router wrote no snapshot")
        time.sleep(0.2)
    return tracemalloc.Snapshot.load(str(path))


async def hold_and_snapshot(
    port: int, pid: int, folder: Path, streams: int
) -> list[tracemalloc.Snapshot]:
    snapshots = []
    async with trio.open_nursery() as nursery:
        release = trio.Event()
        for step in (1, 2):
            streaming = trio.Semaphore(streams, max_value=streams)
            for _ in range(streams):
                await streaming.acquire()  # released at the stream's first token
            for i in range(streams):
                nursery.start_soon(held_streams.hold, port, streaming, release)
                if i % 64 == 63:
                    await trio.sleep(0.01)  # a burst at a time: the SYN queue stays short
            with trio.fail_after(held_streams.HOLD_LIMIT_S / 2):
                for _ in range(streams):
                    await streaming.acquire()
            await trio.sleep(1.0)  # the router settles (its first tokens written)
            snapshots.append(await trio.to_thread.run_sync(take, pid, folder, step))
        release.set()
    return snapshots


def ours(trace: tracemalloc.Traceback) -> str:
    """The innermost frame in narwhal's own code, else the innermost frame."""
    for frame in reversed(trace):  # tracemalloc keeps the innermost frame last
        if "/narwhal/" in frame.filename:
            return f"{frame.filename.split('/narwhal/', 1)[1]}:{frame.lineno}"
    return f"{trace[-1].filename}:{trace[-1].lineno}"


def report(
    before: tracemalloc.Snapshot,
    after: tracemalloc.Snapshot,
    streams: int,
    top: int,
    detail: str | None = None,
    made_by: str | None = None,
) -> str:
    lines = ["| file | bytes per stream | objects per stream |", "|---|---|---|"]
    diff = after.compare_to(before, "filename")
    total = sum(d.size_diff for d in diff)
    for d in sorted(diff, key=lambda d: -d.size_diff)[:top]:
        name = d.traceback[0].filename
        name = name.split("site-packages/", 1)[-1].split("/lib/python3", 1)[-1]
        lines.append(f"| {name} | {d.size_diff / streams:.0f} | {d.count_diff / streams:.1f} |")
    lines.append(f"| **total** | **{total / streams:.0f}** | |")
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for d in after.compare_to(before, "traceback"):
        key = ours(d.traceback)
        sizes[key] += d.size_diff
        counts[key] += d.count_diff
    lines += ["", "| where in narwhal | bytes per stream | objects per stream |", "|---|---|---|"]
    for key, size in sizes.most_common(top):
        lines.append(f"| {key} | {size / streams:.0f} | {counts[key] / streams:.1f} |")
    if detail is not None:
        lines += ["", f"| under {detail}: innermost frame | bytes per stream | objects |"]
        lines.append("|---|---|---|")
        inner: Counter[str] = Counter()
        for d in after.compare_to(before, "traceback"):
            if ours(d.traceback).startswith(detail):
                frame = d.traceback[-1]
                inner[f"{frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno}"] += d.size_diff
        for key, size in inner.most_common(top):
            lines.append(f"| {key} | {size / streams:.0f} | |")
    if made_by is not None:
        lines += ["", f"| {made_by}, made under | bytes per stream | objects |", "|---|---|---|"]
        under: Counter[str] = Counter()
        made: Counter[str] = Counter()
        for d in after.compare_to(before, "traceback"):
            if made_by in d.traceback[-1].filename:
                under[ours(d.traceback)] += d.size_diff
                made[ours(d.traceback)] += d.count_diff
        for key, size in under.most_common(top):
            lines.append(f"| {key} | {size / streams:.0f} | {made[key] / streams:.1f} |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == [AS_ROUTER]:
        serve_traced()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams opened per step")
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--detail", help="break down this narwhal file:line by inner frame")
    parser.add_argument("--made-by", help="where the objects this file allocates are made")
    parser.add_argument(
        "--pure", action="store_true", help="the pure build: compiled code shows no frames"
    )
    parser.add_argument("--root", help="another checkout's narwhal, measured instead")
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ[SNAPSHOTS] = tmp
        scenario = peers.Scenario("held", 1, 1, 200, itl_s=1.0)
        engines, p_url, d_url = peers.start_engines(scenario, folder)
        launcher = (str(Path(__file__).absolute()), AS_ROUTER, str(args.frames))
        router, url = peers.serve_narwhal(
            f'model = "{peers.MODEL}"\n'
            + peers.engines_toml([p_url], [d_url])
            + "[serving]\nmax_inflight = 20000\n"
            + "[engine]\nmax_connections = 20000\nfirst_token_timeout_s = 120.0\n"
            # traced, the router is several times slower: a queued stream waits its turn
            + "[admission]\nmax_queue_wait_s = 120.0\n",
            folder,
            launcher=launcher,
            pure=args.pure,
            root=args.root,
        )
        try:
            port = int(url.rsplit(":", 1)[1])
            before, after = trio.run(hold_and_snapshot, port, router.proc.pid, folder, args.streams)
        finally:
            for proc in (router, *engines):
                proc.stop()
    print(report(before, after, args.streams, args.top, args.detail, args.made_by))


if __name__ == "__main__":
    main()
