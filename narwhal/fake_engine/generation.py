"""Deterministic fake generation and vLLM 0.32's response shapes (from real captures).

Tokens are a seeded function of the prompt text alone (and of the request's seed when it
samples), so a prompt decoded after a KV handoff yields exactly what the same prompt yields
served locally, like real vLLM at temperature 0. A plain stream's chunk bytes are assembled
from precomputed pieces: the fake engine runs beside the router during benchmarks and must
stay cheap. The richer shapes (logprobs, echo, stop strings, tool calls, ``n``, ...) and
every non-streamed answer are built in ``answers``.
"""

from __future__ import annotations

import re
import time
import zlib
from typing import Any

import msgspec

VOCAB = (
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " lazy",
    " dog",
    "ward",
    "zip",
    " parameters",
    " once",
    " upon",
    " a",
    " time",
    " in",
    " river",
    " stone",
    " light",
    " and",
    " of",
    " to",
    " narwhal",
    " sea",
    " ice",
    " tusk",
    " deep",
    " cold",
    " blue",
    " swims",
    " north",
    " far",
)
_VOCAB_JSON = tuple(msgspec.json.encode(t) for t in VOCAB)
SYSTEM_FINGERPRINT = "vllm-0.32.0-fake0000"
_encode = msgspec.json.encode


def token_ids(prompt: str, count: int, key: int | None = None) -> list[int]:
    """``count`` token indices into VOCAB, a pure function of the prompt (and of a sample's
    key: its seed, see ``answers.Ask.key``)."""
    x = zlib.crc32(prompt.encode("utf-8", "surrogatepass"))
    if key is not None:
        x = zlib.crc32(b"seed %d" % key, x)
    x = x or 1
    out = []
    for _ in range(count):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((x >> 8) % len(VOCAB))
    return out


def generate(prompt: str, count: int) -> str:
    return "".join(VOCAB[i] for i in token_ids(prompt, count))


def prompt_of(body: dict[str, Any], chat: bool) -> tuple[str, int]:
    """The prompt text and its token count (whitespace words; 4 extra per chat message)."""
    if chat:
        texts, extra = [], 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(str(content or ""))
            extra += 4
        text = "\n".join(texts)
        return text, len(text.split()) + extra
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)
        prompt = " ".join(map(str, prompt))
    text = str(prompt)
    return text, max(1, len(text.split()))


class Shapes:
    """vLLM's JSON for one response (completions or chat), keyed by its id."""

    def __init__(self, resp_id: str, model: str, chat: bool) -> None:
        self.resp_id = resp_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        head = {
            "id": resp_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": model,
        }
        self._head = _encode(head)[:-1] + b',"choices":[{"index":0,'
        if chat:
            self._tok_tail = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}'
            self._last_tail = (
                b',"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}'
            )
        else:
            self._tok_tail = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}'
            )
            self._last_tail = (
                b',"logprobs":null,"finish_reason":"length","stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}'
            )

    def role_chunk(self) -> bytes:
        return self._head + (
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":null,"prompt_text":null}'
        )

    def token_chunk(self, index: int, last: bool, with_ids: bool = False) -> bytes:
        """One token's chunk; ``with_ids`` (the request's ``return_token_ids``) fills in
        ``token_ids`` the way vLLM does instead of null."""
        text = _VOCAB_JSON[index]
        body = b'"delta":{"content":' + text + b"}" if self.chat else b'"text":' + text
        tail = self._last_tail if last else self._tok_tail
        if with_ids:
            tail = tail.replace(b'"token_ids":null', b'"token_ids":[%d]' % (index + 100))
        return self._head + body + tail

    def group_chunk(self, texts: list[int], ids: list[int], last: bool, with_ids: bool) -> bytes:
        """A chunk carrying several tokens (``ids``) and the text of ``texts`` (the tokens
        held back before it and its own), as vLLM sends them when a read finds several
        engine steps done; ``token_ids`` lists the chunk's own tokens."""
        text = _encode("".join(VOCAB[i] for i in texts))
        body = b'"delta":{"content":' + text + b"}" if self.chat else b'"text":' + text
        tail = self._last_tail if last else self._tok_tail
        if with_ids:
            listed = b",".join(b"%d" % (i + 100) for i in ids)
            tail = tail.replace(b'"token_ids":null', b'"token_ids":[' + listed + b"]")
        return self._head + body + tail

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        return _encode(
            {
                "id": self.resp_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
                "system_fingerprint": SYSTEM_FINGERPRINT,
            }
        )


_PROMPT_PIECES = re.compile(r"\s*\S+")


def prompt_pieces(prompt: str) -> list[str]:
    """The prompt's tokens (a word each, with the space before it), together the whole
    text: their offsets are an echo's ``text_offset``."""
    out = _PROMPT_PIECES.findall(prompt)
    if not out:
        return [prompt]
    rest = len(prompt) - sum(map(len, out))
    if rest:
        out[-1] += prompt[-rest:]  # trailing whitespace
    return out


def prompt_ids(prompt: str) -> list[int]:
    """The prompt's token ids, as ``/tokenize`` gives them."""
    return [
        zlib.crc32(p.strip().encode("utf-8", "surrogatepass")) % 32000
        for p in prompt_pieces(prompt)
    ]


def prompt_logprobs(prompt: str, top: int) -> list[Any]:
    """vLLM's shape: None for the first prompt token, then for each token a map of token id
    to logprob, rank and text: the prompt's own token first (a prompt is not always what
    the model would have said: its rank runs 1 to 3), then the ``top`` likeliest tokens
    (the own token counted once when it is among them). Deterministic."""
    out: list[Any] = [None]
    pieces = prompt_pieces(prompt)
    for i, (piece, own) in enumerate(zip(pieces, prompt_ids(prompt), strict=True)):
        if not i:
            continue
        best = -round(0.5 + (own % 89) / 40, 4)
        own_rank = 1 + own % 3
        entry = {
            str(own): {
                "logprob": round(best - 0.5 * (own_rank - 1), 4),
                "rank": own_rank,
                "decoded_token": piece,
            }
        }
        for rank in range(1, min(top, len(VOCAB)) + 1):
            if rank == own_rank:
                continue
            other = (own + rank) % len(VOCAB)
            entry[str(32000 + other)] = {
                "logprob": round(best - 0.5 * (rank - 1), 4),
                "rank": rank,
                "decoded_token": VOCAB[other],
            }
        out.append(entry)
    return out


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def stream_error_event(
    message: str = "Internal server error", code: int | str | None = 500
) -> bytes:
    """vLLM's in-stream error: note the spaces, it is written by json.dumps, not by pydantic."""
    return (
        b'data: {"error": {"message": '
        + _encode(message)
        + b', "type": "InternalServerError", "param": null, "code": '
        + _encode(code)
        + b"}}\n\ndata: [DONE]\n\n"
    )
