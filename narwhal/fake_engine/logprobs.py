"""The fake engine's logprobs: each token's, its likeliest alternatives, chat's entries,
completions' four parallel lists, and an echoed prompt's entries; deterministic, as the
tokens are.
"""

from __future__ import annotations

from typing import Any

from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.asks import Prompt
from narwhal.fake_engine.samples import Token, vocab_token


def logprob(token: Token, position: int) -> float:
    return -round(0.05 + (token.id * 31 + position * 7) % 97 / 25, 4)


def alternatives(token: Token, position: int, k: int) -> list[tuple[Token, float]]:
    """The ``k`` likeliest tokens at a position: the sampled one first (rank 1), then other
    words of the vocabulary, each less likely."""
    best = logprob(token, position)
    out = [(token, best)]
    start = token.id % len(gen.VOCAB)
    for r in range(1, len(gen.VOCAB) + 1):
        if len(out) >= k:
            break
        other = vocab_token((start + r) % len(gen.VOCAB))
        if other.text != token.text:
            out.append((other, round(best - 0.5 * len(out), 4)))
    return out


def chat_entry(token: Token, position: int, k: int) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": logprob(token, position),
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": lp, "bytes": list(t.text.encode())}
            for t, lp in alternatives(token, position, k)[:k]
        ],
    }


class CompletionLogprobs:
    """Completions' four parallel lists, offsets counted from the start of the text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.lists: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }

    def add(self, text: str, lp: float | None, top: dict[str, float] | None) -> None:
        lists = self.lists
        lists["text_offset"].append(self.offset)
        lists["token_logprobs"].append(lp)
        lists["tokens"].append(text)
        lists["top_logprobs"].append(top)
        self.offset += len(text)

    def add_token(self, token: Token, position: int, k: int) -> None:
        top = {t.text: lp for t, lp in alternatives(token, position, max(k, 1))}
        self.add(token.text, logprob(token, position), top)

    def take(self) -> dict[str, list[Any]]:
        """What was added since the last take."""
        out = self.lists
        self.lists = {key: [] for key in out}
        return out


def echo_prompt(prompt: Prompt, lists: CompletionLogprobs, k: int) -> None:
    """The echoed prompt's entries: the first token has no logprob (nothing before it);
    each other is the prompt token's entry of ``prompt_logprobs`` with its alternatives."""
    entries = gen.prompt_logprobs(prompt.text, k)
    for text, entry in zip(gen.prompt_pieces(prompt.text), entries, strict=True):
        if entry is None:
            lists.add(text, None, None)
            continue
        own = next(iter(entry.values()))
        top = {e["decoded_token"]: e["logprob"] for e in list(entry.values())[: k + 1]}
        lists.add(text, own["logprob"], top)
