"""The approximate prefix index (contract 4.4), pure: what the router believes each engine caches.

Per engine, the fixed-size blocks of what the router sent there and what came back: a
producer holds a prompt's blocks, a consumer the prompt's and its generated output's (vLLM
caches both). Text is cut into ``BLOCK_BYTES`` of UTF-8 (about vLLM's 16-token block at 4
bytes a token), token-id prompts into ``BLOCK_TOKENS`` ids. A block counts only under the
same whole prefix, as in vLLM's prefix caching. Chat is a canonical serialization of the
messages in order (``chat_text``), after the tools the request offers (a chat template
renders them first) and with every part of a message a template renders (text, tool
calls, images and audio as their JSON: their bytes weigh in the estimate): the next turn
of a conversation (its messages, the assistant's reply, a new message) starts with the
previous turn's text and its reply. Only the first ``MAX_PROMPT_BLOCKS`` of a prompt are
indexed: beyond a model's context nothing is cached; the estimate still counts the whole
prompt.

Nothing here is exact, it is the router's belief: entries expire after ``ttl_s``, and each
engine's index is an LRU of at most ``max_blocks`` blocks (the oldest first, and within one
text its tail before its head, as vLLM's free-block queue evicts). The store is
``narwhal.core.prefix_tree``: the blocks an engine holds of all prompts form a tree, and a
prompt's blocks (``Blocks``) are its bytes, never hashed block by block. Memory:
``bench/prefix_index_memory.py``, figures in ``bench/results/``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from narwhal.core.prefix_tree import MAX_BLOCKS, Blocks, PrefixIndex

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_TOKENS",
    "MAX_BLOCKS",
    "MAX_PROMPT_BLOCKS",
    "Blocks",
    "PrefixIndex",
    "Prompt",
    "chat_text",
    "prompt_of",
    "reply_text",
    "text_blocks",
    "token_blocks",
]

BLOCK_BYTES = 64  # a text block: about vLLM's 16-token block
BLOCK_TOKENS = 16  # a token-id block: vLLM's default block size
BYTES_PER_TOKEN = 4  # the estimate of a text's tokens (contract 4.4)
MAX_PROMPT_BLOCKS = 8192  # per prompt: 512 KiB of text, about 128k tokens
_TEXT_ROOT = 0x5BD1E995  # the root of a text's blocks
_TOKEN_ROOT = 0x27D4EB2F  # ... of a token-id prompt's: never equal to a text's
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the index knows of one request's prompt: its blocks and its estimated tokens,
    and for a text what ``followed_by`` needs to go on after it."""

    blocks: Blocks
    tokens: int  # token-id prompts exactly; text as UTF-8 bytes / 4
    tail: bytes | None = None  # a text's bytes after its last full block (None: ids)

    def uncached(self, matched_blocks: int) -> int:
        """The tokens left to compute when an engine holds ``matched_blocks`` of it."""
        return max(0, self.tokens - matched_blocks * BLOCK_TOKENS)

    def followed_by(self, text: str) -> Prompt:
        """This text with ``text`` after it (a reply)."""
        data = self.blocks.data
        if (
            self.tail is None
            or not isinstance(data, bytes)
            or len(self.blocks) >= MAX_PROMPT_BLOCKS
        ):
            return self
        added = text.encode("utf-8", "surrogatepass")
        blocks, tail = _cut(data + self.tail + added, self.blocks.root)
        tokens = self.tokens + -(-len(added) // BYTES_PER_TOKEN)
        return Prompt(blocks, tokens, tail)


def _cut(data: bytes, root: int) -> tuple[Blocks, bytes]:
    """The full blocks of ``data`` (at most ``MAX_PROMPT_BLOCKS``), and the bytes after
    them."""
    end = min(len(data) // BLOCK_BYTES, MAX_PROMPT_BLOCKS) * BLOCK_BYTES
    return Blocks(root, BLOCK_BYTES, data[:end]), data[end:]


def text_blocks(data: bytes, root: int = _TEXT_ROOT) -> Blocks:
    """The full ``BLOCK_BYTES`` blocks of ``data``."""
    return _cut(data, root)[0]


def token_blocks(ids: Sequence[int], root: int = _TOKEN_ROOT) -> Blocks:
    """The full ``BLOCK_TOKENS`` blocks of a token-id prompt."""
    full = min(len(ids) // BLOCK_TOKENS, MAX_PROMPT_BLOCKS)
    return Blocks(root, BLOCK_TOKENS, tuple(ids[: full * BLOCK_TOKENS]))


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
    """A request's prompt as the index sees it; under a LoRA adapter its blocks are under a
    root of the adapter's own, so they never match another's (or the base's)."""
    text_root, token_root = _TEXT_ROOT, _TOKEN_ROOT
    if adapter is not None:
        text_root, token_root = hash((_TEXT_ROOT, adapter)), hash((_TOKEN_ROOT, adapter))
    if chat:
        messages = body.get("messages")
        listed = messages if isinstance(messages, list) else ()
        return _text(chat_text(listed, body.get("tools")), text_root)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return Prompt(token_blocks(prompt, token_root), len(prompt), None)
    if isinstance(prompt, list):  # several prompts (a fan-out's parent): the first keys it
        prompt = prompt[0] if prompt else ""
    return _text(str(prompt or ""), text_root)


def _text(text: str, root: int = _TEXT_ROOT) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    blocks, tail = _cut(data, root)
    return Prompt(blocks, -(-len(data) // BYTES_PER_TOKEN), tail)
