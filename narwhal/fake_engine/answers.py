"""What the fake engine answers beyond a plain stream, shaped as vLLM 0.32 answers it
(``tests/captures/shapes/``, recorded by ``e2e/vllm/capture_shapes.py``): logprobs, echo,
stop strings, forced tool calls, JSON output, continuous usage, ``n`` samples and lists
of prompts, streamed and not; and every non-streamed answer.

Only requests that ask for one of these take this path (``Ask.plain`` is False): the
answers are built as dicts and encoded with msgspec. A plain stream keeps the precomputed
bytes of ``generation.Shapes``. A request's ``Ask`` is read in ``asks``, its choices are
made in ``samples``, and their logprobs in ``logprobs``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.asks import Ask
from narwhal.fake_engine.logprobs import CompletionLogprobs, chat_entry, echo_prompt
from narwhal.fake_engine.samples import Sample

_encode = msgspec.json.encode


def _usage(ask: Ask, choices: list[Sample]) -> tuple[int, int]:
    """(prompt, completion) tokens: every prompt once, every choice's tokens."""
    return sum(p.count for p in ask.prompts), sum(len(s.tokens) for s in choices)


def full(
    ask: Ask,
    shapes: gen.Shapes,
    choices: list[Sample],
    kv_transfer_params: dict[str, Any] | None,
) -> bytes:
    """A non-streamed answer, field for field as vLLM 0.32 writes it."""
    prompt_logprobs = ask.prompt_logprobs
    if prompt_logprobs is None and ask.echo and ask.logprobs is not None:
        prompt_logprobs = ask.logprobs  # vLLM computes the echoed prompt's logprobs so
    listed = [_full_choice(ask, s, prompt_logprobs) for s in choices]
    prompt_tokens, completion_tokens = _usage(ask, choices)
    out: dict[str, Any] = {
        "id": shapes.resp_id,
        "object": "chat.completion" if ask.chat else "text_completion",
        "created": shapes.created,
        "model": shapes.model,
        "choices": listed,
        "service_tier": None,
        "system_fingerprint": gen.SYSTEM_FINGERPRINT,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    if ask.chat:
        first = ask.prompts[0]
        out.update(
            prompt_logprobs=None
            if prompt_logprobs is None
            else gen.prompt_logprobs(first.text, prompt_logprobs),
            prompt_token_ids=first.ids if ask.return_token_ids else None,
            prompt_text=None,
        )
    out.update(kv_transfer_params=kv_transfer_params, ec_transfer_params=None, metrics=None)
    return _encode(out)


def _full_choice(ask: Ask, s: Sample, prompt_logprobs: int | None) -> dict[str, Any]:
    token_ids = [t.id for t in s.tokens] if ask.return_token_ids else None
    if ask.chat:
        logprobs = None
        if ask.logprobs is not None:
            k = ask.logprobs
            logprobs = {"content": [chat_entry(t, i, k) for i, t in enumerate(s.tokens)]}
        return {
            "index": s.index,
            "message": {
                "role": "assistant",
                "content": s.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": logprobs,
            "finish_reason": s.finish_reason,
            "stop_reason": s.stop_reason,
            "token_ids": token_ids,
            "routed_experts": None,
        }
    text, completion_logprobs = s.text, None
    if ask.echo:
        text = s.prompt.text + text
    if ask.logprobs is not None:
        lists = CompletionLogprobs(0)
        if ask.echo:
            echo_prompt(s.prompt, lists, ask.logprobs)
        for i, token in enumerate(s.tokens):
            lists.add_token(token, i, ask.logprobs)
        completion_logprobs = lists.take()
    return {
        "index": s.index,
        "text": text,
        "logprobs": completion_logprobs,
        "finish_reason": s.finish_reason,
        "stop_reason": s.stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": None
        if prompt_logprobs is None
        else gen.prompt_logprobs(s.prompt.text, prompt_logprobs),
        "prompt_token_ids": s.prompt.ids if ask.return_token_ids else None,
        "routed_experts": None,
    }


@dataclass(slots=True)
class StreamPlan:
    """A stream's frames: before the first token (chat's role deltas), one per generated
    token (None: the token sends no chunk), and the usage chunk at the end (or None)."""

    head: list[bytes]
    tokens: Iterable[bytes | None]
    tail: bytes | None


def plain_plan(
    ask: Ask,
    shapes: gen.Shapes,
    ids: list[int],
    *,
    finished: bool,
    prompt_tokens: int,
    chunk_tokens: tuple[int, ...] = (),
) -> StreamPlan:
    """A plain stream from precomputed bytes (the benchmarks' path), each chunk made when
    it is written. ``finished`` False: no chunk carries a finish reason (a scripted fault
    breaks the stream). ``chunk_tokens``: how many tokens each chunk carries, in turn
    (``grouped_frames``); empty, one each."""
    last = len(ids) - 1 if finished else -1
    with_ids = ask.return_token_ids
    # vLLM sends the prompt's ids once: with chat's role, with a completion's first chunk
    prompt_ids = ask.prompts[0].ids if with_ids else None
    head = [shapes.role_chunk(prompt_ids)] if shapes.chat else []
    first = None if shapes.chat else prompt_ids
    frames: Iterable[bytes | None]
    if chunk_tokens:
        frames = grouped_frames(shapes, ids, last, with_ids, chunk_tokens, first)
    else:
        frames = (
            shapes.token_chunk(index, n == last, with_ids, None if n else first)
            for n, index in enumerate(ids)
        )
    tail = shapes.usage_chunk(prompt_tokens, len(ids)) if ask.include_usage else None
    return StreamPlan(head, frames, tail)


def grouped_frames(
    shapes: gen.Shapes,
    ids: list[int],
    last: int,
    with_ids: bool,
    pattern: tuple[int, ...],
    prompt_ids: Sequence[int] | None = None,
) -> Iterator[bytes | None]:
    """One item per token, as ``StreamPlan.tokens``: a chunk, or None for a token that
    goes out with a later chunk. vLLM's stream is not one token per chunk: under load one
    chunk carries the tokens of several engine steps (``k`` in ``pattern``, taken in turn),
    and a token whose text the detokenizer holds back (``0``: an incomplete character)
    goes out in a completions chunk with empty text (chat sends none unless it was asked
    for ``return_token_ids``: vLLM then sends every token's ids), its text with the next
    chunk. The text of the whole stream is the same as one token per chunk.
    ``prompt_ids``: a completion's, on its first chunk (even one whose text is held)."""
    held: list[int] = []
    start, turn = 0, 0
    while start < len(ids):
        k = pattern[turn % len(pattern)]
        turn += 1
        group = ids[start : start + max(k, 1)]
        start += len(group)
        final = start - 1 == last
        yield from itertools.repeat(None, len(group) - 1)
        if k == 0 and start < len(ids):
            held += group
            silent = shapes.chat and not with_ids
            yield None if silent else shapes.group_chunk([], group, False, with_ids, prompt_ids)
        else:
            yield shapes.group_chunk(held + group, group, final, with_ids, prompt_ids)
            held = []
        prompt_ids = None  # chat's go with its role, never here


def stream_plan(ask: Ask, shapes: gen.Shapes, choices: list[Sample]) -> StreamPlan:
    """Every choice streamed as vLLM 0.32 streams it: chat's role deltas first, one per
    choice; then the choices' tokens interleaved, one chunk each; then one usage chunk."""
    head_of = {
        "id": shapes.resp_id,
        "object": "chat.completion.chunk" if ask.chat else "text_completion",
        "created": shapes.created,
        "model": shapes.model,
    }
    head = []
    if ask.chat:
        for s in choices:
            chunk: dict[str, Any] = {
                **head_of,
                "choices": [
                    {
                        "index": s.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if ask.continuous_usage:
                chunk["usage"] = _running_usage(ask, s, 0)
            # vLLM sends the prompt's ids with each choice's role
            prompt_ids = s.prompt.ids if ask.return_token_ids else None
            chunk.update(prompt_token_ids=prompt_ids, prompt_text=None)
            head.append(_encode(chunk))
    writers = [_ChoiceStream(ask, s, head_of) for s in choices]
    frames: list[bytes | None] = []
    for position in range(max(len(s.tokens) for s in choices)):
        for writer in writers:
            if position < len(writer.sample.tokens):
                frames.append(writer.frame(position))
    tail = None
    if ask.include_usage:
        prompt_tokens, completion_tokens = _usage(ask, choices)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        tail = _encode(
            {**head_of, "choices": [], "usage": usage, "system_fingerprint": gen.SYSTEM_FINGERPRINT}
        )
    return StreamPlan(head, frames, tail)


def _running_usage(ask: Ask, s: Sample, completion_tokens: int) -> dict[str, Any]:
    """``continuous_usage_stats``: the choice's counts so far, on every chunk."""
    prompt_tokens = s.prompt.count
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if ask.chat:
        usage["completion_tokens_details"] = None
    return usage


class _ChoiceStream:
    """One choice's chunks, in order (logprob offsets run on from chunk to chunk)."""

    def __init__(self, ask: Ask, s: Sample, head: dict[str, Any]) -> None:
        self.ask = ask
        self.sample = s
        self.head = head
        self.lists = CompletionLogprobs(0)
        if ask.echo and ask.logprobs is not None:
            echo_prompt(s.prompt, self.lists, ask.logprobs)

    def frame(self, position: int) -> bytes | None:
        ask, s = self.ask, self.sample
        part = s.parts[position]
        last = position == len(s.tokens) - 1
        token = s.tokens[position]
        token_ids = [token.id] if ask.return_token_ids else None
        if ask.chat:
            if part is None and not last:
                return None
            logprobs = None
            if ask.logprobs is not None:
                logprobs = {"content": [chat_entry(token, position, ask.logprobs)]}
            choice: dict[str, Any] = {
                "index": s.index,
                "delta": part if part is not None else {},
                "logprobs": logprobs,
                "finish_reason": s.finish_reason if last else None,
            }
            if last:
                choice["stop_reason"] = s.stop_reason
            choice["token_ids"] = token_ids
        else:
            text, prompt_ids = part, None
            if position == 0 and (ask.echo or ask.return_token_ids):
                prompt_ids = s.prompt.ids  # the prompt's ids go out with the first token
            if ask.echo and position == 0:  # and so does an echoed prompt
                text = s.prompt.text + text
            logprobs = None
            if ask.logprobs is not None:
                self.lists.add_token(token, position, ask.logprobs)
                logprobs = self.lists.take()
            choice = {
                "index": s.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": s.finish_reason if last else None,
                "stop_reason": s.stop_reason if last else None,
                "prompt_token_ids": prompt_ids,
                "token_ids": token_ids,
            }
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if ask.continuous_usage:
            chunk["usage"] = _running_usage(ask, s, position + 1)
        return _encode(chunk)
