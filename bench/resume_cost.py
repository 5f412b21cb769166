"""What stream resume costs a stream that never fails: the relay rules per token with the
ids kept and put back to null for the client, against the same rules with resume off,
measured in the same run (the machine is shared and noisy).

    python bench/resume_cost.py [--out bench/results]

Each case relays a 64-token stream in vLLM's wire shape (the engine's ``return_token_ids``
chunks for the resume cases, ``"token_ids":null`` ones for the baseline), one chunk per
read, through ``StreamRelay.feed``, ``ROUNDS`` times, in interleaved rounds; the figure is
the median over rounds of microseconds per token. Also shown: a continuation's chunks
written as the client's (``Reframer``), which only a resumed stream pays.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from narwhal.stream.continuation import Kept, Reframer, without_ids
from narwhal.stream.rules import StreamRelay

TOKENS = 64
ROUNDS = 400
REPEATS = 7
_encode = msgspec.json.encode


def chunk(n: int, with_ids: bool, rid: str = "cmpl-0123456789abcdef-a1-decode") -> bytes:
    """One chunk as vLLM 0.32 streams a completion token."""
    return (
        b"data: "
        + _encode(
            {
                "id": rid,
                "object": "text_completion",
                "created": 1764600000,
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "choices": [
                    {
                        "index": 0,
                        "text": " narwhal",
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                        "prompt_token_ids": [1, 2, 3, 4] if with_ids and n == 0 else None,
                        "token_ids": [4000 + n] if with_ids else None,
                    }
                ],
            }
        )
        + b"\n\n"
    )


def stream(with_ids: bool) -> list[bytes]:
    return [chunk(n, with_ids) for n in range(TOKENS)] + [b"data: [DONE]\n\n"]


def off() -> StreamRelay:
    return StreamRelay()


def kept() -> StreamRelay:
    return StreamRelay(kept=Kept(), rewrite=without_ids)


def reframed() -> StreamRelay:
    keep = Kept()
    keep.id, keep.created, keep.model = "cmpl-client", 1764600000, "m"
    frames = Reframer(keep, chat=True, with_ids=False, prompt_tokens=4, before=10)
    return StreamRelay(kept=keep, rewrite=frames, resumed_at=10)


def per_token(make: Callable[[], StreamRelay], reads: list[bytes]) -> float:
    start = time.perf_counter()
    for _ in range(ROUNDS):
        relay = make()
        for data in reads:
            relay.feed(data)
    return (time.perf_counter() - start) / (ROUNDS * TOKENS) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cases = {
        "resume off (baseline)": (off, stream(False)),
        "resume on: ids kept, null for the client": (kept, stream(True)),
        "a continuation, reframed as chat": (reframed, stream(True)),
    }
    figures: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(REPEATS):  # interleaved: drift on a shared machine hits every case alike
        for name, (make, reads) in cases.items():
            figures[name].append(per_token(make, reads))
    base = statistics.median(figures["resume off (baseline)"])
    lines = [
        "# Stream resume: the relay rules' cost per token",
        "",
        f"`python bench/resume_cost.py`, {platform.python_implementation()} "
        f"{platform.python_version()}, {TOKENS}-token streams x {ROUNDS}, median of "
        f"{REPEATS} interleaved rounds.",
        "",
        "| case | us per token | vs resume off |",
        "|---|---|---|",
    ]
    for name, values in figures.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.2f} | {median / base:.2f}x |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        (args.out / "resume-cost.md").write_text(report)


if __name__ == "__main__":
    main()
