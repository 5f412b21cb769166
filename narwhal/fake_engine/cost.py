"""The fake engine's cost model, sans I/O: prompt tokens, prompt blocks and a prefix cache.

What it models, all of it off by default (the engine then answers as fast as it always did):
concurrent slots with a FIFO queue behind them (``vllm:num_requests_running`` and
``vllm:num_requests_waiting``), prefill time proportional to the prompt tokens the prefix
cache does not hold, a KV pull's time per prompt block the consumer's prefix cache does not
hold, decode streams slowed while the same engine computes prompts (prefill interference:
why one disaggregates at all), decode steps that lengthen with the streams decoding at once
(a bigger batch reads more KV per step), and a per-engine ``slowdown`` on every modelled
compute time (prefill and the delay between generated tokens; a KV transfer is the link's
speed and is not scaled). The engine does the waiting; this module only decides how long.

Tokenisation is the fake engine's usual one (``generation.prompt_of``, and the ids
``/tokenize`` answers): a token per whitespace-separated word of the prompt (a word's id is
its CRC-32 modulo a 32000-word vocabulary, as ``generation.prompt_ids``), a list of token
ids as given, and for chat the rendered messages, each four framing tokens (its role)
followed by its content's words. Prompt blocks are vLLM's 16 tokens; a block's hash chains
the hash of the block before it, so a block matches only under the same whole prefix, as in
vLLM's prefix caching; a prompt computed under a LoRA adapter chains from the adapter's own
root, so adapters and the base model never share a block. Only full blocks are cached, and a
hit never covers the last prompt token (vLLM recomputes it to get the first output's logits).
The cache is an LRU of block hashes: after a prompt is computed its blocks are touched from
the last to the first, so the oldest prompt's tail is evicted first and its head last, as
vLLM's free-block queue does.

Every role has the cache. A consumer caches a prompt it pulled (the blocks are then in its
KV cache as if computed) and, after a generation that ran to its end, the prompt followed
by the reply (``reply_tokens``): vLLM keeps the output's blocks too, so the next turn of a
chat (its messages, the assistant's reply as the client read it, a new message) hits the
cache through the reply. A pull moves only the blocks the consumer does not already hold,
as vLLM's NIXL connector loads only what is not computed locally; ``KV_BYTES_PER_BLOCK``
turns blocks into the bytes ``vllm:nixl_bytes_transferred`` reports.
Blocks are hashed with Python's ``hash`` of int tuples, which does not depend on
``PYTHONHASHSEED``.
"""

from __future__ import annotations

import argparse
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

BLOCK_TOKENS = 16  # vLLM's default block size
# A nominal block's KV in bytes, only for vllm:nixl_bytes_transferred: an 8B model in bf16
# shaped like Llama-3-8B (32 layers x K and V x 8 KV heads x 128 dims x 2 bytes: 128 KiB a
# token), 16 tokens a block: 2 MiB. Benches compare it with real engines' bytes, so it is a
# plausible size rather than the fake's (which moves no KV at all).
KV_BYTES_PER_BLOCK = BLOCK_TOKENS * 32 * 2 * 8 * 128 * 2
_ROOT = 0x9E3779B97F4A7C15  # the parent hash of the first block


VOCAB_SIZE = 32000  # a word's id is its CRC-32 modulo this (``generation.prompt_ids``)
CHAT_FRAMING = ("<|start|>", "<|sep|>", "<|end_header|>")  # token strings of ids 1, 2, 3


def _word_id(word: str) -> int:
    return zlib.crc32(word.encode("utf-8", "surrogatepass")) % VOCAB_SIZE


def prompt_tokens(body: dict[str, Any], chat: bool) -> list[int]:
    """The prompt's token ids, as many as ``generation.prompt_of`` counts (see above)."""
    if chat:
        out: list[int] = []
        for message in body.get("messages") or []:
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            marker = _word_id(f"<|{role}|>")
            out += (1, marker, 2, 3)  # start, role, separator, end of the header
            out += map(_word_id, str(content or "").split())
        return out
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return list(prompt)
        prompt = " ".join(map(str, prompt))
    return list(map(_word_id, str(prompt).split())) or [0]


def token_strs(body: dict[str, Any], chat: bool) -> list[str]:
    """``prompt_tokens``' tokens as text (``/tokenize`` with ``return_token_strs``): the
    words, and for chat each message's framing before its words; a prompt of ids has none
    (empty strings), nor has the empty prompt's one token."""
    if chat:
        out: list[str] = []
        for message in body.get("messages") or []:
            role = message.get("role") if isinstance(message, dict) else None
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            start, separator, end = CHAT_FRAMING
            out += (start, f"<|{role}|>", separator, end, *str(content or "").split())
        return out
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return [""] * len(prompt)
        prompt = " ".join(map(str, prompt))
    return str(prompt).split() or [""]


def reply_tokens(body: dict[str, Any], chat: bool, prompt_text: str, reply: str) -> list[int]:
    """The tokens a finished generation leaves in the cache: the prompt, then ``reply`` (the
    text the client read), tokenised as the client's next request will be. Chat: the
    messages and an assistant message whose content is the reply (its header is the
    generation prompt). Completions: the prompt text (``prompt_text``, one prompt of the
    request) followed by the reply, so a word the reply continues is one token, as when the
    client sends both back; a prompt of token ids keeps its ids, the reply's words follow."""
    if chat:
        turn = {"role": "assistant", "content": reply}
        return prompt_tokens({"messages": [*(body.get("messages") or []), turn]}, True)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [*prompt, *map(_word_id, reply.split())]
    return prompt_tokens({"prompt": prompt_text + reply}, False)


def prompt_blocks(prompt_tokens: int) -> int:
    """The blocks a descriptor names for a prompt: a partly filled last block counts, and a
    producer holds at least one (``KVStore.issue``)."""
    return max(1, -(-prompt_tokens // BLOCK_TOKENS))


def block_hashes(
    tokens: Sequence[int], limit: int | None = None, *, lora: str | None = None
) -> list[int]:
    """The chained hashes of the full 16-token blocks among the first ``limit`` tokens;
    under a LoRA adapter the chain starts from a root of its own (``lora_root``), so no
    block computed under it matches one of the base model or of another adapter."""
    count = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
    out: list[int] = []
    parent = _ROOT if lora is None else lora_root(lora)
    for start in range(0, count - count % BLOCK_TOKENS, BLOCK_TOKENS):
        parent = hash((parent, *tokens[start : start + BLOCK_TOKENS]))
        out.append(parent)
    return out


def lora_root(lora: str) -> int:
    """The parent hash of an adapter's first block: its name's CRC-32 mixed into the root
    (vLLM mixes the adapter into its block hashes as an extra key)."""
    return hash((_ROOT, zlib.crc32(lora.encode("utf-8", "surrogatepass"))))


class Inserted(NamedTuple):
    """What one ``PrefixCache.insert`` changed: the prompt's full blocks' hashes, the
    indices (in order) of those that were not held before, and the hashes evicted."""

    hashes: list[int]
    new: list[int]
    evicted: list[int]


class PrefixCache:
    """An LRU of prompt-block hashes with a capacity in blocks (0: no cache). Counts as
    vLLM does: ``queries`` and ``hits`` in prompt tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def lookup(self, tokens: Sequence[int], lora: str | None = None) -> int:
        """How many leading prompt tokens are cached (whole blocks, never the last token);
        counted in ``queries`` and ``hits``. Looking up touches nothing. ``lora``: the
        adapter the prompt is computed under (None: the base model), as for every method."""
        return self.probe(tokens, lora)[0]

    def probe(self, tokens: Sequence[int], lora: str | None = None) -> tuple[int, int]:
        """``lookup``'s hit, and how many leading full blocks the cache holds: all of them
        when the prompt fills its last block and every block is cached. The hit leaves the
        last token to compute (its logits); a KV pull needs only the blocks not held."""
        if not self.enabled:
            return 0, 0
        held = 0
        for block in block_hashes(tokens, lora=lora):
            if block not in self.blocks:
                break
            held += 1
        hit = min(held, (len(tokens) - 1) // BLOCK_TOKENS) if tokens else 0
        self.queries += len(tokens)
        self.hits += hit * BLOCK_TOKENS
        return hit * BLOCK_TOKENS, held

    def insert(self, tokens: Sequence[int], lora: str | None = None) -> Inserted:
        """The prompt has been computed: its full blocks become the most recently used, the
        first block last, and the least recently used blocks beyond capacity are evicted
        (this prompt's own tail among them when it is longer than the cache). Returns what
        changed, for the engine's KV events."""
        if not self.enabled:
            return Inserted([], [], [])
        hashes = block_hashes(tokens, lora=lora)
        new = [i for i, block in enumerate(hashes) if block not in self.blocks]
        for block in reversed(hashes):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        evicted = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
            self.evictions += 1
        return Inserted(hashes, new, evicted)

    def clear(self) -> int:
        """Drop every block (vLLM's ``/reset_prefix_cache``); how many there were."""
        held = len(self.blocks)
        self.blocks.clear()
        return held


def prefill_seconds(
    uncached_tokens: int, ms_per_token: float, s_per_token: float, slowdown: float
) -> float:
    """Time to compute ``uncached_tokens`` prompt tokens (``--prefill-ms-per-token`` and the
    older ``--prefill-delay-per-token-s`` add up), times the engine's slowdown."""
    return uncached_tokens * (ms_per_token / 1000 + s_per_token) * slowdown


def pull_seconds(blocks: int, fixed_s: float, ms_per_block: float) -> float:
    """Time to pull ``blocks`` KV blocks: the fixed ``transfer_delay_s`` (the handshake and
    the producer's notification, paid even when nothing moves) plus ``--kv-ms-per-block``
    for each block moved. The link's speed: no slowdown."""
    return fixed_s + blocks * ms_per_block / 1000


def interfered_itl(itl_s: float, interference: float, computing: int) -> float:
    """The delay before a decode stream's next token while ``computing`` prompts are being
    computed on the same engine: prefill steps share the batch with decode steps, so each
    one stretches every running stream's steps (``--prefill-interference``)."""
    return itl_s * (1 + interference * computing)


def batched_itl(itl_s: float, growth: float, decoding: int) -> float:
    """The delay before a decode stream's next token while ``decoding`` streams (this one
    among them) are decoding on the same engine: a decode step reads every running
    stream's KV, so it lengthens with the batch (``--decode-batch-growth``); a stream alone
    keeps ``itl_s``."""
    return itl_s * (1 + growth * max(0, decoding - 1))


# ---- the command line (``narwhal fake-engine``) ----------------------------------------------


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cost model's options; every default is off (today's instant engine)."""
    parser.add_argument(
        "--slots",
        type=_count,
        default=0,
        help="requests computed at once, the rest wait in a FIFO queue (0: unlimited)",
    )
    parser.add_argument(
        "--prefill-slots",
        type=_count,
        default=0,
        help="of the requests computed at once, how many compute their prompt at once; the "
        "rest wait for one (FIFO, counted as waiting) while the others decode (0: no limit "
        "of its own)",
    )
    parser.add_argument(
        "--kv-blocks",
        type=_positive_count,
        default=4096,
        help="the KV cache in 16-token blocks, the denominator of vllm:kv_cache_usage_perc",
    )
    parser.add_argument(
        "--prefill-ms-per-token",
        type=non_negative,
        default=0.0,
        help="prefill time per prompt token the prefix cache does not hold, in ms",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=_count,
        default=0,
        help="prefix cache (LRU) capacity in 16-token prompt blocks (0: no cache)",
    )
    parser.add_argument(
        "--kv-ms-per-block",
        type=non_negative,
        default=0.0,
        help="KV pull time per 16-token prompt block the consumer's prefix cache does not "
        "hold, in ms (the link's speed: not scaled by --slowdown)",
    )
    parser.add_argument(
        "--kv-pull-ms",
        type=non_negative,
        default=0.0,
        help="the fixed cost of every KV pull, in ms: vLLM's consumer waits for the load "
        "in WAITING_FOR_REMOTE_KVS and schedules the request at its next step, so a remote "
        "prefill costs the consumer about one step more than a local one",
    )
    parser.add_argument(
        "--prefill-interference",
        type=non_negative,
        default=0.0,
        help="while prompts are computed here, each running stream's delay between tokens "
        "is multiplied by 1 + this x the prompts being computed (0: no interference)",
    )
    parser.add_argument(
        "--decode-batch-growth",
        type=non_negative,
        default=0.0,
        help="each stream's delay between tokens is multiplied by 1 + this x the other "
        "streams decoding on the engine at once (0: the batch does not matter)",
    )
    parser.add_argument(
        "--slowdown",
        type=_positive,
        default=1.0,
        help="multiplier on every modelled compute time (2: a 2x slower engine)",
    )


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``FakeEngineConfig`` fields the options above set."""
    return {
        "slots": args.slots,
        "prefill_slots": args.prefill_slots,
        "kv_blocks": args.kv_blocks,
        "prefill_ms_per_token": args.prefill_ms_per_token,
        "prefix_cache_blocks": args.prefix_cache_blocks,
        "kv_ms_per_block": args.kv_ms_per_block,
        "transfer_delay_s": args.kv_pull_ms / 1000,
        "prefill_interference": args.prefill_interference,
        "decode_batch_growth": args.decode_batch_growth,
        "slowdown": args.slowdown,
    }
