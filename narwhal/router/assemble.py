"""Non-streaming clients are served from a streamed decode: fold its chunks into one JSON."""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.engines.stream import Chunk


class Assembler:
    def __init__(self, *, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ""
        self.created = 0
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: Chunk) -> None:
        if chunk.id and not self.id:
            self.id, self.created = chunk.id, chunk.created or 0
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            if choice.text:
                self.parts.append(choice.text)
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    self.parts.append(delta.content)
                if delta.reasoning_content or delta.reasoning:
                    self.reasoning.append(delta.reasoning_content or delta.reasoning or "")
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
                self.stop_reason = choice.stop_reason

    def body(self) -> bytes:
        text = "".join(self.parts)
        choice: dict[str, Any]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason
        choice["stop_reason"] = self.stop_reason
        return msgspec.json.encode(
            {
                "id": self.id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage,
            }
        )
