"""What the fake engine answers beyond a plain stream, shaped as vLLM 0.32 answers it
(``tests/captures/shapes/``, recorded by ``e2e/vllm/capture_shapes.py``): logprobs, echo,
stop strings, forced tool calls, JSON output, continuous usage, ``n`` samples and lists
of prompts, streamed and not; and every non-streamed answer.

Only requests that ask for one of these take this path (``Ask.plain`` is False): the
answers are built as dicts and encoded with msgspec. A plain stream keeps the precomputed
bytes of ``generation.Shapes``.

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

import itertools
import json
import re
import secrets
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from narwhal.fake_engine import generation as gen
from narwhal.fake_engine import lora

_encode = msgspec.json.encode
_PIECES = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")  # a string's "tokens": words, punctuation runs
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


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


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    count: int  # its tokens, as usage counts them
    # its token ids as ``prompt_token_ids`` reports them, what its samples are a function of
    ids: tuple[int, ...]


def prompts_of(body: dict[str, Any], chat: bool) -> list[Prompt]:
    """The request's prompts: one, or each of a completions list of prompts (strings or
    token-id lists), each read as the router's fan-out sends it alone."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and gen.id_list(prompt) is None:
        return [_prompt({"prompt": p}, False) for p in prompt]
    return [_prompt(body, chat)]


def _prompt(body: dict[str, Any], chat: bool) -> Prompt:
    """One prompt; its ids are computed here, once a request (a long prompt's cost)."""
    text, count = gen.prompt_of(body, chat)
    given = None if chat else gen.id_list(body.get("prompt"))
    return Prompt(text, count, tuple(gen.prompt_ids(text) if given is None else given))


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ask:
    """What one completion request asks of the engine."""

    chat: bool
    prompts: tuple[Prompt, ...]
    max_tokens: int
    n: int = 1
    greedy: bool = False
    seed: int | None = None
    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None: not asked
    echo: bool = False
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    tool: Tool | None = None  # a function the request forces (named, or "required")
    schema: dict[str, Any] | None = None  # response_format's JSON schema
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    # no limit (a chat without one, or one at the context's end): the script ends at the
    # default length after the original prompt, as a model stops at its end of sequence
    unlimited: bool = False
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)

    @property
    def plain(self) -> bool:
        """Served by ``Shapes``' precomputed bytes when streamed."""
        return (
            self.n == 1
            and len(self.prompts) == 1
            and self.logprobs is None
            and not self.echo
            and not self.stop
            and self.tool is None
            and self.schema is None
            and not self.continuous_usage
        )

    def key(self, j: int) -> int | None:
        """What sample ``j`` (of ``n``) is a function of, beside the prompt: under an
        adapter, the adapter too (``lora.generation_salt``)."""
        if self.greedy:
            key = None
        elif self.seed is not None:
            key = self.seed + j
        else:
            key = j or None
        return key if self.adapter is None else lora.generation_salt(self.adapter, key)


def ask_of(
    body: dict[str, Any],
    chat: bool,
    default_max_tokens: int,
    context: int = 1 << 62,
    *,
    adapter: str | None = None,
) -> Ask:
    """``context``: the engine's max_model_len; a limit that reaches its end is none.
    ``adapter``: the LoRA adapter the request runs under."""
    limit = body.get("max_completion_tokens") if chat else None
    count = limit or body.get("max_tokens") or default_max_tokens
    temperature = body.get("temperature")
    seed = body.get("seed")
    n = body.get("n")
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    usage = options.get("include_usage") is True
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    prompts = tuple(prompts_of(body, chat))
    to_end = type(count) is int and prompts[0].count + count >= context
    return Ask(
        chat=chat,
        prompts=prompts,
        max_tokens=count if type(count) is int and not to_end else default_max_tokens,
        n=n if type(n) is int and n > 1 else 1,
        greedy=isinstance(temperature, int | float) and temperature < GREEDY_BELOW,
        seed=seed if type(seed) is int else None,
        logprobs=_logprobs_asked(body, chat),
        echo=not chat and body.get("echo") is True,
        prompt_logprobs=_count(body.get("prompt_logprobs")),
        stop=tuple(s for s in stop if isinstance(s, str) and s) if isinstance(stop, list) else (),
        tool=_forced_tool(body) if chat else None,
        schema=_schema(body.get("response_format")),
        include_usage=usage,
        continuous_usage=usage and options.get("continuous_usage_stats") is True,
        return_token_ids=body.get("return_token_ids") is True,
        unlimited=to_end or (chat and not limit and body.get("max_tokens") is None),
        adapter=adapter,
    )


def _count(value: Any) -> int | None:
    """A number of alternatives; -1 is the whole vocabulary, as vLLM reads it."""
    if type(value) is not int:
        return None
    return len(gen.VOCAB) if value < 0 else value


def _logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return _count(body.get("logprobs"))
    if body.get("logprobs") is not True:
        return None
    return _count(body.get("top_logprobs")) or 0


def _forced_tool(body: dict[str, Any]) -> Tool | None:
    listed = body.get("tools")
    tools = (
        [t.get("function") for t in listed if isinstance(t, dict)]
        if isinstance(listed, list)
        else []
    )
    functions = [f for f in tools if isinstance(f, dict) and isinstance(f.get("name"), str)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        wanted = choice["function"].get("name")
        functions = [f for f in functions if f["name"] == wanted]
    elif choice != "required":
        return None
    if not functions:
        return None
    parameters = functions[0].get("parameters")
    return Tool(functions[0]["name"], parameters if isinstance(parameters, dict) else {})


def _schema(response_format: Any) -> dict[str, Any] | None:
    if not isinstance(response_format, dict):
        return None
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if response_format.get("type") == "json_schema" and isinstance(spec, dict):
        schema = spec.get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}
    return None


# ---- samples -----------------------------------------------------------------------------


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


# ---- logprobs ------------------------------------------------------------------------------


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


def _chat_entry(token: Token, position: int, k: int) -> dict[str, Any]:
    return {
        "token": token.text,
        "logprob": logprob(token, position),
        "bytes": list(token.text.encode()),
        "top_logprobs": [
            {"token": t.text, "logprob": lp, "bytes": list(t.text.encode())}
            for t, lp in alternatives(token, position, k)[:k]
        ],
    }


class _CompletionLogprobs:
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


def _echo_prompt(prompt: Prompt, lists: _CompletionLogprobs, k: int) -> None:
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


# ---- answers --------------------------------------------------------------------------------


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
            logprobs = {"content": [_chat_entry(t, i, k) for i, t in enumerate(s.tokens)]}
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
        lists = _CompletionLogprobs(0)
        if ask.echo:
            _echo_prompt(s.prompt, lists, ask.logprobs)
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
        self.lists = _CompletionLogprobs(0)
        if ask.echo and ask.logprobs is not None:
            _echo_prompt(s.prompt, self.lists, ask.logprobs)

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
                logprobs = {"content": [_chat_entry(token, position, ask.logprobs)]}
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
