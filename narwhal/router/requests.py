"""Client request validation (SPEC 3): msgspec structs over the fields the router acts on.

Everything else in the body passes through to the engines unchanged, except the reserved
fields: a top-level ``kv_transfer_params`` is dropped (only a producer may hand out a
descriptor) and ``vllm_xargs.kv_transfer_params`` is refused outright.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from narwhal.faults import Phase, RequestFault


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    best_of: int | None = None
    max_tokens: int | None = None
    vllm_xargs: dict[str, Any] | None = None


class CompletionFields(_Common, kw_only=True):
    prompt: str | list[str | int | list[int]]


class ChatFields(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class BadRequest(RequestFault):
    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, phase=Phase.ADMISSION)
        self.param = param

    def error_body(self) -> dict[str, object]:
        return {**super().error_body(), "param": self.param}


class ModelNotServed(RequestFault):
    status = 404
    kind = "not_found_error"


class ClientRequest(msgspec.Struct):
    endpoint: str
    chat: bool
    body: dict[str, Any]
    stream: bool
    include_usage: bool


_decode_any = msgspec.json.Decoder().decode
_PATH = re.compile(r"at `\$\.([^`\[]+)")


def parse_request(raw: bytes, *, endpoint: str, model: str) -> ClientRequest:
    """Validate a completion or chat body; raise BadRequest / ModelNotServed."""
    chat = endpoint.endswith("/chat/completions")
    try:
        body = _decode_any(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body: not valid JSON ({exc})", "body") from None
    except RecursionError:  # a JSON bomb: refuse it, never a 500
        raise BadRequest("body: JSON nested too deeply", "body") from None
    if not isinstance(body, dict):
        raise BadRequest(f"body: must be a JSON object, got {type(body).__name__}", "body")
    try:
        fields: _Common = msgspec.convert(body, ChatFields if chat else CompletionFields)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        param = match.group(1) if match else _missing_field(str(exc))
        raise BadRequest(f"{param}: {exc}", param) from None
    if fields.model != model:
        raise ModelNotServed(f"model '{fields.model}' is not served here", phase=Phase.ADMISSION)
    for name in ("n", "best_of"):
        value = getattr(fields, name)
        if value is not None and value > 1:
            raise BadRequest(
                f"cannot be split across prefill and decode: {name}={value} asks for several "
                "completions; send one request per completion",
                name,
            )
    if fields.vllm_xargs is not None and "kv_transfer_params" in fields.vllm_xargs:
        raise BadRequest(
            "vllm_xargs.kv_transfer_params: reserved; the router alone hands descriptors to "
            "engines",
            "vllm_xargs.kv_transfer_params",
        )
    body.pop("kv_transfer_params", None)
    options = fields.stream_options
    return ClientRequest(
        endpoint=endpoint,
        chat=chat,
        body=body,
        stream=bool(fields.stream),
        include_usage=bool(options and options.include_usage),
    )


def _missing_field(message: str) -> str:
    match = re.search(r"missing required field `([^`]+)`", message)
    return match.group(1) if match else "body"
