"""The JSON shapes of a stream's payloads, as msgspec decodes them: only the fields the router
acts on. Kept pure Python (never compiled): a msgspec struct defined in a module mypyc compiles
loses its field types and its options (docs/build.md).
"""

from __future__ import annotations

from typing import Any

import msgspec


class Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None


class Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: Delta | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # vLLM's ``return_token_ids``: this chunk's generated ids, and (a completion's first
    # chunk) the prompt's; read only to continue a failed stream (``stream.continuation``)
    token_ids: Any = None
    prompt_token_ids: Any = None

    def is_output(self) -> bool:
        if self.text or self.finish_reason is not None:
            return True
        d = self.delta
        return d is not None and bool(
            d.content or d.reasoning_content or d.reasoning or d.tool_calls
        )


class ErrorObject(msgspec.Struct):
    message: Any = None
    type: Any = None
    code: Any = None


class Chunk(msgspec.Struct):
    id: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[Choice] = []
    usage: dict[str, Any] | None = None
    error: ErrorObject | None = None
    prompt_token_ids: Any = None  # a chat stream's first chunk, with ``return_token_ids``
    system_fingerprint: Any = None  # vLLM's, on the usage chunk (a continuation keeps it)
