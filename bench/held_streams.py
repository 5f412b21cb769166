"""Router memory per open stream (issue 19): RSS as streams are held open, this tree
against another checkout, in one run.

    python bench/held_streams.py [--baseline PATH] [--streams N] [--steps K]

Two fake engines (decode at one token a second, 200 tokens: each stream stays open for
minutes) and the router; the load opens ``--streams`` streams, waits until each has its
first token, and reads the router's resident memory (VmRSS) before and after: the growth
divided by the streams is the memory one open stream holds. ``--steps`` repeats it on top
(the first step also pays for pools and caches that grow once). With ``--baseline PATH``
the same is measured for the narwhal of that checkout, after this tree's. Every stream
ends when its step's measurement is taken, or after 300 s; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).parent))
import peers  # bench/ is not a package: found through the path above

BODY = msgspec.json.encode(
    {"model": peers.MODEL, "prompt": "hello there", "max_tokens": 200, "stream": True}
)
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY)
)
HOLD_LIMIT_S = 300.0  # no stream outlives this, whatever happens


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def hold(port: int, streaming: trio.Semaphore, release: trio.Event) -> None:
    """One stream: open, wait for its first token, then hold it until ``release``."""
    with trio.move_on_after(HOLD_LIMIT_S):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(REQUEST)
            seen = b""
            while b"data:" not in seen:
                data = await stream.receive_some(65536)
                if not data:
                    raise RuntimeError(f"closed before the first token: {seen[:200]!r}")
                seen += data
            streaming.release()
            await release.wait()


async def measure(port: int, pid: int, streams: int, steps: int) -> list[float]:
    """Bytes per open stream, per step."""
    per_stream = []
    releases = []
    async with trio.open_nursery() as nursery:
        for _ in range(steps):
            before = rss_mib(pid)
            streaming = trio.Semaphore(streams, max_value=streams)
            for _ in range(streams):
                await streaming.acquire()  # released at the stream's first token
            release = trio.Event()
            releases.append(release)
            for i in range(streams):
                nursery.start_soon(hold, port, streaming, release)
                if i % 64 == 63:
                    await trio.sleep(0.01)  # a burst at a time: the SYN queue stays short
            with trio.fail_after(HOLD_LIMIT_S / 2):
                for _ in range(streams):
                    await streaming.acquire()  # every stream has its first token
            await trio.sleep(1.0)  # the router settles (its first tokens written)
            per_stream.append((rss_mib(pid) - before) * 1024 * 1024 / streams)
        for release in releases:
            release.set()
    return per_stream


def run_one(name: str, root: str | None, streams: int, steps: int, tmp: Path) -> list[float]:
    scenario = peers.Scenario("held", 1, 1, 200, itl_s=1.0)
    engines, p_url, d_url = peers.start_engines(scenario, tmp)
    router, url = peers.start_narwhal(p_url, d_url, tmp, name=name, root=root)
    try:
        port = int(url.rsplit(":", 1)[1])
        return trio.run(measure, port, router.proc.pid, streams, steps)
    finally:
        for proc in (router, *engines):
            proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="another checkout's narwhal, measured after this")
    parser.add_argument("--streams", type=int, default=2000, help="streams opened per step")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 3 * args.streams * args.steps + 100:
        sys.exit(f"the descriptor limit ({hard}) is too low for {args.streams} x {args.steps}")
    targets = [("narwhal", None)] + ([("narwhal-main", args.baseline)] if args.baseline else [])
    with tempfile.TemporaryDirectory() as tmp:
        for name, root in targets:
            figures = run_one(name, root, args.streams, args.steps, Path(tmp))
            steps = ", ".join(f"{b / 1024:.1f} KiB" for b in figures)
            print(f"{name}: per open stream, step by step ({args.streams} each): {steps}")


if __name__ == "__main__":
    main()
