"""Placement policies (contract 4.4), pure: load-aware choice and prefix affinity.

* ``least_loaded``: the lighter of two random candidates (power of two choices). A load is
  this router's in-flight legs on the engine plus the part of the engine's own queue, as
  last scraped, that is not ours (other routers, other clients; a scrape older than three
  intervals counts as nothing); a consumer's KV cache usage weighs in, since a consumer
  near a full cache stalls every pull.
* ``PrefixRing``: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
  2018) over the producers, keyed by the leading part of the prompt, so requests that share
  a prefix reach the producer that holds its KV cache, until it carries more than
  ``load_factor`` times the mean load (and ``AFFINITY_SLACK`` more than the lightest);
  then the next producer on the ring. Adding or
  removing a producer moves only the keys of its own arcs.

The trio shell (``narwhal.router.placer``) builds the views from fleet state and scrapes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

VNODES = 64  # points per producer on the ring: spreads each producer's share evenly
PREFIX_CHARS = 512  # the leading part of a prompt that keys affinity (a system prompt)
KV_WEIGHT = 8.0  # a consumer's full KV cache weighs as much as this many queued requests
AFFINITY_SLACK = 4  # requests a prefix's home may carry over the lightest before spilling
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One candidate as placement sees it."""

    id: str
    inflight: int  # this router's legs on it
    others: float = 0.0  # the engine's queue that is not ours, from a fresh scrape (else 0)
    kv_usage: float = 0.0  # 0..1, from a fresh scrape (else 0)

    def cost(self, *, consumer: bool) -> float:
        return self.inflight + self.others + (KV_WEIGHT * self.kv_usage if consumer else 0.0)


def least_loaded(candidates: Sequence[T], rng: random.Random, rank: Callable[[T], Any]) -> T | None:
    """Power of two choices: two distinct random candidates, the one of lower ``rank``
    wins (with two or fewer candidates, the lowest of all)."""
    if len(candidates) <= 2:
        return min(candidates, key=rank, default=None)
    a, b = rng.sample(range(len(candidates)), 2)
    return min(candidates[a], candidates[b], key=rank)


def prefix_key(body: Mapping[str, Any], *, chat: bool) -> str:
    """The leading part of what the producer computes first: the prompt, or the messages
    as sent (roles and text), cut at ``PREFIX_CHARS``."""
    if chat:
        parts = []
        for message in body.get("messages") or ():
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):
                    content = " ".join(
                        str(p.get("text", "")) for p in content if isinstance(p, dict)
                    )
                parts.append(f"{message.get('role', '')}:{content}")
            if sum(map(len, parts)) >= PREFIX_CHARS:
                break
        return "\n".join(parts)[:PREFIX_CHARS]
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt[:PREFIX_CHARS]))
    return str(prompt or "")[:PREFIX_CHARS]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest())


class PrefixRing:
    """A consistent-hash ring of producer ids (``VNODES`` points each)."""

    def __init__(self, ids: Sequence[str]) -> None:
        points = sorted((_hash(f"{pid}#{v}"), pid) for pid in set(ids) for v in range(VNODES))
        self._hashes = [h for h, _ in points]
        self._ids = [pid for _, pid in points]
        self.ids = frozenset(ids)

    def order(self, key: str) -> list[str]:
        """Every producer once, in ring order from the key's point."""
        if not self._ids:
            return []
        start = bisect.bisect(self._hashes, _hash(key)) % len(self._ids)
        seen: dict[str, None] = {}
        for i in range(len(self._ids)):
            pid = self._ids[(start + i) % len(self._ids)]
            seen.setdefault(pid, None)
            if len(seen) == len(self.ids):
                break
        return list(seen)

    def choose(
        self, key: str, loads: Mapping[str, float], load_factor: float
    ) -> tuple[str | None, bool]:
        """(producer, spilled): the key's home producer unless its load passes the bound,
        then the next on the ring under it. Only producers in ``loads`` (the placeable
        ones) are taken."""
        placeable = [pid for pid in self.order(key) if pid in loads]
        if not placeable:
            return None, False
        limit = bound([loads[pid] for pid in placeable], load_factor)
        for i, pid in enumerate(placeable):
            if loads[pid] + 1 <= limit:
                return pid, i > 0
        return min(placeable, key=lambda pid: loads[pid]), True


def bound(loads: Sequence[float], load_factor: float) -> float:
    """The most a producer may carry, this request included, and keep its prefixes:
    ``ceil(load_factor * (total + 1) / n)`` (bounded loads), but never under the lightest
    producer's load plus ``AFFINITY_SLACK``. At low load the multiplicative bound alone
    spills at 2 against 0, and every spill is a full prefill on a producer without the
    prefix, which also evicts that producer's own prefixes: a few queued requests cost
    less than that (vllm-router's cache_aware pairs a relative and an absolute threshold
    the same way)."""
    relative = math.ceil(load_factor * (sum(loads) + 1) / len(loads))
    return max(relative, min(loads) + AFFINITY_SLACK)
