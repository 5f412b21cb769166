"""Deterministic fake generation and vLLM 0.32's response shapes (from real captures).

Tokens are a seeded function of the prompt text alone, so a prompt decoded after a KV
handoff yields exactly what the same prompt yields served locally, like real vLLM at
temperature 0. Chunk bytes are assembled from precomputed pieces: the fake engine runs
beside the router during benchmarks and must stay cheap.
"""

from __future__ import annotations

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


def token_ids(prompt: str, count: int) -> list[int]:
    """``count`` token indices into VOCAB, a pure function of the prompt."""
    x = zlib.crc32(prompt.encode("utf-8", "surrogatepass")) or 1
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

    def full(
        self,
        text: str,
        prompt_tokens: int,
        completion_tokens: int,
        kv_transfer_params: dict[str, Any] | None,
        prompt_logprobs: list[Any] | None = None,
    ) -> bytes:
        """A non-streaming response, field for field as vLLM 0.32 writes it."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": prompt_logprobs,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
        out: dict[str, Any] = {
            "id": self.resp_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "completion_tokens": completion_tokens,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
        }
        if self.chat:
            out.update(prompt_logprobs=prompt_logprobs, prompt_token_ids=None, prompt_text=None)
        out.update(kv_transfer_params=kv_transfer_params, ec_transfer_params=None, metrics=None)
        return _encode(out)


def prompt_logprobs(prompt: str, top: int) -> list[Any]:
    """vLLM's shape: None for the first prompt token, then for each token a map of token id
    to its logprob, rank and text (the token itself and ``top`` others). Deterministic."""
    words = prompt.split()
    out: list[Any] = [None]
    for i, word in enumerate(words[1:], start=1):
        own = zlib.crc32(word.encode()) % 32000
        entry = {str(own): {"logprob": -0.5 - i / 100, "rank": 1, "decoded_token": word}}
        for rank in range(2, top + 2 if top else 1):
            other = (own + rank) % 32000
            entry[str(other)] = {"logprob": -1.0 - rank, "rank": rank, "decoded_token": "x"}
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
