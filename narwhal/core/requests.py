"""Client request validation (contract 3): msgspec structs over the fields the router acts on.

Everything else in the body passes through to the engines unchanged, except the reserved
fields: a top-level ``kv_transfer_params`` is dropped (only a producer may hand out a
descriptor) and ``vllm_xargs.kv_transfer_params`` is refused outright.

Out-of-range values are refused here, before any engine leg, with vLLM's own limits. The
prefill leg's body replaces or drops the output fields (contract 4.1: ``max_tokens`` 1, no
``max_completion_tokens``, ``min_tokens``, ``n``, ``best_of`` or ``stream_options``), so a
bad value there would pass the producer and be refused only by the consumer, after the
producer had computed the prompt and pinned its KV blocks for a decode that never comes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from narwhal.core.faults import BadRequest, ModelNotServed

MAX_INT32 = 2**31 - 1  # beyond any context length, and fits an engine's int32 counters
INT64 = 2**63  # vLLM's bound on a seed and a priority: they travel as MessagePack int64
FINITE = 1.7976931348623157e308  # the largest float: ``le=FINITE`` refuses 1e999 (infinity)

TokenCount = Annotated[int, Meta(ge=1, le=MAX_INT32)]
MinTokens = Annotated[int, Meta(ge=0, le=MAX_INT32)]
Choices = Annotated[int, Meta(ge=1)]
# -1 asks for the whole vocabulary; no upper bound of ours: the engine's --max-logprobs
# sets it, and the producer checks it before it computes anything
Logprobs = Annotated[int, Meta(ge=-1, le=MAX_INT32)]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_INT32)]  # 0 and -1 both mean "off"
Probability = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Positive = Annotated[float, Meta(gt=0, le=FINITE)]
Int64 = Annotated[int, Meta(ge=-INT64, le=INT64 - 1)]
AtLeastOne = Annotated[int, Meta(ge=1, le=MAX_INT32)]
Truncation = Annotated[int, Meta(ge=-1, le=INT64 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    max_tokens: TokenCount | None = None
    min_tokens: MinTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Positive | None = None
    seed: Int64 | None = None
    priority: Int64 | None = None
    prompt_logprobs: Logprobs | None = None
    stream_interval: AtLeastOne | None = None
    truncate_prompt_tokens: Truncation | None = None
    vllm_xargs: dict[str, Any] | None = None
    echo: Any = None  # what is not served for chat is refused, whatever its value

    def output_limit(self) -> tuple[str, int] | None:
        """The field that caps the output and its value, as vLLM reads it."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)


class CompletionFields(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]
    logprobs: Logprobs | None = None


class ChatFields(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Logprobs | None = None

    def output_limit(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:  # vLLM prefers it over max_tokens
            return "max_completion_tokens", self.max_completion_tokens
        return super().output_limit()


# guided decoding in its every spelling (vLLM 0.32 and the older ``guided_*`` fields)
GUIDED = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)
# The fields the router reads by value; every other one it only splices. Decoded with the
# body, where one nested too deeply is a 400 naming the body: read later, at a deeper
# stack, the same nesting would exceed the recursion limit mid-request.
READ = (
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "return_token_ids",
    "stream_options",
    "tools",
    "tool_choice",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "seed",
    *GUIDED,
)
_READ = frozenset(READ)
PROMPT = ("prompt", "messages")  # decoded for validation, kept until placement has read them


class RequestBody(Mapping[str, Any]):
    """A client body's top-level fields as the JSON bytes that came, each decoded when the
    router first reads it. The engine legs' bodies splice these bytes (``raw``: msgspec
    writes a ``Raw`` as it is), so a prompt or a conversation passes to the engines without
    being decoded into objects and encoded again."""

    __slots__ = ("_values", "raw")

    def __init__(self, raw: dict[str, msgspec.Raw], values: dict[str, Any] | None = None) -> None:
        self.raw = raw
        self._values: dict[str, Any] = {} if values is None else values

    def get(self, key: str, default: Any = None) -> Any:  # the router reads a few, often
        try:
            return self._values[key]
        except KeyError:
            raw = self.raw.get(key)
        if raw is None:
            return default
        value = self._values[key] = _decode_field(key, raw)
        return value

    def __getitem__(self, key: str) -> Any:
        try:
            return self._values[key]
        except KeyError:
            value = self._values[key] = _decode_field(key, self.raw[key])
            return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def __repr__(self) -> str:
        return f"RequestBody({bytes(_encode(self.raw))!r})"

    def forget_prompt(self) -> None:
        """Drop the decoded prompt or messages (their objects are several times their
        JSON); a later read decodes them again. For once placement has read them."""
        for key in PROMPT:
            self._values.pop(key, None)

    def replace(self, **changes: Any) -> RequestBody:
        """This body with ``changes`` (new or changed fields); this one is unchanged."""
        raw = {**self.raw, **{k: msgspec.Raw(_encode(v)) for k, v in changes.items()}}
        values = {k: v for k, v in self._values.items() if k not in changes}
        return RequestBody(raw, {**values, **changes})

    def without(self, *keys: str) -> RequestBody:
        raw = {k: v for k, v in self.raw.items() if k not in keys}
        return RequestBody(raw, {k: v for k, v in self._values.items() if k not in keys})


def _decode_field(key: str, raw: msgspec.Raw) -> Any:
    try:
        return _decode_any(raw)
    except RecursionError:  # never a field the router reads: those are decoded with the body
        raise BadRequest(f"{key}: JSON nested too deeply", key) from None


def spliceable(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A body's fields as a leg's body takes them: a client's as their raw JSON, any other
    (a resume's continuation, built by the router) as its values."""
    return body.raw if isinstance(body, RequestBody) else body


class ClientRequest(msgspec.Struct):
    endpoint: str
    chat: bool
    body: RequestBody
    stream: bool
    include_usage: bool
    n: int = 1  # completions per prompt
    prompts: list[Any] | None = None  # several prompts (a completions list), else None
    # the served name it asked for, after aliases: every leg carries it (None: a request
    # built without parsing, which any engine may serve)
    model: str | None = None

    @property
    def fanout(self) -> int:
        """How many prefill/decode requests this one runs as (contract 3, "Fan-out")."""
        return len(self.prompts or (None,)) * self.n

    def split(self) -> list[tuple[int, int, ClientRequest]]:
        """The sub-requests, prompt-major then ``n`` (OpenAI's choice order): (prompt, j,
        request) with one prompt and ``n`` 1 each."""
        base = self.body.without("n", "best_of")
        prompts = self.prompts if self.prompts is not None else [None]
        subs = []
        seed = base.get("seed")
        for p, prompt in enumerate(prompts):
            for j in range(self.n):
                changes: dict[str, Any] = {} if self.prompts is None else {"prompt": prompt}
                if type(seed) is int and j:  # n samples, not n copies of one
                    changes["seed"] = seed + j
                body = base.replace(**changes) if changes else base
                sub = ClientRequest(
                    self.endpoint,
                    self.chat,
                    body,
                    self.stream,
                    self.include_usage,
                    model=self.model,
                )
                subs.append((p, j, sub))
        return subs


_decode_any = msgspec.json.Decoder().decode
_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_completion = msgspec.json.Decoder(CompletionFields).decode
_decode_chat = msgspec.json.Decoder(ChatFields).decode
_encode = msgspec.json.Encoder().encode
_PATH = re.compile(r"at `\$\.([^`\[]+)")


def parse_request(
    raw: bytes,
    *,
    endpoint: str,
    model: str,
    max_fanout: int = 16,
    resolve: Callable[[str], str | None] | None = None,
) -> ClientRequest:
    """Validate a completion or chat body; raise BadRequest / ModelNotServed. ``resolve``
    gives the served name a request's ``model`` stands for (None: nobody serves it);
    without it only ``model`` is served. An alias's body carries the served name."""
    chat = endpoint.endswith("/chat/completions")
    if not raw.isascii():  # a skipped or spliced field is not checked by the decoders
        try:
            raw.decode()
        except UnicodeDecodeError as exc:
            raise BadRequest(
                f"body: not valid JSON (invalid UTF-8 at byte {exc.start})", "body"
            ) from None
    try:
        top = _decode_fields(raw)
        values = _decoded(top)
    except msgspec.ValidationError:  # valid JSON, but not an object
        raise BadRequest(f"body: must be a JSON object, got {_kind_of(raw)}", "body") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc})", "body") from None
    except RecursionError:  # a JSON bomb: refuse it, never a 500
        raise BadRequest("body: JSON nested too deeply", "body") from None
    try:
        fields: _Common = (_decode_chat if chat else _decode_completion)(raw)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        param = match.group(1) if match else _missing_field(str(exc))
        raise BadRequest(f"{param}: {exc}", param) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc})", "body") from None
    except RecursionError:
        raise BadRequest("body: JSON nested too deeply", "body") from None
    top.pop("kv_transfer_params", None)
    # the prompt or the messages, decoded once: placement reads them for every request
    values.update(_decoded_prompt(fields))
    body = RequestBody(top, values)
    served = fields.model if resolve is None and fields.model == model else None
    if resolve is not None:
        served = resolve(fields.model)
    if served is None:
        raise ModelNotServed.named(fields.model)
    if served != fields.model:
        body.raw["model"] = msgspec.Raw(_encode(served))
        values["model"] = served
    if fields.best_of is not None and fields.best_of > 1:
        raise BadRequest(
            f"best_of: {fields.best_of} is not served: the engines would each rank their own "
            "candidates; ask for n completions instead",
            "best_of",
        )
    _check_combinations(fields, body)
    _refuse_what_is_not_served(fields, body)
    n = fields.n or 1
    if n > 1 and fields.temperature == 0:  # vLLM's own rule: greedy sampling gives one answer
        raise BadRequest(f"n: must be 1 when using greedy sampling, got {n}", "n")
    prompts = _prompts(getattr(fields, "prompt", None))
    count = len(prompts or (None,)) * n
    if count > max_fanout:
        param = "n" if prompts is None else "prompt"
        raise BadRequest(
            f"{param}: {count} completions ({len(prompts or (None,))} prompt(s) x n={n}) exceed "
            f"serving.max_fanout={max_fanout}",
            param,
        )
    if fields.vllm_xargs is not None and "kv_transfer_params" in fields.vllm_xargs:
        raise BadRequest(
            "vllm_xargs.kv_transfer_params: reserved; the router alone hands descriptors to "
            "engines",
            "vllm_xargs.kv_transfer_params",
        )
    options = fields.stream_options
    return ClientRequest(
        endpoint=endpoint,
        chat=chat,
        body=body,
        stream=bool(fields.stream),
        include_usage=bool(options and options.include_usage),
        n=n,
        prompts=prompts,
        model=served,
    )


def _all_ints(prompt: list[Any]) -> bool:
    """Whether a list prompt is token ids (at C speed: a prompt may hold thousands)."""
    try:
        msgspec.convert(prompt, list[int])
    except msgspec.ValidationError:
        return False
    return True


def _kind_of(raw: bytes) -> str:
    """The Python type a JSON document decodes to, by its first byte."""
    first = raw.lstrip()[:1]
    kinds = {b"[": "list", b'"': "str", b"t": "bool", b"f": "bool", b"n": "NoneType"}
    if first in kinds:
        return kinds[first]
    return "float" if any(c in raw for c in b".eE") else "int"


def _decoded(top: dict[str, msgspec.Raw]) -> dict[str, Any]:
    """The fields the router reads by value (``READ``) that the body has, decoded."""
    return {key: _decode_any(raw) for key, raw in top.items() if key in _READ}


def _decoded_prompt(fields: _Common) -> dict[str, Any]:
    if isinstance(fields, ChatFields):
        return {"messages": fields.messages}
    assert isinstance(fields, CompletionFields)
    return {"prompt": fields.prompt}


def _prompts(prompt: Any) -> list[Any] | None:
    """Several prompts (a list of strings or of token-id lists), else None: one prompt,
    whatever its shape (a string, token ids, a list holding one of either)."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if _all_ints(prompt):
        return None  # one prompt as token ids
    return list(prompt)


def _refuse_what_is_not_served(fields: _Common, body: Mapping[str, Any]) -> None:
    """contract 3: a requested field is never silently dropped. What the router does not serve
    yet (echo in chat) is a 400 naming the field, never an answer that lacks what was asked
    for; prompt logprobs on a stream are refused as vLLM refuses them."""
    prompt = getattr(fields, "prompt", None)
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt: an empty list holds no prompt", "prompt")
        if not _all_ints(prompt) and any(type(p) is int for p in prompt):
            raise BadRequest(
                "prompt: a list mixes token ids with prompts; send token ids or prompts",
                "prompt",
            )
    if fields.echo and getattr(fields, "prompt", None) is None:
        raise BadRequest(
            "echo: served through prefill and decode for completions only (chat's echo of "
            "the last message is not); ask without echo",
            "echo",
        )
    if fields.prompt_logprobs is not None and fields.stream:
        raise BadRequest(  # vLLM's own rule; served from the prefill leg when not streaming
            "prompt_logprobs: not available when stream is true", "prompt_logprobs"
        )


def _check_combinations(fields: _Common, body: Mapping[str, Any]) -> None:
    """The rules that involve two fields (each field's own range is in its annotation)."""
    limit = fields.output_limit()
    if fields.min_tokens is not None and limit is not None and fields.min_tokens > limit[1]:
        name, value = limit
        raise BadRequest(
            f"min_tokens: must not exceed {name} (min_tokens={fields.min_tokens}, {name}={value})",
            "min_tokens",
        )
    # vLLM's own test: truthy options (``{}`` passes); decoded only when they are there
    if fields.stream_options is not None and not fields.stream and body["stream_options"]:
        raise BadRequest(
            "stream_options: can only be defined when stream is true", "stream_options"
        )


def _missing_field(message: str) -> str:
    match = re.search(r"missing required field `([^`]+)`", message)
    return match.group(1) if match else "body"
