"""What a request's token ids cost on the request path, for the precise prefix index: added
TTFT at c=1 and router CPU per request, against ``[kv_events]`` off, in one run.

    python bench/kv_tokenize.py [--requests 300] [--rounds 3] [--out bench/results/kv-events]

Four fake engines (two producers, two consumers: placement has a choice, so the ids are
asked for) publishing KV events (``narwhal fake-engine --kv-events-endpoint``) and
the router as processes on 127.0.0.1 (so /proc gives the router's own CPU). Three router
configurations, each started afresh every round, in turn: ``off`` (the approximate index
only), ``engine`` (``tokenizer = "engine"``: one ``POST /tokenize`` per request before its
first placement) and ``tokenizer.json`` (a local Hugging Face tokenizer, written by this
script, for the text prompts). Every request is a distinct 600-word prompt (nothing cached
for the tokenizer's cache to answer), streamed, 16 tokens, one at a time; TTFT is the
client's arrival-to-first-token, CPU the router's utime + stime over the requests. Figures
are medians over rounds of each round's median, and ratios against ``off`` of the same
round.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpcore
import msgspec
import trio

sys.path.insert(0, str(Path(__file__).parent))
from rough import cpu_seconds, start

from narwhal.process.build import describe

WORDS = 600
TOKENS = 16


def tokenizer_json(directory: Path) -> Path:
    """A word-level tokenizer over the prompts' vocabulary (its ids are not the fake's:
    this measures the cost, not the match)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i + 1 for i in range(5000)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    return path


ROLES = ("prefill", "prefill", "decode", "decode")  # two of each: placement has a choice


def fleet_file(directory: Path, urls: list[str], mode: str, tokenizer: str) -> Path:
    text = ['model = "fake-model"']
    for i, (url, role) in enumerate(zip(urls, ROLES, strict=True)):
        text.append(f'[[engines]]\nid = "e{i}"\nurl = "{url}"\nrole = "{role}"')
    text += [
        "[admission]\nqueue = false",
        f'[kv_events]\nmode = "{mode}"\ntokenizer = "{tokenizer}"',
    ]
    path = directory / f"fleet-{mode}-{Path(tokenizer).name}.toml"
    path.write_text("\n\n".join(text) + "\n")
    return path


async def drive(url: str, requests: int, seed: int) -> list[float]:
    headers = [("content-type", "application/json")]
    ttfts = []
    async with httpcore.AsyncConnectionPool(max_connections=1) as pool:
        for i in range(requests):
            words = " ".join(f"w{(seed * 7919 + i * 31 + k) % 5000}" for k in range(WORDS))
            body = {"model": "fake-model", "prompt": f"r{seed}-{i} {words}", "stream": True}
            payload = msgspec.json.encode({**body, "max_tokens": TOKENS})
            t0 = time.perf_counter()
            with trio.fail_after(30):
                async with pool.stream(
                    "POST", url + "/v1/completions", headers=headers, content=payload
                ) as resp:
                    first = None
                    async for part in resp.aiter_stream():
                        if first is None and b'"text"' in part:
                            first = time.perf_counter() - t0
                    assert resp.status == 200
            ttfts.append(first if first is not None else time.perf_counter() - t0)
    return ttfts


def one(config: Path, requests: int, seed: int) -> tuple[float, float]:
    """Median TTFT (s) and router CPU per request (s) of one configuration."""
    router, url = start("serve", "--config", str(config), "--port", "0")
    try:
        trio.run(drive, url, 10, seed + 1000)  # warm: connections, the streams live
        before = cpu_seconds(router.pid)
        ttfts = trio.run(drive, url, requests, seed)
        cpu = (cpu_seconds(router.pid) - before) / requests
        return statistics.median(ttfts), cpu
    finally:
        router.terminate()
        router.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="narwhal-kv-tokenize-") as tmp:
        directory = Path(tmp)
        engines = []
        urls = []
        for role in ROLES:
            proc, url = start(
                "fake-engine", "--port", "0", "--role", role,
                "--kv-events-endpoint", "tcp://127.0.0.1:0",
                "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
            )  # fmt: skip
            engines.append(proc)
            urls.append(url)
        local = str(tokenizer_json(directory))
        configs = {
            "off": fleet_file(directory, urls, "off", "engine"),
            "engine": fleet_file(directory, urls, "subscribe", "engine"),
            "tokenizer.json": fleet_file(directory, urls, "subscribe", local),
        }
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
        try:
            for r in range(args.rounds):
                for name, config in configs.items():
                    results[name].append(one(config, args.requests, seed=r))
        finally:
            for proc in engines:
                proc.terminate()
                proc.wait(timeout=30)
    lines = [
        f"# Token ids on the request path: {args.requests} requests x {args.rounds} rounds, c=1",
        "",
        f"`python bench/kv_tokenize.py --requests {args.requests} --rounds {args.rounds}` on "
        f"{platform.machine()} ({os.cpu_count()} cores), Python {platform.python_version()}, "
        f"{describe()}; {WORDS}-word distinct prompts, {TOKENS} tokens streamed.",
        "",
        "| tokenizer | TTFT p50 | added TTFT | TTFT vs off | router CPU / request | CPU vs off |",
        "|---|---|---|---|---|---|",
    ]
    for name in configs:
        ttft = statistics.median(t for t, _ in results[name])
        cpu = statistics.median(c for _, c in results[name])
        ratios_t = [a[0] / b[0] for a, b in zip(results[name], results["off"], strict=True)]
        ratios_c = [a[1] / b[1] for a, b in zip(results[name], results["off"], strict=True)]
        added = (ttft - statistics.median(t for t, _ in results["off"])) * 1000
        lines.append(
            f"| {name} | {ttft * 1000:.2f} ms | {added:+.2f} ms | "
            f"{statistics.median(ratios_t):.2f}x | {cpu * 1000:.2f} ms | "
            f"{statistics.median(ratios_c):.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokenize-cost.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
