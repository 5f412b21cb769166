"""The KV connector: prefill and decode bodies, and the handoff descriptor (contract 4.1 to 4.3).

Pure code. The descriptor is kept as the producer's raw JSON bytes, so the decode leg
carries it byte for byte (every field but the two we validate is opaque), and
``PrefillResult.parameters()`` hands out a fresh decoded dict on every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from narwhal.core.faults import DescriptorInvalid, Phase
from narwhal.core.requests import spliceable

# Fields that make no sense for a one-token, non-streaming prefill (contract 4.1).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "n", "best_of", "max_completion_tokens")
_RESERVED = "kv_transfer_params"
# the prompt side comes from the prefill leg: a decode leg streams (vLLM refuses prompt
# logprobs there) and never computes the prompt (an echo's logprobs would be missing)
_DECODE_DROPPED = (_RESERVED, "prompt_logprobs", "echo")
# a model no engine serves: the consumer refuses the reclaim request before admission
RECLAIM_MODEL = "narwhal-reclaim-no-such-model"
# what a block id must be (a JSON integer, never ``true``, not negative), checked by msgspec
# at C speed: a long prompt's descriptor holds a block id per 16 tokens
BlockId = Annotated[int, msgspec.Meta(ge=0)]
_FLAT_IDS = list[BlockId]
_GROUPED_IDS = list[list[BlockId]]


class PrefillResult(msgspec.Struct, frozen=True):
    """A validated descriptor bound to the producer, endpoint and backend request id."""

    producer_url: str
    endpoint: str
    request_id: str
    connector: str
    descriptor: msgspec.Raw
    # the prompt's logprobs when the client asked for them: the producer computed the
    # prompt, the consumer never does (contract 3, "Completeness")
    prompt_logprobs: msgspec.Raw = msgspec.Raw()
    # an echo: the producer's text (the prompt and its one token) and its logprobs
    text: str | None = None
    logprobs: msgspec.Raw = msgspec.Raw()
    prompt_tokens: int | None = None  # as the producer counted them (its usage)
    # the prompt's token ids when the client asked for them (``return_token_ids``): an
    # echo's first chunk carries them, and only the producer computed the prompt
    prompt_token_ids: msgspec.Raw = msgspec.Raw()

    def parameters(self) -> dict[str, Any]:
        """A fresh, detached copy of the descriptor."""
        params: dict[str, Any] = msgspec.json.decode(self.descriptor)
        return params


class _Choice(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    prompt_logprobs: msgspec.Raw = msgspec.Raw()  # completions carry them per choice
    prompt_token_ids: msgspec.Raw = msgspec.Raw()  # and so their token ids
    text: Any = None
    logprobs: msgspec.Raw = msgspec.Raw()


class _PrefillResponse(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: Any = None  # the producer's count of the prompt (an engine's garbage is ignored)
    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    prompt_logprobs: msgspec.Raw = msgspec.Raw()  # chat carries them at the top
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


class _DescriptorView(msgspec.Struct):
    """The two fields the router validates; the rest stays opaque."""

    remote_engine_id: Any = msgspec.UNSET
    remote_block_ids: Any = msgspec.UNSET


def _present(raw: msgspec.Raw) -> bool:
    return len(raw) > 0 and bytes(raw) != b"null"


class NixlConnector:
    """vLLM's NixlConnector wire format: the producer returns ``kv_transfer_params``."""

    name = "NixlConnector"

    def reclaim_body(self, result: PrefillResult) -> bytes:
        """The cheapest request that makes a consumer tell the producer to free the
        blocks of a descriptor nobody will decode (contract 5, "orphaned handoffs").

        vLLM (since vllm#41269, in 0.32) notifies the producer when a consumer rejects a
        request carrying ``do_remote_prefill`` before admission, with no transfer and no
        compute; an unknown model is such a rejection (a 404 from its model check, which
        runs before anything else). Measured on vLLM 0.32 against a one-token decode that
        pulls the blocks (``e2e/vllm/reclaim_probe.py``): the blocks free in 0.3-2.5 s
        instead of a read that stalled until the lease in two runs of three."""
        return (
            b'{"model":"%s","prompt":"x","max_tokens":1,"stream":false,"%s":'
            % (RECLAIM_MODEL.encode(), _RESERVED.encode())
            + bytes(result.descriptor)
            + b"}"
        )

    def prefill_body(
        self, body: Mapping[str, Any], *, asks_descriptor: bool = True
    ) -> dict[str, Any]:
        """The prefill leg's body: the client's fields as they came (raw JSON, spliced by
        the encoder) with the prefill's own. A client's ``return_token_ids`` stays in it:
        the producer's prompt ids go into an echo. ``asks_descriptor`` False: the leg asks for no
        descriptor (its producer decodes too), so the engine holds no blocks for a read."""
        out = {k: v for k, v in spliceable(body).items() if k not in _PREFILL_DROPPED}
        if body.get("echo") and body.get("logprobs") is None:
            # the token the producer adds after an echoed prompt is known by its logprob
            out["logprobs"] = 0
        out["max_tokens"] = 1
        out["stream"] = False
        if asks_descriptor:
            out[_RESERVED] = {"do_remote_decode": True}
        return out

    def decode_body(
        self, body: Mapping[str, Any], result: PrefillResult | None, *, endpoint: str
    ) -> dict[str, Any]:
        """The decode leg's body; ``result`` None means same-worker decode (no transfer).
        Prompt logprobs come from the prefill leg: a decode leg streams, and vLLM refuses
        them on a stream."""
        out = {k: v for k, v in spliceable(body).items() if k not in _DECODE_DROPPED}
        out["stream"] = True
        if not _asks_usage(body):
            # Token counts (journal, metrics) are the engine's own, from its usage chunk; a
            # streaming client that did not ask for it does not get it (``StreamRelay``).
            # The options are replaced: continuous usage stats must not reach it unasked.
            out["stream_options"] = {"include_usage": True}
        if result is not None:
            self.check_compatible(result, endpoint)
            out[_RESERVED] = result.descriptor
        return out

    def check_compatible(self, result: PrefillResult, endpoint: str) -> None:
        if result.connector != self.name:
            raise DescriptorInvalid(
                f"connector mismatch: descriptor produced by {result.connector}, "
                f"consumer uses {self.name}",
                phase=Phase.HANDOFF,
            )
        if result.endpoint != endpoint:
            raise DescriptorInvalid(
                f"endpoint mismatch: descriptor produced on {result.endpoint}, "
                f"decode leg is {endpoint}",
                phase=Phase.HANDOFF,
            )

    def extract(
        self,
        response: bytes,
        *,
        producer_url: str,
        endpoint: str,
        request_id: str,
        asks_descriptor: bool = True,
    ) -> PrefillResult:
        """Find and validate the descriptor in a prefill response (contract 4.1, 4.2);
        ``asks_descriptor`` False: none was asked for, only the prompt side is read."""
        try:
            parsed = msgspec.json.decode(response, type=_PrefillResponse)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise DescriptorInvalid(
                f"prefill response is not an OpenAI completion: {exc}", phase=Phase.PREFILL
            ) from None
        raw = msgspec.Raw()
        if parsed.choices and _present(parsed.choices[0].kv_transfer_params):
            raw = parsed.choices[0].kv_transfer_params
        elif _present(parsed.kv_transfer_params):
            raw = parsed.kv_transfer_params
        if not asks_descriptor:
            raw = msgspec.Raw()
        elif not _present(raw):
            raise DescriptorInvalid(
                "missing engine identity: prefill response has no kv_transfer_params",
                phase=Phase.PREFILL,
            )
        else:
            validate_descriptor(raw)
        prompt_logprobs = parsed.prompt_logprobs
        first = parsed.choices[0] if parsed.choices else _Choice()
        if _present(first.prompt_logprobs):
            prompt_logprobs = first.prompt_logprobs
        prompt_ids = first.prompt_token_ids
        if not _present(prompt_ids):
            prompt_ids = parsed.prompt_token_ids
        # copies: a decoded Raw is a view that keeps the whole response alive for as long
        # as the request holds its descriptor (the response is several times its size)
        return PrefillResult(
            producer_url=producer_url,
            endpoint=endpoint,
            request_id=request_id,
            connector=self.name,
            descriptor=raw.copy(),
            prompt_logprobs=prompt_logprobs.copy() if _present(prompt_logprobs) else msgspec.Raw(),
            text=first.text if isinstance(first.text, str) else None,
            logprobs=first.logprobs.copy() if _present(first.logprobs) else msgspec.Raw(),
            prompt_tokens=_prompt_tokens(parsed.usage),
            prompt_token_ids=prompt_ids.copy() if _present(prompt_ids) else msgspec.Raw(),
        )


def _prompt_tokens(usage: Any) -> int | None:
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return count if type(count) is int and count >= 0 else None


def validate_descriptor(raw: msgspec.Raw | bytes) -> None:
    """Raise DescriptorInvalid with a distinct message for each rule of contract 4.2."""
    try:
        view = msgspec.json.decode(raw, type=_DescriptorView)
    except (msgspec.ValidationError, RecursionError):
        raise DescriptorInvalid(
            "missing engine identity: kv_transfer_params is not a JSON object",
            phase=Phase.PREFILL,
        ) from None
    engine_id = view.remote_engine_id
    if engine_id is msgspec.UNSET:
        _reject("missing engine identity: remote_engine_id is absent")
    if not isinstance(engine_id, str):
        _reject(f"missing engine identity: remote_engine_id is {_kind(engine_id)}, not a string")
    if not engine_id:
        _reject("missing engine identity: remote_engine_id is empty")
    problem = _block_ids_problem(view.remote_block_ids)
    if problem:
        _reject(f"malformed block ids: remote_block_ids {problem}")


def _reject(message: str) -> None:
    raise DescriptorInvalid(message, phase=Phase.PREFILL)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _block_id_problem(value: object) -> str | None:
    # bool is a subclass of int in Python; JSON true is not a block id.
    if type(value) is not int:
        return f"holds {_kind(value)} {value!r}, not a non-negative integer"
    if value < 0:
        return f"holds negative id {value}"
    return None


def _block_ids_problem(ids: object) -> str | None:
    if ids is msgspec.UNSET:
        return "is absent"
    if not isinstance(ids, list):
        return f"is {_kind(ids)}, not a list"
    if not ids:
        return "is empty"
    if valid_block_ids(ids):  # the answer for every good descriptor, without a loop here
        return None
    return block_ids_rule(ids)


def block_ids_rule(ids: list[Any]) -> str | None:
    """The first rule of contract 4.2 a non-empty list of block ids breaks, one id at a
    time (None: it breaks none, and ``valid_block_ids`` says so faster)."""
    if all(isinstance(group, list) for group in ids):
        if not any(ids):
            return "has only empty groups"
        for group in ids:
            for block in group:
                if problem := _block_id_problem(block):
                    return problem
        return None
    if any(isinstance(group, list) for group in ids):
        return "mixes flat ids and groups"
    for block in ids:
        if problem := _block_id_problem(block):
            return problem
    return None


def valid_block_ids(ids: list[Any]) -> bool:
    """Whether ``ids`` are good block ids: flat, or groups of them (one per KV cache group)
    with at least one not empty; what is wrong with them otherwise is
    ``_block_ids_problem``'s to say."""
    grouped = bool(ids) and isinstance(ids[0], list)  # vLLM's shape: one try, no exception
    try:
        msgspec.convert(ids, _GROUPED_IDS if grouped else _FLAT_IDS)
    except msgspec.ValidationError:
        return False
    return any(ids) if grouped else True


def _asks_usage(body: Mapping[str, Any]) -> bool:
    """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
