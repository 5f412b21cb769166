"""A Mooncake FAST'25 trace as a replayable workload, sans I/O (bench/replay_trace.py).

A trace line is one request: its arrival (``timestamp``, ms), ``input_length`` and
``output_length`` in tokens, and ``hash_ids``, one id per 512-token block of the prompt
(the last one partly filled): two requests that share leading ids share those blocks'
tokens. The trace has no text; the prompts are rebuilt here so that they share exactly the
trace's prefixes under the fake engine's tokenizer (a token per whitespace-separated word,
``narwhal.fake_engine.cost``): each id is a fixed block of words, the same in every request
and every run, and the last block is cut to the input length.

``scale`` shrinks every length by the same factor, so that a 2-core machine can replay a
trace whose prompts average 12,000 tokens: a 512-token block becomes ``512 x scale`` words
(a multiple of the fake engine's 16-token block, so that trace blocks and engine blocks
line up and a shared trace block is shared whole), an input of n blocks keeps n blocks,
and the output is ``min(output_length, output_cap) x scale`` tokens.

What an ideal router leaves the prefill engines to compute is what no earlier request
computed: each prompt's tokens less its leading 16-token blocks already seen (an unbounded
cache that every request can use; a hit never covers the last token, as in vLLM). The load
calibration (``prefill_ms_for_load``) is built on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id (Mooncake's block size)
ENGINE_BLOCK = 16  # the fake engine's (and vLLM's) prefix-cache block
TRACES = Path(__file__).with_name("traces")
NAMED = {  # --trace NAME: the committed slices (bench/traces/README.md)
    "conversation": TRACES / "conversation_trace_first10min.jsonl",
    "synthetic": TRACES / "synthetic_trace_first10min.jsonl",
}


@dataclass(frozen=True)
class TraceRequest:
    at_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Scale:
    """How trace lengths become the replay's: ``factor`` on every length, outputs capped
    at ``output_cap`` trace tokens first."""

    factor: float = 1.0
    output_cap: int = 512

    @property
    def block_words(self) -> int:
        return round(TRACE_BLOCK * self.factor)

    def check(self) -> None:
        words = TRACE_BLOCK * self.factor
        if words != self.block_words or self.block_words % ENGINE_BLOCK or words <= 0:
            raise ValueError(
                f"--scale-tokens {self.factor}: a 512-token block must become a positive "
                f"multiple of {ENGINE_BLOCK} words (e.g. 1, 0.5, 0.25, 0.125, 0.0625, 0.03125)"
            )

    def input_tokens(self, req: TraceRequest) -> int:
        """Every block but the last whole, the last its share of the input, scaled and
        rounded up (at least one word, at most a whole block)."""
        full = len(req.hash_ids) - 1
        last_trace = req.input_length - full * TRACE_BLOCK
        last = min(self.block_words, max(1, math.ceil(last_trace * self.factor)))
        return full * self.block_words + last

    def output_tokens(self, req: TraceRequest) -> int:
        return max(1, round(min(req.output_length, self.output_cap) * self.factor))


def load_trace(path: Path, start_s: float, window_s: float, limit: int) -> list[TraceRequest]:
    """The requests that arrive in ``[start_s, start_s + window_s)`` of the trace, at most
    ``limit``, their arrivals made relative to ``start_s``. Reads the file line by line and
    stops at the window's end (the traces are in arrival order)."""
    out: list[TraceRequest] = []
    begin, end = start_s * 1000, (start_s + window_s) * 1000
    with path.open() as lines:
        for line in lines:
            row = json.loads(line)
            at = row["timestamp"]
            if at >= end or len(out) >= limit:
                break
            if at < begin or not row["hash_ids"]:
                continue
            ids = tuple(int(h) for h in row["hash_ids"])
            out.append(
                TraceRequest(int(at - begin), int(row["input_length"]), row["output_length"], ids)
            )
    return out


_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _base36(n: int) -> str:
    out = ""
    while True:
        n, digit = divmod(n, 36)
        out = _DIGITS[digit] + out
        if not n:
            return out


def block_text(hash_id: int, words: int) -> list[str]:
    """The words of a trace block: the same for an id in every request and every run, and
    unlike every other id's from its first word (short words: a prompt's bytes are what a
    router parses)."""
    head = _base36(hash_id)
    return [f"{head}.{_base36(i)}" for i in range(words)]


def prompt_text(req: TraceRequest, scale: Scale, cache: dict[int, str]) -> str:
    """The prompt: each id's block in turn, the last cut to ``scale.input_tokens``; whole
    blocks' texts are kept in ``cache`` (ids recur across requests)."""
    size = scale.block_words
    total = scale.input_tokens(req)
    parts = []
    for n, hash_id in enumerate(req.hash_ids):
        text = cache.get(hash_id)
        if text is None:
            text = cache[hash_id] = " ".join(block_text(hash_id, size))
        left = total - n * size
        parts.append(text if left >= size else " ".join(text.split(" ")[:left]))
    return " ".join(parts)


def engine_blocks(req: TraceRequest, scale: Scale) -> list[tuple[int, int]]:
    """The keys of the prompt's full 16-token blocks, in order: (trace id, block within
    it). Ids are prefix hashes already, so a key names the same tokens after the same
    prefix wherever it appears."""
    per_trace_block = scale.block_words // ENGINE_BLOCK
    full = scale.input_tokens(req) // ENGINE_BLOCK
    return [(req.hash_ids[k // per_trace_block], k % per_trace_block) for k in range(full)]


@dataclass(frozen=True)
class Work:
    """The slice's prefill work in replay tokens."""

    requests: int
    prompt_tokens: int  # every prompt's, all of it
    ideal_computed: int  # what an unbounded cache shared by all leaves to compute
    working_set_blocks: int  # distinct full 16-token blocks

    @property
    def ideal_hit_rate(self) -> float:
        return 1 - self.ideal_computed / self.prompt_tokens if self.prompt_tokens else 0.0


def work(requests: Iterable[TraceRequest], scale: Scale) -> Work:
    seen: set[tuple[int, int]] = set()
    count = prompt = computed = 0
    for req in requests:
        tokens = scale.input_tokens(req)
        keys = engine_blocks(req, scale)
        held = 0
        while held < len(keys) and keys[held] in seen:
            held += 1
        hit = min(held, (tokens - 1) // ENGINE_BLOCK) * ENGINE_BLOCK
        count, prompt, computed = count + 1, prompt + tokens, computed + tokens - hit
        seen.update(keys)
    return Work(count, prompt, computed, len(seen))


def prefill_ms_for_load(w: Work, duration_s: float, engines: int, slots: int, load: float) -> float:
    """The prefill time per token that keeps ``engines`` prefill engines, each computing
    ``slots`` prompts at once, busy ``load`` of the time when they compute only the ideal
    work within ``duration_s``: capacity ``engines x slots / ms`` tokens per ms."""
    offered_per_ms = w.ideal_computed / (duration_s * 1000)
    return load * engines * slots / offered_per_ms


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
