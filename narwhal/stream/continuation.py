"""What a stream keeps so that another consumer can continue it (contract 6.4), sans-IO.

With stream resume on, the decode leg asks for vLLM's ``return_token_ids``: each chunk
then lists the token ids it carries, and the first one the prompt's. ``Kept`` reads them
as the chunks are relayed: the prompt's ids, every generated id the client was sent, and
the client stream's ``id``, ``created`` and ``model``, which a continuation's chunks take
on. What the client did not ask for it does not see: ``without_ids`` puts back the
``null`` vLLM sends when ids are not asked for.

A continuation is a ``/v1/completions`` stream (``narwhal.core.resume.continuation``).
``Reframer`` writes each of its chunks as the client's stream would have carried it: a
chat delta or a completion chunk of the same ``id``, ``index``, ``created`` and
``model``, and its usage counting the client's prompt once and every token generated for
the client, the failed attempts' included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.stream.payloads import Chunk

_encode = msgspec.json.Encoder().encode
_COMPACT = b'token_ids":['  # the key's end: prompt_token_ids too
_KEY_STARTS = (b'"', b'"prompt_')
_NULL = b'token_ids":null'
_ID_BYTES = frozenset(b"0123456789,- ")
_decode = msgspec.json.Decoder().decode


def without_ids(payload: bytes, chunk: Chunk | None = None) -> bytes:
    """The chunk as vLLM sends it when ``return_token_ids`` was not asked: its id lists
    ``null`` (``chunk``, its parsed form, is not needed: a ``Rewrite``'s signature).
    vLLM's compact lists of integers are spliced by ``bytes.find`` (a key can only start
    at an unescaped quote, which no string value holds); anything else is decoded and
    encoded again."""
    at = payload.find(_COMPACT)
    while at >= 0:
        end = payload.find(b"]", at)
        if (
            end < 0
            or not payload.endswith(_KEY_STARTS, 0, at)
            or not _ID_BYTES.issuperset(payload[at + len(_COMPACT) : end])
        ):
            return _nulled(payload)
        payload = payload[:at] + _NULL + payload[end + 1 :]
        at = payload.find(_COMPACT, at)
    if payload.count(b'token_ids"') > payload.count(_NULL):  # spaced, or not a list
        return _nulled(payload)
    return payload


def _nulled(payload: bytes) -> bytes:
    """The slow way: the chunk decoded, its id lists made null, encoded again."""
    try:
        chunk = _decode(payload)
    except msgspec.DecodeError:
        return payload  # not JSON: the relay rules have refused it already
    if not isinstance(chunk, dict):
        return payload
    for holder in [chunk, *(c for c in chunk.get("choices") or () if isinstance(c, dict))]:
        for key in ("prompt_token_ids", "token_ids"):
            if key in holder:
                holder[key] = None
    return _encode(chunk)


def _int_list(value: Any) -> list[int] | None:
    if type(value) is list and all(type(i) is int for i in value):
        return value
    return None


class Kept:
    """One client stream's ids and head, across its attempts. ``lost``: a token came
    without its ids (an engine that does not report them), or several choices in one
    stream: the stream cannot continue. ``held``: the last ids came in chunks with no
    text (the detokenizer holds back an incomplete character): the client has not seen
    them, and a continuation generates them again."""

    __slots__ = (
        "created",
        "finished",
        "held",
        "id",
        "ids",
        "index",
        "lost",
        "model",
        "prompt_ids",
        "reasoning",
    )

    def __init__(self) -> None:
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []  # every generated id the client was sent, in order
        self.held = 0
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.index: int | None = None  # the stream's choice
        self.lost = False
        self.reasoning = False  # a reasoning or tool-call delta went out
        self.finished = False  # its choice has its finish reason: nothing to continue

    def observe(self, chunk: Chunk) -> None:
        """One relayed chunk (a decode leg's stream carries a single choice)."""
        if self.id is None and chunk.id is not None:
            self.id, self.created, self.model = chunk.id, chunk.created, chunk.model
        if self.prompt_ids is None:
            self._prompt_ids(chunk)
        for choice in chunk.choices:
            if self.index is None:
                self.index = choice.index
            elif choice.index != self.index:
                self.lost = True
            self._choice(choice)

    def _choice(self, choice: Any) -> None:
        ids = choice.token_ids
        delta = choice.delta
        text = choice.text if delta is None else delta.content
        if type(ids) is list:  # its items are checked once, at a resume (``refusal``)
            self.ids += ids
            self.held = 0 if text else self.held + len(ids)
        elif choice.is_output() and choice.finish_reason is None:
            self.lost = True
        if choice.finish_reason is not None:
            self.finished = True
        if delta is not None and (delta.reasoning_content or delta.reasoning or delta.tool_calls):
            self.reasoning = True

    def _prompt_ids(self, chunk: Chunk) -> None:
        ids = _int_list(chunk.prompt_token_ids)
        if ids is None and chunk.choices:
            ids = _int_list(chunk.choices[0].prompt_token_ids)
        if ids:
            self.prompt_ids = ids

    def refusal(self) -> str | None:
        """Why what was kept cannot continue the stream (None: it can)."""
        if self.finished:
            return "stream finished"
        if self.reasoning:
            return "reasoning sent"
        if self.lost or not self.prompt_ids or _int_list(self.ids) is None:
            return "token ids not reported"
        return None

    def sent(self) -> list[int]:
        """The ids whose text the client has: a continuation starts after them (the ids
        held back without text are generated again)."""
        if self.held:
            del self.ids[len(self.ids) - self.held :]
            self.held = 0
        return self.ids


class Reframer:
    """A continuation's chunks, written as the client's stream. ``before``: the tokens
    generated for the client before this continuation; ``prompt_tokens``: the client's
    prompt, counted once."""

    __slots__ = ("_before", "_chat", "_kept", "_object", "_prompt_tokens", "_with_ids")

    def __init__(
        self, kept: Kept, *, chat: bool, with_ids: bool, prompt_tokens: int, before: int
    ) -> None:
        self._kept = kept
        self._chat = chat
        self._with_ids = with_ids  # the client asked for ``return_token_ids``
        self._prompt_tokens = prompt_tokens
        self._before = before
        self._object = "chat.completion.chunk" if chat else "text_completion"

    def __call__(self, payload: bytes, chunk: Chunk) -> bytes | None:
        """The client's chunk for one continuation chunk; None: the client's stream would
        have carried nothing (a chat delta with no text and no finish)."""
        choices = []
        for choice in chunk.choices:
            text = choice.text or ""
            if self._chat and not text and choice.finish_reason is None:
                continue
            index = choice.index if self._kept.index is None else self._kept.index
            choices.append(self._choice(index, text, choice))
        if chunk.choices and not choices:
            return None
        out: dict[str, Any] = {
            "id": self._kept.id,
            "object": self._object,
            "created": self._kept.created,
            "model": self._kept.model,
            "choices": choices,
        }
        if chunk.system_fingerprint is not None:
            out["system_fingerprint"] = chunk.system_fingerprint
        if chunk.usage is not None:
            out["usage"] = self._usage(chunk.usage)
        return _encode(out)

    def _choice(self, index: int, text: str, choice: Any) -> dict[str, Any]:
        ids = _int_list(choice.token_ids) if self._with_ids else None
        finish = choice.finish_reason
        if self._chat:
            out: dict[str, Any] = {
                "index": index,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            if finish is not None:
                out["stop_reason"] = choice.stop_reason
            out["token_ids"] = ids
            return out
        return {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
            "prompt_token_ids": None,
            "token_ids": ids,
        }

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's counts as the client's: its prompt (the client's prompt and
        the tokens already sent) is the client's prompt, and those tokens are output."""
        generated = usage.get("completion_tokens")
        completion = self._before + (generated if type(generated) is int else 0)
        return {
            **usage,
            "prompt_tokens": self._prompt_tokens,
            "total_tokens": self._prompt_tokens + completion,
            "completion_tokens": completion,
        }
