"""A request's token ids as its engines' tokenizer gives them, pure: the ``/tokenize`` body
that asks for them, its answer read, and a bounded cache of the answers.

The precise prefix index matches a request by its token ids, so they must be the engine's
own: ``POST /tokenize`` renders a chat with the engine's template exactly as
``/v1/chat/completions`` does (the fields that change the rendering travel with it), and a
completion prompt with the same special tokens. A prompt given as token ids is its own
answer, and needs no call.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

# the chat fields that change what the template renders (vLLM's /tokenize takes them all)
CHAT_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
)
COMPLETION_FIELDS = ("prompt", "add_special_tokens")
MAX_CACHED = 1024  # prompts whose ids are kept
MAX_CACHED_IDS = 1 << 21  # ... and at most this many ids in all (8 MiB of ints, about)
_answer = msgspec.json.Decoder(dict[str, Any])


def given_ids(body: Mapping[str, Any], *, chat: bool) -> list[int] | None:
    """A completion prompt of token ids: its ids, no call needed (else None)."""
    prompt = None if chat else body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def tokenize_body(raw: Mapping[str, Any], model: str, *, chat: bool) -> dict[str, Any]:
    """The ``/tokenize`` body for a request whose fields are ``raw`` (the JSON that came,
    spliced as it is): its prompt or messages and what renders them, under ``model``."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    out: dict[str, Any] = {"model": model}
    for key in fields:
        if key in raw:
            out[key] = raw[key]
    return out


def read_tokens(data: bytes) -> list[int] | None:
    """The ids of a ``/tokenize`` answer (``{"count", "max_model_len", "tokens"}``); None
    when the answer has no list of non-negative ints."""
    try:
        answer = _answer.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        return None
    return tokens


class IdsCache:
    """The ids of recent prompts, by the bytes that asked for them (LRU, bounded in
    prompts and in ids): a prompt sent again (a retry, a popular system prompt with the
    same question, a benchmark) costs no call."""

    __slots__ = ("_entries", "_ids", "hits", "misses")

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, Sequence[int]] = OrderedDict()
        self._ids = 0
        self.hits = self.misses = 0

    def get(self, key: bytes) -> Sequence[int] | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        if len(ids) > MAX_CACHED_IDS // 4:  # one huge prompt would push out all the rest
            return
        old = self._entries.pop(key, None)
        self._ids += len(ids) - (0 if old is None else len(old))
        self._entries[key] = ids
        while len(self._entries) > MAX_CACHED or self._ids > MAX_CACHED_IDS:
            _, gone = self._entries.popitem(last=False)
            self._ids -= len(gone)
