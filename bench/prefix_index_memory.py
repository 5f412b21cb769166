"""What the approximate prefix index costs: memory per block held, and time per request.

    python bench/prefix_index_memory.py [--out bench/results]

Memory: one engine's index filled to its bound (``MAX_BLOCKS``) with the blocks of
distinct 8 KiB prompts, measured with tracemalloc: what the index keeps alive of the
prompts recorded (each made, recorded and dropped under the trace), reported per block
held. Time, against a baseline measured in the same run (the machine is shared and noisy):
what a request adds to placement, the serialization of its prompt (``prompt_of``) and one
match per engine of an 8-engine fleet, as a ratio to a baseline of one ``msgspec`` decode
of the same request's body (which every request pays anyway).
"""

from __future__ import annotations

import argparse
import platform
import random
import time
import tracemalloc
from pathlib import Path

import msgspec

from narwhal.core.prefix_index import BLOCK_BYTES, MAX_BLOCKS, PrefixIndex, prompt_of

PROMPT_BYTES = 8192
ENGINES = 8
ROUNDS = 2000


def words(rng: random.Random, size: int) -> str:
    out: list[str] = []
    while sum(map(len, out)) + len(out) < size:
        out.append(f"w{rng.randrange(1 << 24):x}")
    return " ".join(out)[:size]


def memory_per_block() -> tuple[float, int]:
    """What the index keeps alive once the requests are gone: each prompt is made, recorded
    and dropped under the trace, so its blocks count where the index holds on to them."""
    rng = random.Random(1)
    texts = [words(rng, PROMPT_BYTES) for _ in range(MAX_BLOCKS * BLOCK_BYTES // PROMPT_BYTES + 1)]
    index = PrefixIndex(ttl_s=120.0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for text in texts:  # at one time: nothing expires, the bound alone evicts
        index.record("e0", prompt_of({"prompt": text}, chat=False).blocks, 0.0)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    held = index.size("e0")
    return used / held, held


def per_request_us() -> tuple[float, float]:
    rng = random.Random(2)
    system = words(rng, PROMPT_BYTES)
    bodies = [
        msgspec.json.encode(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": words(rng, 200)},
                ],
            }
        )
        for _ in range(ROUNDS)
    ]
    index = PrefixIndex(ttl_s=120.0)
    first = prompt_of(msgspec.json.decode(bodies[0]), chat=True)
    for e in range(ENGINES):
        index.record(f"e{e}", first.blocks, 0.0)
    started = time.perf_counter()
    decoded = [msgspec.json.decode(body) for body in bodies]
    baseline = time.perf_counter() - started
    started = time.perf_counter()
    for body in decoded:
        prompt = prompt_of(body, chat=True)
        for e in range(ENGINES):
            index.match(f"e{e}", prompt.blocks, 1.0)
    work = time.perf_counter() - started
    return work / ROUNDS * 1e6, baseline / ROUNDS * 1e6


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    per_block, held = memory_per_block()
    index_us, decode_us = per_request_us()
    report = (
        f"# Prefix index cost, {time.strftime('%Y-%m-%d')}\n\n"
        f"Command: `python bench/prefix_index_memory.py`. Machine: {platform.node()}, "
        f"Python {platform.python_version()}.\n\n"
        f"- memory: {per_block:.0f} bytes per block held ({held} blocks, one engine at its "
        f"bound of {MAX_BLOCKS}: {per_block * held / 2**20:.1f} MiB per engine at most)\n"
        f"- time per request (an {PROMPT_BYTES}-byte chat prompt, {ENGINES} engines "
        f"matched): {index_us:.1f} us, {index_us / decode_us:.2f}x the msgspec decode of "
        f"the same body ({decode_us:.1f} us) measured in the same run\n"
    )
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix-index-memory.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
