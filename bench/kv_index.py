"""What the precise prefix index costs: memory per engine, time per block of an event batch,
and a request's match, each against a baseline measured in the same run.

    python bench/kv_index.py [--blocks 8192] [--rounds 5] [--out bench/results/kv-events]

Memory: one engine's ``EventStream`` holding ``--blocks`` blocks (vLLM's CPU block of 128
tokens, and the GPU default of 16), stored by realistic batches (a prompt's blocks in one
``BlockStored``), measured with tracemalloc; the approximate index holding as many blocks
is the baseline. Time: decoding and applying a batch, per block, against the approximate
index's ``record`` of the same blocks; a request's match (its keys chained, the longest
held run found) of a 4,096-token prompt on 8 engines, against one ``msgspec`` decode of
the same request's body. Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
import tracemalloc
from pathlib import Path

import msgspec

from narwhal.core.kv_events import Message
from narwhal.core.precise_index import EventStream, TokenPrompt
from narwhal.core.prefix_index import PrefixIndex, token_blocks
from narwhal.process.build import describe

BLOCKS_PER_BATCH = 32  # one prompt of 32 blocks a batch (4k tokens at 128 a block)
_encode = msgspec.msgpack.encode


def batches(blocks: int, block_size: int, seed: int = 1) -> list[Message]:
    rng = random.Random(seed)
    out, next_hash = [], 1 << 40
    for seq in range(0, blocks // BLOCKS_PER_BATCH):
        ids = [rng.randrange(32000) for _ in range(BLOCKS_PER_BATCH * block_size)]
        hashes = list(range(next_hash, next_hash + BLOCKS_PER_BATCH))
        next_hash += BLOCKS_PER_BATCH
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        out.append(Message(b"kv", seq, _encode([time.time(), [event], 0])))
    return out


def memory(blocks: int, block_size: int) -> tuple[float, float]:
    """Bytes per engine of the precise and the approximate index holding ``blocks``."""
    messages = batches(blocks, block_size)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    stream = EventStream(capacity=blocks * 2)
    for message in messages:
        stream.receive(message, 0.0)
    precise = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(stream.blocks) == blocks, len(stream.blocks)
    ids = [list(range(i * 1000, i * 1000 + 16 * BLOCKS_PER_BATCH)) for i in range(len(messages))]
    chains = [token_blocks(i) for i in ids]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    approx = PrefixIndex(ttl_s=1e9, max_blocks=blocks * 2)
    for chain in chains:
        approx.record("e", chain, 0.0)
    approximate = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return precise, approximate


def apply_cost(blocks: int, block_size: int, rounds: int) -> tuple[float, float]:
    """Seconds per block: a batch decoded and applied, and the approximate ``record``."""
    messages = batches(blocks, block_size)
    chains = [token_blocks(list(range(i, i + 16 * BLOCKS_PER_BATCH))) for i in range(len(messages))]
    precise, approximate = [], []
    for _ in range(rounds):
        stream = EventStream(capacity=blocks * 2)
        start = time.perf_counter()
        for message in messages:
            stream.receive(message, 0.0)
        precise.append((time.perf_counter() - start) / blocks)
        index = PrefixIndex(ttl_s=1e9, max_blocks=blocks * 2)
        start = time.perf_counter()
        for chain in chains:
            index.record("e", chain, 0.0)
        approximate.append((time.perf_counter() - start) / blocks)
    return statistics.median(precise), statistics.median(approximate)


def match_cost(rounds: int, block_size: int) -> tuple[float, float]:
    """Seconds per request: keys chained and matched on 8 engines, against a body decode."""
    rng = random.Random(2)
    ids = [rng.randrange(32000) for _ in range(4096)]
    streams = []
    for e in range(8):
        stream = EventStream()
        held = (e + 1) * (4096 // block_size) // 8 * block_size
        event = {
            "type": "BlockStored",
            "block_hashes": list(range(held // block_size)),
            "parent_block_hash": None,
            "token_ids": ids[:held],
            "block_size": block_size,
        }
        stream.receive(Message(b"kv", 0, _encode([0.0, [event], 0])), 0.0)
        streams.append(stream)
    body = msgspec.json.encode({"model": "m", "prompt": ids, "max_tokens": 64})
    n = 200
    match, decode = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            prompt = TokenPrompt(ids)
            for stream in streams:
                prompt.held(stream)
        match.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        for _ in range(n):
            msgspec.json.decode(body)
        decode.append((time.perf_counter() - start) / n)
    return statistics.median(match), statistics.median(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = [
        f"# The precise prefix index: {args.blocks} blocks, {args.rounds} rounds",
        "",
        f"`python bench/kv_index.py --blocks {args.blocks} --rounds {args.rounds}` on "
        f"{platform.machine()}, Python {platform.python_version()}, {describe()}.",
        "",
        "| block size | memory per engine | vs approximate | per block of a batch "
        "| vs approximate record |",
        "|---|---|---|---|---|",
    ]
    for block_size in (128, 16):
        precise, approximate = memory(args.blocks, block_size)
        cost, base = apply_cost(args.blocks, block_size, args.rounds)
        lines.append(
            f"| {block_size} | {precise / 1024:.0f} KiB ({precise / args.blocks:.0f} B/block) "
            f"| {precise / approximate:.2f}x | {cost * 1e6:.2f} us | {cost / base:.2f}x |"
        )
    lines += ["", "| request match (4,096 tokens, 8 engines) | per request | vs body decode |"]
    lines.append("|---|---|---|")
    for block_size in (128, 16):
        match, decode = match_cost(args.rounds, block_size)
        lines.append(f"| block size {block_size} | {match * 1e6:.1f} us | {match / decode:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "index-cost.md").write_text(text)


if __name__ == "__main__":
    main()
