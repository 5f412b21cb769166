"""Hypothesis strategies for decode streams, shared by the stream-model and relay properties."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from tests.support.fleet import MODEL


@dataclass(frozen=True)
class Event:
    kind: str  # token | usage | comment | error | garbage | done
    text: str = ""
    code: Any = None

    def frame(self) -> bytes:
        if self.kind == "comment":
            return b": keep-alive\n\n"
        if self.kind == "garbage":
            return b"data: {not json\n\n"
        if self.kind == "done":
            return b"data: [DONE]\n\n"
        if self.kind == "error":
            error = {"message": self.text, "type": "X", "param": None, "code": self.code}
            return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
        chunk: dict[str, Any] = {"id": "cmpl-x", "object": "text_completion", "model": MODEL}
        if self.kind == "token":
            chunk["choices"] = [{"index": 0, "text": self.text, "finish_reason": None}]
        else:
            chunk["choices"] = []
            chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


events = st.one_of(
    st.builds(Event, st.just("token"), st.sampled_from(["a", "bc", " d", "é"])),
    st.builds(Event, st.sampled_from(["usage", "comment", "garbage", "done"])),
    st.builds(
        Event,
        st.just("error"),
        st.sampled_from(["boom", "over capacity"]),
        st.sampled_from([None, 500, 503, 429, 400, 404, 700, "oops"]),
    ),
)
