"""Comparing the router's answers with vLLM's own (the shape captures)."""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.stream.assemble import Assembler
from narwhal.stream.rules import Fault, Finish, StreamRelay

# what a non-streaming client must get whole (contract 3, "Completeness")
MESSAGE_FIELDS = ("role", "content", "reasoning_content", "refusal", "tool_calls")


CHOICE_FIELDS = ("index", "text", "logprobs", "finish_reason", "stop_reason")


# differ between any two runs, or between vLLM's streamed and non-streamed paths by design
VOLATILE = frozenset({"id", "created", "system_fingerprint"})


def fold(raw: bytes, *, chat: bool, model: str) -> dict[str, Any]:
    """A streamed answer folded by the router's Assembler (itself checked against vLLM's
    non-streaming answers below), or the error: the body, when it is not a stream, or the
    relay's error body on a fault."""
    if not raw.startswith(b"data:"):
        body: dict[str, Any] = msgspec.json.decode(raw)
        return body
    action = StreamRelay(Assembler(chat=chat, model=model)).feed(raw)
    if isinstance(action, Fault):
        return {"error": action.fault.error_body()}
    assert isinstance(action, Finish), raw[-300:]
    folded: dict[str, Any] = msgspec.json.decode(action.data)
    return folded


def unexplained(
    table: list[str],
    name: str,
    label: str,
    rows: list[tuple[str, bool, str]],
    known: dict[tuple[str, str], str],
) -> list[tuple[str, str]]:
    """Record the differential table's row in ``table``; the claimed fields that differ
    with no reason given in ``known`` ((shape, field) -> why)."""
    differ = [(f, d) for f, equal, d in rows if not equal]
    reasons = "; ".join(f"{f} ({known.get((name, f), d)})" for f, d in differ) or "-"
    table.append(f"| {label} | {len(rows)} | {len(rows) - len(differ)} | {reasons} |")
    print(table[-1])
    return [(f, d) for f, d in differ if claimed(f) and (name, f) not in known]


def tool_calls(calls: Any) -> Any:
    """Tool call ids are random per request: compare everything else."""
    if not isinstance(calls, list):
        return calls
    return [{k: v for k, v in c.items() if k != "id"} for c in calls]


def diff_answers(real: dict[str, Any], ours: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """(field, equal, detail) for every field of vLLM's answer and ours (None: an error)."""
    if "error" in real or ours is None or "error" in ours:
        both = ("error" in real) == (ours is None or "error" in ours)
        return [("answer", both, "an error either way" if both else "one side is an error")]
    rows: list[tuple[str, bool, str]] = []
    for key in sorted(set(real) | set(ours)):
        if key in VOLATILE or key == "choices":
            continue
        rows.append((key, real.get(key) == ours.get(key), _detail(real.get(key), ours.get(key))))
    for a, b in zip(real["choices"], ours["choices"], strict=False):
        for key in sorted(set(a) | set(b)):
            if key == "message":
                for field in sorted(set(a[key]) | set(b[key])):
                    x, y = a[key].get(field), b[key].get(field)
                    if field == "tool_calls":
                        x, y = tool_calls(x), tool_calls(y)
                    rows.append((f"choices[].message.{field}", x == y, _detail(x, y)))
            else:
                x, y = a.get(key), b.get(key)
                rows.append((f"choices[].{key}", x == y, _detail(x, y)))
    if len(real["choices"]) != len(ours["choices"]):
        rows.append(("choices", False, f"{len(real['choices'])} vs {len(ours['choices'])}"))
    return rows


def _detail(real: Any, ours: Any) -> str:
    if real == ours:
        return ""
    return f"vLLM {msgspec.json.encode(real)[:80]!r}, assembled {msgspec.json.encode(ours)[:80]!r}"


def claimed(field: str) -> bool:
    leaf = field.rsplit(".", 1)[-1]
    if field.startswith("choices[].message."):
        return leaf in MESSAGE_FIELDS
    if field.startswith("choices[]."):
        return leaf in CHOICE_FIELDS
    return field in ("usage", "model", "object", "answer", "choices")
