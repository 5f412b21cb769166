"""The fake engine's state (``EngineBase``): its counters, log, KV store and puller, its
slots and waiting queue, its prefix cache, KV-event publisher and LoRA adapter slots; the
waits tests use, its stats, and what every family of endpoints shares. The endpoints are
``completions`` and ``side_endpoints``; ``engine`` puts them together as ``FakeEngine``.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import trio

from narwhal.fake_engine import cost, kv_events, lora
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.faults import Fault, FaultQueue
from narwhal.fake_engine.http import Exchange, Request
from narwhal.fake_engine.kv_channel import KVPuller, KVStore
from narwhal.fake_engine.kv_publisher import KvEventPublisher

StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


class Network(Protocol):
    """Where an engine listens instead of sockets: the tests' in-memory network
    (``tests/support/memory_network.py``), so timing tests run under trio's MockClock."""

    def listen(self, host: str, port: int, handler: StreamHandler) -> None: ...
    def unlisten(self, host: str, port: int) -> None: ...
    async def open_stream(self, host: str, port: int) -> trio.abc.Stream: ...


class EngineBase:
    """The fake engine's state, and what its endpoints share: the log and the waits tests
    use, its stats, its prefix cache, a scripted refusal. ``FakeEngine`` is this with its
    endpoints (``Completions``, ``SideEndpoints``) and its serve loop."""

    def __init__(
        self, config: FakeEngineConfig | None = None, *, network: Network | None = None
    ) -> None:
        self.config = cfg = config or FakeEngineConfig()
        self.engine_id = cfg.engine_id or str(uuid.uuid4())
        self.counters: Counter[str] = Counter()
        self.store = KVStore(self.engine_id, cfg.kv_lease_s, self.counters)
        self.network = network
        self.puller = KVPuller(network.open_stream if network else None)
        self.host = cfg.host
        self._scope: trio.CancelScope | None = None
        self._connections: set[trio.CancelScope] = set()
        self.faults = FaultQueue()
        self.log: deque[dict[str, Any]] = deque(maxlen=cfg.log_size)
        self.url = ""
        self.kv_port = 0
        self.start_time = time.time()
        self.running = 0  # completions being answered, queued ones included
        self.waiting = 0  # of which queued for a slot
        self._queued = trio.Event()  # set as each request joins the queue
        self._began = trio.Event()  # set as each completion begins to be answered
        self._logged = trio.Event()  # set as each request joins the log
        # set when a stream has sent ``_streamed_goal`` tokens (``wait_streamed``)
        self._streamed: trio.Event | None = None
        self._streamed_goal = 0
        self._slots = trio.Semaphore(cfg.slots) if cfg.slots > 0 else None  # FIFO
        # prompts computed at once, within the slots (a decode batch can be wider than that)
        self._prefill_slots = trio.Semaphore(cfg.prefill_slots) if cfg.prefill_slots else None
        if cfg.kv_events_replay_endpoint and not cfg.kv_events_endpoint:
            raise ValueError("a KV-event replay endpoint needs a KV-event endpoint")
        self.kv_events: KvEventPublisher | None = None
        if cfg.kv_events_endpoint:
            self.kv_events = KvEventPublisher(
                cfg.kv_events_endpoint,
                cfg.kv_events_replay_endpoint,
                host=cfg.host,
                topic=cfg.kv_events_topic,
                encoding=cfg.kv_events_encoding,
                buffer_steps=cfg.kv_events_buffer_steps,
            )
        # with events on, the cache is on too: by default the whole KV cache (kv_events)
        blocks = cfg.prefix_cache_blocks or (cfg.kv_blocks if self.kv_events else 0)
        self.prefix_cache = cost.PrefixCache(blocks)
        self.blocks_running = 0  # KV blocks of admitted requests (with the cost model)
        self.computing = 0  # prompts being computed now (prefill interference)
        self.decoding = 0  # streams between their first token and their last (the batch)
        self._idle = trio.Event()
        self._idle.set()
        self.catalog = lora.Catalog(cfg.models or (cfg.model,))
        self.adapter_slots = lora.AdapterSlots(cfg.max_loras)
        # vllm:lora_requests_info, as vLLM exports it with LoRA enabled
        self.lora_info = (
            lora.InfoSeries(cfg.max_loras, self.start_time) if self.catalog.adapters else None
        )
        self._lora_changed = trio.Event()  # set as adapter slots change (waiters retry)

    async def wait_queued(self, n: int) -> None:
        """Return once ``n`` requests wait for a slot (tests: load from elsewhere)."""
        while self.waiting < n:
            await self._queued.wait()

    async def wait_running(self, n: int = 1) -> None:
        """Return once ``n`` completions are being answered (tests: a leg has begun)."""
        while self.running < n:
            await self._began.wait()

    async def wait_streamed(self, tokens: int) -> None:
        """Return once a stream has sent ``tokens`` tokens (tests: it is under way)."""
        self._streamed_goal, self._streamed = tokens, trio.Event()
        await self._streamed.wait()

    async def wait_logged(self, n: int) -> None:
        """Return once ``n`` requests are in the log (tests: a request has arrived)."""
        while len(self.log) < n:
            await self._logged.wait()

    def _note(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)
        self._logged.set()  # wake wait_logged, then arm for the next one
        self._logged = trio.Event()

    async def wait_idle(self) -> None:
        """Return once no completion is being answered (a cancelled leg has ended)."""
        await self._idle.wait()

    def stats(self) -> dict[str, Any]:
        self.store.expire()
        return {
            "engine_id": self.engine_id,
            "role": self.config.role,
            "counters": dict(self.counters),
            "kv_leases_active": len(self.store.leases),
            # of which handed out intact: KV pending a decode or a reclaim
            "kv_leases_pending": len(self.store.pending()),
            "running": self.running - self.waiting,
            "decoding": self.decoding,
            "waiting": self.waiting,
            "prefix_cache": {
                "capacity_blocks": self.prefix_cache.capacity,
                "blocks": len(self.prefix_cache.blocks),
                "queries": self.prefix_cache.queries,
                "hits": self.prefix_cache.hits,
                "evictions": self.prefix_cache.evictions,
            },
            "faults_queued": len(self.faults),
            **({"kv_events": self.kv_events.stats()} if self.kv_events else {}),
            **(self.adapter_slots.stats() if self.catalog.adapters else {}),
        }

    def reset_prefix_cache(self) -> None:
        """vLLM's ``POST /reset_prefix_cache``: every cached block dropped, and with KV
        events an ``AllBlocksCleared``."""
        self.prefix_cache.clear()
        self.counters["prefix_cache_resets"] += 1
        if self.kv_events is not None:
            self.kv_events.cleared()

    def _cache_insert(self, *token_lists: list[int], adapter: str | None = None) -> None:
        """Computed tokens (under ``adapter``, or the base model) join the prefix cache;
        their changes are one KV-event batch."""
        events: list[kv_events.Event] = []
        tag = None if adapter is None else (self.catalog.models[adapter].lora_id, adapter)
        for tokens in token_lists:
            change = self.prefix_cache.insert(tokens, adapter)
            if self.kv_events is not None:
                events += self.kv_events.stream.inserted(tokens, change, tag)
        if self.kv_events is not None:
            self.kv_events.publish(events)

    async def _refuse(self, fault: Fault, ex: Exchange) -> None:
        """Faults that strike before the engine does any work."""
        if fault.kind == "status":
            await ex.respond(
                fault.status, gen.error_body(fault.message, "ScriptedFault", fault.status)
            )
        elif fault.kind == "hang":
            await trio.sleep_forever()


async def object_body(req: Request, ex: Exchange) -> dict[str, Any] | None:
    """A request's JSON object, or None once answered 400 as vLLM answers it: not JSON
    (a body nested past the decoder's depth included: it must not end the engine), or
    not an object."""
    try:
        body = msgspec.json.decode(req.body)
    except (msgspec.DecodeError, RecursionError):
        await ex.respond(400, gen.error_body("Invalid JSON body", "Bad Request", 400))
        return None
    if not isinstance(body, dict):
        await ex.respond(400, gen.error_body("Body must be an object", "Bad Request", 400))
        return None
    return body
