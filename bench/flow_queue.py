"""The admission queue's cost per operation (narwhal.core.flow), on this machine's CPU.

    python bench/flow_queue.py [--entries 10000] [--keys 50] [--repeat 5]

Three timings, best of ``--repeat``: ``--entries`` offers into an empty queue (tenants in
turn, classes mixed), then as many dispatches (``next``) until it is empty; and a steady
state with the queue held at ``--entries`` deep (one offer, one dispatch, one
``next_expiry`` per step), the shape the shell runs while the fleet is saturated.
"""

from __future__ import annotations

import argparse
import time
from itertools import cycle

from narwhal.core.flow import Entry, FlowQueue, Priority


def entries(count: int, keys: int, first: int = 0) -> list[Entry]:
    classes = cycle([Priority.DEFAULT, Priority.DEFAULT, Priority.BATCH, Priority.INTERACTIVE])
    return [
        Entry(i, next(classes), f"tenant-{i % keys}", arrival=i * 1e-4, deadline=600.0)
        for i in range(first, first + count)
    ]


def fill_then_empty(count: int, keys: int) -> tuple[float, float]:
    queue = FlowQueue(max_queued=count, max_queue_wait_s=30.0)
    batch = entries(count, keys)
    start = time.perf_counter()
    for entry in batch:
        queue.offer(entry, now=1.0)
    offered = time.perf_counter()
    while queue.next(1.0) is not None:
        pass
    done = time.perf_counter()
    return (offered - start) / count, (done - offered) / count


def steady(count: int, keys: int) -> float:
    queue = FlowQueue(max_queued=count + 1, max_queue_wait_s=30.0)
    for entry in entries(count, keys):
        queue.offer(entry, now=1.0)
    more = entries(count, keys, first=count)
    start = time.perf_counter()
    for entry in more:
        queue.offer(entry, now=1.0)
        queue.next(1.0)
        queue.next_expiry()
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    runs = [fill_then_empty(args.entries, args.keys) for _ in range(args.repeat)]
    offer = min(r[0] for r in runs)
    dispatch = min(r[1] for r in runs)
    step = min(steady(args.entries, args.keys) for _ in range(args.repeat))
    print(f"{args.entries} entries over {args.keys} keys, best of {args.repeat}:")
    print(f"  offer                        {offer * 1e6:6.2f} us")
    print(f"  next                         {dispatch * 1e6:6.2f} us")
    print(f"  steady offer+next+expiry     {step * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
