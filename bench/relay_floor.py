"""What trio itself costs to relay a token, by the shape of the relay (issue 19).

    python bench/relay_floor.py [--streams 256] [--chunks 60] [--itl-s 0.05] [--rounds 2]

A source process writes one SSE-sized chunk to each of N loopback sockets every ITL; this
process relays every chunk to a sink process's socket; the figure is this process's CPU
(user and system) per chunk. No parsing, no HTTP: only the shape of the waiting.

- ``tasks``: one trio task per stream, ``wait_readable`` + ``os.read`` + ``os.write``;
- ``layered``: the same under three coroutine layers and a cancel-scope deadline moved
  per chunk (the shape of the router's relay before the stream reactor);
- ``reactor``: one task over a private level-triggered epoll, which trio waits on
  (``narwhal.router.stream_reactor``'s shape).

Ratios are against ``tasks`` within the same round; rounds interleave the shapes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import select
import socket
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

CHUNK = b"9c\r\ndata: " + b"x" * 146 + b"\n\n\r\n"
SHAPES = ("tasks", "layered", "reactor")


def source(port: int, streams: int, chunks: int, itl_s: float) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    due = time.monotonic()
    for _ in range(chunks):
        for k, s in enumerate(socks):
            s.send(CHUNK)
            if k % 32 == 31:  # spread each round of writes over the gap, as engines do
                time.sleep(itl_s / 8 / max(1, streams // 32))
        due += itl_s
        time.sleep(max(0.0, due - time.monotonic()))
    for s in socks:
        s.close()


def sink(port: int, streams: int) -> None:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
    poller = select.epoll()
    live = {}
    for s in socks:
        s.setblocking(False)
        poller.register(s.fileno(), select.EPOLLIN)
        live[s.fileno()] = s
    deadline = time.monotonic() + 600
    while live and time.monotonic() < deadline:
        for fd, _ in poller.poll(5):
            try:
                data = live[fd].recv(65536)
            except BlockingIOError:
                continue
            if not data:
                poller.unregister(fd)
                live.pop(fd).close()


async def accept(listener: trio.SocketListener, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        stream = await listener.accept()
        raw = stream.socket.detach()  # type: ignore[attr-defined]
        sock = socket.socket(fileno=raw)
        sock.setblocking(False)
        out.append(sock)
    return out


async def relay_tasks(pairs: list[tuple[socket.socket, socket.socket]], count: list[int]) -> None:
    async def one(i: socket.socket, o: socket.socket) -> None:
        fi, fo = i.fileno(), o.fileno()
        while True:
            await trio.lowlevel.wait_readable(i)
            data = os.read(fi, 65536)
            if not data:
                break
            count[0] += 1
            os.write(fo, data)

    async with trio.open_nursery() as nursery:
        for i, o in pairs:
            nursery.start_soon(one, i, o)


async def relay_layered(pairs: list[tuple[socket.socket, socket.socket]], count: list[int]) -> None:
    async def read3(fd: int) -> bytes:
        await trio.lowlevel.wait_readable(fd)
        return os.read(fd, 65536)

    async def read2(fd: int) -> bytes:
        return await read3(fd)

    async def read1(fd: int) -> bytes:
        return await read2(fd)

    async def one(i: socket.socket, o: socket.socket) -> None:
        fi, fo = i.fileno(), o.fileno()
        with trio.CancelScope(deadline=trio.current_time() + 600) as scope:
            while data := await read1(fi):
                count[0] += 1
                os.write(fo, data)
                scope.deadline = trio.current_time() + 600

    async with trio.open_nursery() as nursery:
        for i, o in pairs:
            nursery.start_soon(one, i, o)


async def relay_reactor(pairs: list[tuple[socket.socket, socket.socket]], count: list[int]) -> None:
    poller = select.epoll()
    route = {}
    for i, o in pairs:
        poller.register(i.fileno(), select.EPOLLIN)
        route[i.fileno()] = o.fileno()
    while route:
        await trio.lowlevel.wait_readable(poller.fileno())
        for fd, _ in poller.poll(0):
            data = os.read(fd, 65536)
            if not data:
                poller.unregister(fd)
                del route[fd]
                continue
            count[0] += 1
            os.write(route[fd], data)
    poller.close()


RELAYS: dict[str, Callable[[list[tuple[socket.socket, socket.socket]], list[int]], Awaitable[None]]]
RELAYS = {"tasks": relay_tasks, "layered": relay_layered, "reactor": relay_reactor}


async def measure(shape: str, streams: int, chunks: int, itl_s: float) -> tuple[float, float]:
    """(user µs, system µs) per relayed chunk."""
    listeners = [(await trio.open_tcp_listeners(0, host="127.0.0.1"))[0] for _ in range(2)]
    ports = [lst.socket.getsockname()[1] for lst in listeners]
    procs = [
        mp.Process(target=source, args=(ports[0], streams, chunks, itl_s)),
        mp.Process(target=sink, args=(ports[1], streams)),
    ]
    for p in procs:
        p.start()
    ins = await accept(listeners[0], streams)
    outs = await accept(listeners[1], streams)
    count = [0]
    before = resource.getrusage(resource.RUSAGE_SELF)
    with trio.fail_after(600):
        await RELAYS[shape](list(zip(ins, outs, strict=True)), count)
    after = resource.getrusage(resource.RUSAGE_SELF)
    for s in ins + outs:
        s.close()
    for lst in listeners:
        await lst.aclose()
    for p in procs:
        p.join(timeout=60)
    n = max(count[0], 1)
    return (
        (after.ru_utime - before.ru_utime) / n * 1e6,
        (after.ru_stime - before.ru_stime) / n * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=60)
    parser.add_argument("--itl-s", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, list[tuple[float, float]]] = {s: [] for s in SHAPES}
    for _ in range(args.rounds):
        for shape in SHAPES:
            figures[shape].append(trio.run(measure, shape, args.streams, args.chunks, args.itl_s))
    print(f"{args.streams} streams, {args.chunks} chunks each, {args.itl_s * 1000:g} ms apart")
    print("| shape | user µs/chunk | system µs/chunk | total vs tasks (per round) |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        rounds = figures[shape]
        ratios = [
            (u + s) / (tu + ts) for (u, s), (tu, ts) in zip(rounds, figures["tasks"], strict=True)
        ]
        print(
            f"| {shape} | {statistics.median(u for u, _ in rounds):.1f} "
            f"| {statistics.median(s for _, s in rounds):.1f} "
            f"| {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
