"""The approximate prefix index (contract 4.4), pure: what the router believes each engine caches.

Per engine, the chained hashes of the fixed-size blocks of what the router sent there and
what came back: a producer holds a prompt's blocks, a consumer the prompt's and its
generated output's (vLLM caches both). Text is cut into ``BLOCK_BYTES`` of UTF-8 (about
vLLM's 16-token block at 4 bytes a token), token-id prompts into ``BLOCK_TOKENS`` ids. A
block's hash chains the hash of the block before it, so a block matches only under the
same whole prefix, as in vLLM's prefix caching. Chat is a canonical serialization of the
messages in order (``chat_text``), after the tools the request offers (a chat template
renders them first) and with every part of a message a template renders (text, tool
calls, images and audio as their JSON: their bytes weigh in the estimate): the next turn
of a conversation (its messages, the assistant's reply, a new message) starts with the
previous turn's text and its reply. Only the first ``MAX_PROMPT_BLOCKS`` of a prompt are
hashed: beyond a model's context nothing is cached, and a 4 MiB body would cost the event
loop tens of milliseconds; the estimate still counts the whole prompt.

Nothing here is exact, it is the router's belief: entries expire after ``ttl_s``, and each
engine's index is an LRU of at most ``max_blocks`` blocks (the oldest first, and within one
text its tail before its head, as vLLM's free-block queue evicts). Because a text's blocks
are recorded together, its head last (the most recent), the blocks an engine holds of any
prompt are always a leading run: a match is found by bisection. Hashes are Python's
``hash`` of (parent, block): per process, which is all the index needs (each worker keeps
its own belief). Memory: ``bench/prefix_index_memory.py``, figures in ``bench/results/``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

BLOCK_BYTES = 64  # a text block: about vLLM's 16-token block
BLOCK_TOKENS = 16  # a token-id block: vLLM's default block size
BYTES_PER_TOKEN = 4  # the estimate of a text's tokens (contract 4.4)
MAX_BLOCKS = 65536  # per engine: 4 MiB of text, about a million tokens of KV
MAX_PROMPT_BLOCKS = 8192  # per prompt: 512 KiB of text, about 128k tokens
_TEXT_ROOT = 0x5BD1E995  # the parent of a text's first block
_TOKEN_ROOT = 0x27D4EB2F  # ... of a token-id prompt's: never equal to a text's chain
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the index knows of one request's prompt: its blocks and its estimated tokens,
    and for a text what ``followed_by`` needs to go on hashing after it."""

    blocks: tuple[int, ...]
    tokens: int  # token-id prompts exactly; text as UTF-8 bytes / 4
    tail: bytes | None = None  # a text's bytes after its last full block (None: ids)
    root: int = _TEXT_ROOT  # the parent of its first block: a LoRA adapter's own chain

    def uncached(self, matched_blocks: int) -> int:
        """The tokens left to compute when an engine holds ``matched_blocks`` of it."""
        return max(0, self.tokens - matched_blocks * BLOCK_TOKENS)

    def followed_by(self, text: str) -> Prompt:
        """This text with ``text`` after it (a reply), hashing only the new blocks."""
        if self.tail is None or len(self.blocks) >= MAX_PROMPT_BLOCKS:
            return self
        parent = self.blocks[-1] if self.blocks else self.root
        added = text.encode("utf-8", "surrogatepass")
        blocks, tail = _chain(self.tail + added, parent, MAX_PROMPT_BLOCKS - len(self.blocks))
        tokens = self.tokens + -(-len(added) // BYTES_PER_TOKEN)
        return Prompt(self.blocks + blocks, tokens, tail, self.root)


def _chain(data: bytes, parent: int, limit: int) -> tuple[tuple[int, ...], bytes]:
    """The chained hashes of the full blocks of ``data`` after ``parent`` (at most
    ``limit``), and the bytes left after the last full block."""
    full = min(len(data) // BLOCK_BYTES, limit)
    out = []
    for start in range(0, full * BLOCK_BYTES, BLOCK_BYTES):
        parent = hash((parent, data[start : start + BLOCK_BYTES]))
        out.append(parent)
    return tuple(out), data[full * BLOCK_BYTES :]


def text_blocks(data: bytes) -> tuple[int, ...]:
    """The chained hashes of the full ``BLOCK_BYTES`` blocks of ``data``."""
    return _chain(data, _TEXT_ROOT, MAX_PROMPT_BLOCKS)[0]


def token_blocks(ids: Sequence[int], root: int = _TOKEN_ROOT) -> tuple[int, ...]:
    """The chained hashes of the full ``BLOCK_TOKENS`` blocks of a token-id prompt."""
    out = []
    parent = root
    full = min(len(ids) // BLOCK_TOKENS, MAX_PROMPT_BLOCKS)
    for start in range(0, full * BLOCK_TOKENS, BLOCK_TOKENS):
        parent = hash((parent, *ids[start : start + BLOCK_TOKENS]))
        out.append(parent)
    return tuple(out)


def _json(value: Any) -> str:
    try:
        return _encode(value).decode("utf-8", "surrogatepass")
    except (TypeError, ValueError, OverflowError):  # not JSON: its text, for the estimate
        return str(value)


def _content(content: Any) -> str:
    """What a template renders of a message's content: text as it is, other parts (an
    image, audio) as their JSON, whose bytes the estimate counts."""
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) if isinstance(p, dict) and p.get("type") == "text" else _json(p)
            for p in content
        )
    return "" if content is None else str(content)


def _message(role: str, content: str) -> str:
    # record and unit separators: a role or text can hardly make another message's shape
    return f"\x1e{role}\x1f{content}"


def _rendered(message: dict[str, Any]) -> str:
    text = _message(str(message.get("role", "")), _content(message.get("content")))
    calls = message.get("tool_calls")
    return text if calls is None else text + _json(calls)


def chat_text(messages: Iterable[Any], tools: Any = None) -> str:
    """The canonical serialization of a chat request: its tools, then its messages; a
    conversation's next turn starts with this text and its reply (``reply_text``)."""
    head = "" if tools is None else "\x1etools\x1f" + _json(tools)
    return head + "".join(_rendered(m) for m in messages if isinstance(m, dict))


def reply_text(reply: str, *, chat: bool) -> str:
    """What follows a prompt's text once ``reply`` was generated for it."""
    return _message("assistant", reply) if chat else reply


def prompt_of(body: Mapping[str, Any], *, chat: bool, adapter: str | None = None) -> Prompt:
    """A request's prompt as the index sees it; under a LoRA adapter its blocks chain
    from a root of the adapter's own, so they never match another's (or the base's)."""
    text_root, token_root = _TEXT_ROOT, _TOKEN_ROOT
    if adapter is not None:
        text_root, token_root = hash((_TEXT_ROOT, adapter)), hash((_TOKEN_ROOT, adapter))
    if chat:
        messages = body.get("messages")
        listed = messages if isinstance(messages, list) else ()
        return _text(chat_text(listed, body.get("tools")), text_root)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return Prompt(token_blocks(prompt, token_root), len(prompt), None, text_root)
    if isinstance(prompt, list):  # several prompts (a fan-out's parent): the first keys it
        prompt = prompt[0] if prompt else ""
    return _text(str(prompt or ""), text_root)


def _text(text: str, root: int = _TEXT_ROOT) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    blocks, tail = _chain(data, root, MAX_PROMPT_BLOCKS)
    return Prompt(blocks, -(-len(data) // BYTES_PER_TOKEN), tail, root)


class PrefixIndex:
    """Per engine, an LRU of block hashes with the time each was last recorded."""

    def __init__(self, ttl_s: float, max_blocks: int = MAX_BLOCKS) -> None:
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._engines: dict[str, OrderedDict[int, float]] = {}

    def record(self, engine_id: str, blocks: Sequence[int], now: float) -> None:
        """``engine_id`` computed (or received) these blocks now: its tail is touched first,
        its head last, so the head is evicted last."""
        if not blocks:
            return
        lru = self._engines.setdefault(engine_id, OrderedDict())
        for block in reversed(blocks):
            lru[block] = now
            lru.move_to_end(block)
        self._expire(lru, now)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)

    def match(self, engine_id: str, blocks: Sequence[int], now: float) -> int:
        """How many leading blocks of ``blocks`` the engine is believed to hold."""
        lru = self._engines.get(engine_id)
        if not lru or not blocks:
            return 0
        oldest = now - self.ttl_s
        lo, hi = 0, len(blocks)  # blocks[:lo] held; blocks[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            at = lru.get(blocks[mid - 1])
            if at is not None and at > oldest:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def recorded_at(self, engine_id: str, blocks: Sequence[int], held: int) -> float:
        """When the last of the ``held`` leading blocks was recorded for ``engine_id``: of
        two engines holding as much, the one that served the text last holds more of it
        (what it generated beyond the last full block, a turn's reply)."""
        lru = self._engines.get(engine_id)
        at = lru.get(blocks[held - 1]) if lru and held else None
        return -math.inf if at is None else at

    def forget(self, engine_id: str) -> None:
        """The engine left, or restarted: whatever it cached is gone."""
        self._engines.pop(engine_id, None)

    def keep_only(self, engine_ids: Iterable[str]) -> None:
        """Drop the index of every engine not among ``engine_ids`` (a reload removed it)."""
        keep = set(engine_ids)
        for gone in [e for e in self._engines if e not in keep]:
            del self._engines[gone]

    def size(self, engine_id: str) -> int:
        """Blocks held for ``engine_id``, expired ones not yet dropped included."""
        return len(self._engines.get(engine_id, ()))

    def _expire(self, lru: OrderedDict[int, float], now: float) -> None:
        oldest = now - self.ttl_s
        while lru:
            block, at = next(iter(lru.items()))
            if at > oldest:
                return
            del lru[block]
