"""The choices the fake engine generates for an ``Ask`` (``samples``): each one's tokens, the
part of it each token's chunk carries, its text and why it finished; a JSON schema or a
forced tool call filled with the model's words, text cut at a stop string.

Determinism, as vLLM at temperature 0 or with a seed: a sample is a pure function of its
prompt's token ids (``Prompt.ids``) and of its key (``Ask.key``): none when greedy,
``seed + j`` for the ``j``-th of ``n`` seeded samples (what the router's fan-out asks of its
``j``-th sub-request), ``j`` for unseeded sampling. So a prompt decoded after a KV handoff
yields what it yields locally, sample ``j`` of ``n`` is the single sample seeded
``seed + j``, and a continuation (``generation.script``) goes on with the same key. Under a
LoRA adapter the key mixes in the adapter's name: the adapter says something else than the
base model, as deterministically.
"""

from __future__ import annotations

import json
import re
import secrets
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.asks import Ask, Prompt, Tool

_PIECES = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")  # a string's "tokens": words, punctuation runs


@dataclass(frozen=True, slots=True)
class Token:
    id: int
    text: str


def vocab_token(index: int) -> Token:
    """A generated word; its id is what ``Shapes.token_chunk`` reports as ``token_ids``."""
    return Token(index + gen.GENERATED_ID, gen.VOCAB[index])


def piece_token(text: str) -> Token:
    return Token(1000 + zlib.crc32(text.encode("utf-8", "surrogatepass")) % 30000, text)


def pieces(text: str) -> list[str]:
    return _PIECES.findall(text)


@dataclass(slots=True)
class Sample:
    """One choice: its tokens, what each token's chunk carries when streamed (completions:
    its text; chat: its delta, or None for a token that sends no chunk), and the
    non-streamed text (or content)."""

    index: int
    prompt: Prompt
    tokens: list[Token]
    parts: list[Any]
    text: str
    finish_reason: str
    stop_reason: str | None = None


def samples(ask: Ask) -> list[Sample]:
    """Every choice, prompt-major then ``n`` (vLLM's and OpenAI's index order)."""
    out = []
    for p, prompt in enumerate(ask.prompts):
        for j in range(ask.n):
            out.append(sample(ask, prompt, ask.key(j), p * ask.n + j))
    return out


def _words(prompt: Prompt, key: int | None) -> Iterator[str]:
    script = gen.script(prompt.ids, key)
    while True:  # an endless supply, deterministic
        yield from (gen.VOCAB[i].strip() for i in script.take(8))


def fill(schema: Any, words: Iterator[str]) -> Any:
    """A value the JSON schema accepts, made of the model's words."""
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        items = properties.items() if isinstance(properties, dict) else ()
        return {name: fill(sub, words) for name, sub in items}
    if kind == "array":
        return [fill(schema.get("items"), words)]
    if kind == "string":
        return next(words)
    if kind == "integer":
        return len(next(words))
    if kind == "number":
        return len(next(words)) / 2
    if kind == "boolean":
        return len(next(words)) % 2 == 0
    return None


def sample(ask: Ask, prompt: Prompt, key: int | None, index: int) -> Sample:
    if ask.tool is not None:
        return _tool_sample(ask, ask.tool, prompt, key, index)
    if ask.schema is not None:
        text = json.dumps(fill(ask.schema, _words(prompt, key)))
        tokens = [piece_token(p) for p in pieces(text)]
        ended = len(tokens) <= ask.max_tokens  # the JSON is whole: the model stops (EOS)
        return _text_sample(ask, prompt, tokens[: ask.max_tokens], index, ended)
    ids = gen.reply_ids(prompt.ids, ask.max_tokens, key, unlimited=ask.unlimited)
    return _text_sample(ask, prompt, [vocab_token(i) for i in ids], index, False)


def _text_sample(ask: Ask, prompt: Prompt, tokens: list[Token], index: int, ended: bool) -> Sample:
    """Text, cut at the first stop string as vLLM cuts it: the stop strings are tried in
    the request's order, the text ends before the one found, and a stream holds back what
    could still begin one."""
    text, emitted, parts = "", 0, []
    hold = max((len(s) for s in ask.stop), default=1) - 1
    finish, stop_reason = ("stop" if ended else "length"), None
    for i, token in enumerate(tokens):
        text += token.text
        for stop in ask.stop:
            found = text.find(stop, max(0, len(text) - len(token.text) - len(stop) + 1))
            if found >= 0:
                text, finish, stop_reason = text[:found], "stop", stop
                break
        last = stop_reason is not None or i == len(tokens) - 1
        upto = len(text) if last else max(emitted, len(text) - hold)
        parts.append({"content": text[emitted:upto]} if ask.chat else text[emitted:upto])
        emitted = upto
        if stop_reason is not None:
            tokens = tokens[: i + 1]
            break
    return Sample(index, prompt, tokens, parts, text, finish, stop_reason)


def _tool_sample(ask: Ask, tool: Tool, prompt: Prompt, key: int | None, index: int) -> Sample:
    """A forced call, as vLLM 0.32 answers it (tests/captures/shapes/chat_named_tool.*):
    streamed, the call's name in the first token's chunk, then its arguments piece by
    piece, then nothing until the last token; not streamed, the model's raw hermes text
    (``<tool_call>`` blocks, cut where the tokens end) as the content."""
    arguments = fill(tool.parameters, _words(prompt, key))
    call = "<tool_call>\n" + json.dumps({"name": tool.name, "arguments": arguments})
    raw = pieces(call + "\n</tool_call>")
    count = ask.max_tokens
    tokens = [piece_token(raw[i % len(raw)]) for i in range(count)]
    header = {
        "id": "chatcmpl-tool-" + secrets.token_hex(8),
        "type": "function",
        "index": 0,
        "function": {"name": tool.name},
    }
    parts: list[Any] = [{"content": None, "tool_calls": [header]}]
    for piece in pieces(json.dumps(arguments)):
        delta = {"index": 0, "function": {"arguments": piece}}
        parts.append({"content": None, "tool_calls": [delta]})
    parts = (parts + [None] * count)[:count]
    return Sample(index, prompt, tokens, parts, "".join(t.text for t in tokens), "length")
