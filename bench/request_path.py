"""What the request path costs per request: the client's body parsed, the prefill leg's
body built, the producer's answer read, the decode leg's body built. Time and memory, this
tree against another checkout, in one run.

    python bench/request_path.py [--baseline PATH] [--requests N] [--rounds K]

Each workload (a short completion, a long prompt, a chat of many messages, a prompt of
token ids) runs through ``parse_request``, ``NixlConnector.prefill_body``, ``extract`` and
``decode_body`` with both legs' bodies encoded, as the engine client sends them. Figures:

- CPU time per request, the best of ``--rounds`` rounds of ``--requests`` requests;
- what one request holds while its decode streams (tracemalloc: bytes and blocks still
  allocated with the request, its placement keys and its descriptor alive), and its peak
  while the legs' bodies are built.

With ``--baseline PATH`` the same script runs again in a child process on the narwhal of
that checkout, and the table shows both with their ratio. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

MODEL = "bench"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_encode = msgspec.json.Encoder().encode

# the producer's answer as vLLM 0.32 sends it (shared/vllm-cpu/captures/edge_chat.txt)
DESCRIPTOR = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [list(range(2, 34))],
    "remote_engine_id": "69143368-a291-457a-af08-6d1f7ea3cc62",
    "remote_request_id": "cmpl-bench-1-89b67fce",
    "remote_host": "127.0.0.1",
    "remote_port": 15600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 500,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
    "remote_prefill_cached_tokens": 0,
}
PREFILL_ANSWER = _encode(
    {
        "id": "cmpl-bench-1",
        "object": "text_completion",
        "created": 1795973266,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": "in",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        ],
        "usage": {"prompt_tokens": 500, "total_tokens": 501, "completion_tokens": 1},
        "kv_transfer_params": DESCRIPTOR,
    }
)
SAMPLING = {"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "seed": 7}


def _words(n: int) -> str:
    return " ".join(f"word{i % 97}" for i in range(n))


WORKLOADS: dict[str, tuple[str, bytes]] = {
    "completion, short prompt": (
        COMPLETIONS,
        _encode({"model": MODEL, "prompt": "hello there", "stream": True, **SAMPLING}),
    ),
    "completion, 4 KiB prompt": (
        COMPLETIONS,
        _encode({"model": MODEL, "prompt": _words(600), "stream": True, **SAMPLING}),
    ),
    "chat, 24 messages": (
        CHAT,
        _encode(
            {
                "model": MODEL,
                "messages": [
                    {"role": ("user", "assistant")[i % 2], "content": _words(40)} for i in range(24)
                ],
                "stream": True,
                "stream_options": {"include_usage": True},
                **SAMPLING,
            }
        ),
    ),
    "completion, 2,000 token ids": (
        COMPLETIONS,
        _encode({"model": MODEL, "prompt": list(range(1000, 3000)), "stream": True, **SAMPLING}),
    ),
}


def one_request(endpoint: str, raw: bytes) -> tuple[object, ...]:
    """The request path's body work for one request, as ``RequestRun`` does it: parse,
    what placement keys on, both legs' bodies encoded (each is let go once sent), the
    producer's answer read. Returns what the request holds while its decode streams."""
    from narwhal.core.connector import NixlConnector
    from narwhal.core.policies import prefix_key
    from narwhal.core.prefix_index import prompt_of
    from narwhal.core.requests import parse_request

    connector = NixlConnector()
    chat = endpoint == CHAT
    req = parse_request(raw, endpoint=endpoint, model=MODEL)
    keys = prefix_key(req.body, chat=chat), prompt_of(req.body, chat=chat)
    forget = getattr(req.body, "forget_prompt", None)  # a dict body has nothing to drop
    if forget is not None:
        forget()
    _encode(connector.prefill_body(req.body))
    result = connector.extract(
        PREFILL_ANSWER, producer_url="http://127.0.0.1:1", endpoint=endpoint, request_id="r1"
    )
    _encode(connector.decode_body(req.body, result, endpoint=endpoint))
    return req, keys, result


def cpu_us(step: Callable[[], object], requests: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time_ns()
        for _ in range(requests):
            step()
        best = min(best, (time.process_time_ns() - start) / requests / 1000)
    return best


def memory(step: Callable[[], object]) -> dict[str, int]:
    """Held bytes and blocks after one request (its products alive), and its peak."""
    step()  # caches, interned names and first-call allocations are not the request's
    gc.collect()
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        kept = step()
        held, peak = tracemalloc.get_traced_memory()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    blocks = sum(s.count_diff for s in after.compare_to(before, "traceback"))
    del kept
    return {"held_bytes": held - base, "held_blocks": blocks, "peak_bytes": peak - base}


def measure(requests: int, rounds: int) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for name, (endpoint, raw) in WORKLOADS.items():

        def step(endpoint: str = endpoint, raw: bytes = raw) -> object:
            return one_request(endpoint, raw)

        row: dict[str, float] = {"body_bytes": len(raw), "cpu_us": cpu_us(step, requests, rounds)}
        row.update(memory(step))
        rows[name] = row
    return rows


def in_checkout(path: Path, requests: int, rounds: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(path.resolve()), "NARWHAL_PURE": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--json", "--requests", str(requests), "--rounds", str(rounds)],
        env=env,
        cwd=path,
        check=True,
        capture_output=True,
        timeout=600,
    ).stdout
    rows: dict[str, dict[str, float]] = msgspec.json.decode(out)
    return rows


def table(ours: dict[str, dict[str, float]], base: dict[str, dict[str, float]] | None) -> str:
    lines = []
    if base is None:
        lines.append("| workload | body | CPU per request | held | held blocks | peak |")
        lines.append("|---|---|---|---|---|---|")
        for name, r in ours.items():
            lines.append(
                f"| {name} | {r['body_bytes'] / 1024:.1f} KiB | {r['cpu_us']:.1f} us "
                f"| {r['held_bytes'] / 1024:.1f} KiB | {r['held_blocks']:.0f} "
                f"| {r['peak_bytes'] / 1024:.1f} KiB |"
            )
        return "\n".join(lines)
    lines.append(
        "| workload | body | CPU per request (this / baseline) | held (this / baseline) "
        "| held blocks | peak |"
    )
    lines.append("|---|---|---|---|---|---|")
    for name, r in ours.items():
        b = base[name]
        lines.append(
            f"| {name} | {r['body_bytes'] / 1024:.1f} KiB "
            f"| {r['cpu_us']:.1f} / {b['cpu_us']:.1f} us ({_ratio(r, b, 'cpu_us')}) "
            f"| {r['held_bytes'] / 1024:.1f} / {b['held_bytes'] / 1024:.1f} KiB "
            f"({_ratio(r, b, 'held_bytes')}) "
            f"| {r['held_blocks']:.0f} / {b['held_blocks']:.0f} ({_ratio(r, b, 'held_blocks')}) "
            f"| {r['peak_bytes'] / 1024:.1f} / {b['peak_bytes'] / 1024:.1f} KiB "
            f"({_ratio(r, b, 'peak_bytes')}) |"
        )
    return "\n".join(lines)


def _ratio(ours: dict[str, Any], base: dict[str, Any], key: str) -> str:
    return f"{ours[key] / base[key]:.2f}x" if base[key] else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout to measure against")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        sys.stdout.buffer.write(_encode(measure(args.requests, args.rounds)))
        return
    ours = measure(args.requests, args.rounds)
    base = in_checkout(args.baseline, args.requests, args.rounds) if args.baseline else None
    print(table(ours, base))


if __name__ == "__main__":
    main()
