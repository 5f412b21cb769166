"""vLLM's KV-event wire, written by hand for tests: batches of map- or array-tagged events,
framed as the engine's PUB socket sends them."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.msgpack.encode


def stored(
    hashes: list[Any],
    parent: Any,
    token_ids: list[int],
    block_size: int = 4,
    lora_name: str | None = None,
    *,
    array: bool = False,
) -> Any:
    if array:
        return ["BlockStored", hashes, parent, token_ids, block_size, None, "GPU", lora_name]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora_name,
    }


def removed(hashes: list[Any], *, array: bool = False) -> Any:
    if array:
        return ["BlockRemoved", hashes, "GPU"]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def cleared(*, array: bool = False) -> Any:
    return ["AllBlocksCleared"] if array else {"type": "AllBlocksCleared"}


def batch(*events: Any, ts: float = 1.0) -> bytes:
    return _encode([ts, list(events), 0])


def frames(seq: int, payload: bytes, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big", signed=True), payload]


def chain(token_ids: list[int], block_size: int, first_hash: int = 1000) -> list[int]:
    """Engine hashes for the full blocks of ``token_ids``: arbitrary, as vLLM's are to us."""
    return [first_hash + i for i in range(len(token_ids) // block_size)]
