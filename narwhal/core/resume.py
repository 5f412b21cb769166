"""Stream resume (contract 6.4), pure: which streams may continue on another consumer after a
failure past the commit point, and the request that continues one.

A continuation is a fresh prefill and decode over ``/v1/completions`` of the prompt's token
ids followed by every token id the client already received, asking for what is left of
``max_tokens`` and ``min_tokens`` with the same sampling fields. With greedy sampling the
engine then generates exactly what the failed consumer would have; a seeded sample is not
promised to (the seed restarts at the continuation).

What cannot continue that way keeps the terminal event: a tool call or a forced tool
choice (the parser's state is lost with the stream), guided decoding and
``response_format`` (the grammar's state too: Dynamo refuses those after corrupted JSON),
``logprobs`` (the continuation's would describe another prompt), ``echo`` (its prompt side
was already sent), a reasoning delta already sent (the reasoning parser's state), stop
strings that hold text back (the held text would be lost). A chat without an output
limit was bounded by its context's end: its continuation asks the consumer's
``max_model_len`` (``/v1/models``) and is bounded there too (``within_context``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from narwhal.core.faults import RequestFault
from narwhal.core.requests import GUIDED, spliceable
from narwhal.core.retry import RetryBudget

ENDPOINT = "/v1/completions"  # a continuation's: its prompt is token ids
# a completion request's output limit when it names none (OpenAI's and vLLM's default)
COMPLETIONS_MAX_TOKENS = 16
# what follows a stream's failure after output, with resume on (the metrics' labels)
OUTCOMES = ("resumed", "refused", "completed", "failed", "cancelled")
# sampling fields a continuation keeps as the client sent them; anything else (messages,
# tools, stream options, the prompt's own shape) belongs to the original request only
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "logit_bias",
    "priority",
)


def refusal(body: Mapping[str, Any], *, chat: bool) -> str | None:
    """Why a stream of this request may not be resumed (None: it may be)."""
    choice = body.get("tool_choice")
    if choice not in (None, "none") or (body.get("tools") and choice != "none"):
        return "tool calls"
    for field in GUIDED:
        value = body.get(field)
        if value is not None and value != {"type": "text"}:  # plain text constrains nothing
            return "guided decoding"
    logprobs = body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs"):
        return "logprobs"
    if not chat and body.get("echo"):
        return "echo"
    if _held_back(body.get("stop")):
        return "stop strings"
    return None  # a fan-out's children are asked one by one: each resumes on its own


def _held_back(stop: Any) -> bool:
    """Whether vLLM holds back streamed text for a stop string: the longest one's length
    less one character, whose tokens' ids it reports already; what a failed stream held
    back would be lost to a continuation, which starts after those ids."""
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return any(isinstance(s, str) and len(s) > 1 for s in stops)


def limit(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """The output limit the client asked for (None: the engine's own)."""
    value = body.get("max_completion_tokens") if chat else None
    value = body.get("max_tokens") if value is None else value
    return value if type(value) is int else None


def continuation(
    body: Mapping[str, Any],
    *,
    chat: bool,
    prompt_ids: Sequence[int],
    sent_ids: Sequence[int],
) -> dict[str, Any]:
    """The ``/v1/completions`` body that continues a stream after ``sent_ids``: the prompt's
    ids and the sent ones as the prompt, what is left of the output limits, the same
    sampling fields. Raises ValueError when nothing is left to generate, and for a chat
    without a limit: vLLM reads a null as 16 and refuses one past its context, which the
    router does not know (the chat's own limit was the context's end)."""
    fields = spliceable(body)  # the sampling fields as they came, never decoded here
    out: dict[str, Any] = {k: fields[k] for k in SAMPLING if k in fields}
    out["model"] = body.get("model")
    out["prompt"] = [*prompt_ids, *sent_ids]
    asked = limit(body, chat=chat)
    if asked is None and not chat:
        asked = COMPLETIONS_MAX_TOKENS  # what the engine applied to the client's request
    if asked is not None:
        left = asked - len(sent_ids)
        if left < 1:
            raise ValueError("output limit reached")
        out["max_tokens"] = left
    # else a chat without a limit: its limit is the context's end (``within_context``)
    min_tokens = body.get("min_tokens")
    if type(min_tokens) is int and min_tokens > len(sent_ids):
        out["min_tokens"] = min_tokens - len(sent_ids)
    options = body.get("stream_options")
    if isinstance(options, dict):  # continuous usage goes on as the client asked it
        out["stream_options"] = options
    out["stream"] = True
    out["return_token_ids"] = True
    return out


def within_context(body: dict[str, Any], context: int | None) -> None:
    """Bound a continuation by its engine's context length (``None``: not known), as the
    client's request was: a chat without a limit ran to the context's end, and so does its
    continuation (vLLM reads a null ``max_tokens`` as 16); any limit is cut to what the
    context leaves after the continuation's longer prompt (vLLM clamps the client's, some
    versions refuse a continuation's past it). Raises ValueError when no limit can be
    given, or the context is full."""
    limit = body.get("max_tokens")
    if context is None:
        if limit is None:
            raise ValueError("context length unknown")
        return
    left = context - len(body["prompt"])
    if left < 1:
        raise ValueError("output limit reached")
    body["max_tokens"] = left if limit is None else min(limit, left)


class _Card(msgspec.Struct):
    id: str = ""
    max_model_len: int | None = None


class _Models(msgspec.Struct):
    data: list[_Card] = []


def context_of(models: bytes, model: str) -> int | None:
    """The context length ``/v1/models`` gives for ``model``, or for the one model an
    engine serves under another name (None: not given)."""
    try:
        cards = msgspec.json.decode(models, type=_Models).data
    except (msgspec.MsgspecError, RecursionError):
        return None
    sizes = {c.id: c.max_model_len for c in cards if c.max_model_len and c.max_model_len > 0}
    if model in sizes:
        return sizes[model]
    return next(iter(sizes.values())) if len(sizes) == 1 else None


def after(
    fault: RequestFault,
    *,
    resumes: int,
    allowed: int,
    remaining_s: float,
    needed_s: float,
    budget: RetryBudget,
) -> str | None:
    """Whether a stream that failed after output with ``fault`` continues: None, it does
    (a credit of the retry budget is spent), else why not. ``needed_s``: what the request
    took to its first output, which a continuation needs again (its prefill is longer by
    the tokens already sent); a deadline closer than that is too close to try."""
    if not fault.transient:  # the client's own error, the deadline, the drain
        return "not an engine fault"
    if resumes >= allowed:
        return "resumes spent"
    if remaining_s <= needed_s:
        return "deadline"
    if not budget.spend():
        return "budget"
    return None
