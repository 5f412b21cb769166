"""What an engine's LoRA adapter slots hold, as this router believes it, pure (docs/contract.md
4.7).

``vllm:lora_requests_info`` lists only the adapters with requests running or waiting, so an
engine whose requests have all ended reads as empty, though its slots still hold what ran
there last: vLLM evicts the least recently used adapter only when another one needs its
slot. ``RecentAdapters`` keeps, per engine, the adapters this router placed there or saw
running, most recent first; ``tier`` counts the slots the series does not list as holding
the most recent of them, and ranks what a request for an adapter costs the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from narwhal.core.engine_report import LoraInfo

# What a request for an adapter costs an engine, cheapest first:
LOADED = 0  # it runs there, waits there for a slot, or sits in an idle slot: no load
SLOT_FREE = 1  # a slot holds nothing: a load, no eviction
IDLE_SWAP = 2  # every slot is taken, one by an adapter nothing runs on: a swap, at once
# it runs there, but another adapter waits for the slot: the engine owes a swap, and more
# requests for the running adapter only put it off (vLLM runs them past the waiting one)
DRAINING = 3
SWAP = 4  # every slot's adapter runs or is waited for: a swap that waits for them to end
MAX_REMEMBERED = 128  # adapters kept per engine: more than any engine has slots for


class RecentAdapters:
    """The adapters this router placed on one engine or saw running there, by when.

    Placements are counted (``clock``), and the count when a scrape went out is its mark
    (``EngineState.scrape_mark``). An adapter a scrape saw running ranks after every
    placement made before that scrape went out and every scrape noted before it, and before
    every placement made after: a scrape that was under way while the router placed another
    adapter does not make what it saw newer than that placement, whose request may not have
    reached the engine yet.
    """

    __slots__ = ("_scrapes", "_used", "clock")

    def __init__(self) -> None:
        self.clock = 0  # placements noted so far
        self._scrapes = 0  # scrapes noted so far: they order scrapes of one mark
        self._used: dict[str, tuple[int, int]] = {}

    def placed(self, adapter: str) -> None:
        """A request for ``adapter`` is on its way to the engine."""
        self.clock += 1
        self._note(adapter, (self.clock, 0))

    def seen_running(self, adapters: Iterable[str], clock: int) -> None:
        """A scrape sent when ``clock`` placements had been noted saw ``adapters`` running."""
        self._scrapes += 1
        for adapter in adapters:
            self._note(adapter, (clock, self._scrapes))

    def recent(self) -> list[str]:
        """Most recent first."""
        return sorted(self._used, key=self._used.__getitem__, reverse=True)

    def forget(self) -> None:
        """The engine may have restarted: its slots hold nothing we know of."""
        self._used.clear()

    def _note(self, adapter: str, when: tuple[int, int]) -> None:
        self._used[adapter] = max(when, self._used.get(adapter, when))
        if len(self._used) > MAX_REMEMBERED:
            del self._used[min(self._used, key=self._used.__getitem__)]


def idle_held(lora: LoraInfo, recent: Sequence[str]) -> list[str]:
    """The adapters believed to sit in the slots the series does not list: the most recent
    of those it does not list, one per such slot."""
    listed = lora.loaded
    slots = lora.max_lora - len(listed)
    return [a for a in recent if a not in listed][: max(0, slots)]


def owes_swap(lora: LoraInfo) -> bool:
    """Another adapter waits for a slot: every slot's adapter is running and an adapter
    that is not waits (with a slot to spare, it would wait for the batch, not a slot)."""
    return bool(lora.waiting - lora.running) and len(lora.running) >= lora.max_lora


def tier(lora: LoraInfo, recent: Sequence[str], adapter: str) -> int:
    """What a request for ``adapter`` costs the engine whose series is ``lora`` and whose
    recent adapters are ``recent`` (``RecentAdapters.recent``), from ``LOADED`` to ``SWAP``.
    An adapter that only waits there counts as loaded: its requests join the load that is
    due rather than cause another."""
    if adapter in lora.running:
        return DRAINING if owes_swap(lora) else LOADED
    if adapter in lora.waiting:
        return LOADED
    idle = idle_held(lora, recent)
    if adapter in idle:
        return LOADED
    free = lora.max_lora - len(lora.loaded) - len(idle)
    if free > 0:
        return SLOT_FREE
    return IDLE_SWAP if idle else SWAP
