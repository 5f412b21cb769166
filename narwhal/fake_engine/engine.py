"""A stand-in for a vLLM 0.32 OpenAI server with NixlConnector, faithful to its wire format.

Start it in-process with ``url = await nursery.start(engine.serve)`` or from the shell with
``narwhal fake-engine --port N``. Observability for tests: ``engine.counters``,
``engine.log`` (recent request bodies and backend ids), ``engine.store.events``; over HTTP:
``GET /fake/stats``, ``GET /fake/log``, ``POST /fake/faults``.

With ``kv_events_endpoint`` set it publishes its prefix cache's changes as vLLM's KV events
(``kv_events``: ZMQ, replay, ``GET /kv_event_sources``, ``POST /reset_prefix_cache``, and
the fault knobs of ``POST /fake/kv_events``); ``engine.kv_events`` is then the publisher.

An optional cost model (``cost``: slots and a FIFO queue, prefill time per uncached prompt
token, a prefix cache on every role, a KV pull's time per block the consumer does not hold,
prefill interference on running streams, a slowdown) makes load, prefix placement and
conditional disaggregation measurable; its options default to off, and the engine is then
as instant as ever.

With ``models`` it serves a base model, its aliases and LoRA adapters (``lora``): their model
list, an adapter's own text, ``max_loras`` adapter slots (swaps, a queue for a slot) and
``vllm:lora_requests_info``; prefix-cache blocks and KV events per adapter, and no KV pulled
across models.
"""

from __future__ import annotations

import contextlib
import itertools
import secrets
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal, Protocol

import msgspec
import trio

from narwhal.fake_engine import answers, asks, cost, kv_events, lora
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.faults import Fault, FaultQueue
from narwhal.fake_engine.http import Exchange, Request, serve_connection
from narwhal.fake_engine.kv_channel import KVPuller, KVStore, PullRequest
from narwhal.fake_engine.kv_publisher import KvEventPublisher
from narwhal.fake_engine.samples import samples

VERSION = "0.32.0"
_FAULT_LIST = msgspec.json.Decoder(list[Fault])


StreamHandler = Callable[[trio.abc.Stream], Awaitable[None]]


class Network(Protocol):
    """Where an engine listens instead of sockets: the tests' in-memory network
    (``tests/support/memory_network.py``), so timing tests run under trio's MockClock."""

    def listen(self, host: str, port: int, handler: StreamHandler) -> None: ...
    def unlisten(self, host: str, port: int) -> None: ...
    async def open_stream(self, host: str, port: int) -> trio.abc.Stream: ...


class FakeEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "fake-model"
    # served names (``lora.Catalog``): "name" (the first: the base model, others its
    # aliases) or "name:parent" (a LoRA adapter); empty: ``model`` alone
    models: tuple[str, ...] = ()
    max_loras: int = 1  # adapters loaded at once (vLLM's --max-loras)
    lora_swap_ms: float | None = None  # an adapter's load; None: 0, or a default with costs
    role: Literal["prefill", "decode", "both"] = "both"
    engine_id: str = ""  # NIXL engine id; a fresh uuid when empty
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int = 0  # side channel (remote_port in descriptors); ephemeral when 0
    itl_s: float = 0.0  # delay between generated tokens
    # tokens per streamed chunk, taken in turn (0: a token whose text waits for the next
    # chunk); empty: one per chunk. Plain streams only (the benchmarks' path)
    chunk_tokens: tuple[int, ...] = ()
    prefill_delay_per_token_s: float = 0.0  # prompt computation time per uncached token
    kv_lease_s: float = 30.0  # how long a producer holds blocks nobody pulled
    kv_blocks: int = 4096  # the KV cache, in 16-token blocks (vllm:kv_cache_usage_perc)
    transfer_delay_s: float = 0.0  # how long pulling the KV blocks takes on a consumer
    max_model_len: int = 32768
    default_max_tokens: int = 16
    log_size: int = 512
    # the cost model (narwhal.fake_engine.cost), off by default
    slots: int = 0  # requests computed at once, the rest queue (0: unlimited)
    prefill_ms_per_token: float = 0.0  # per uncached prompt token, added to the delay above
    prefix_cache_blocks: int = 0  # LRU of 16-token prompt blocks (0: no prefix cache)
    kv_ms_per_block: float = 0.0  # per pulled block not cached, added to transfer_delay_s
    # while prompts are computed here, streams' itl x (1 + this x the prompts computing)
    prefill_interference: float = 0.0
    slowdown: float = 1.0  # multiplier on prefill time and itl_s
    # KV events (narwhal.fake_engine.kv_events), off without an endpoint
    kv_events_endpoint: str = ""  # the PUB: "*" or port 0 binds, any other connects
    kv_events_replay_endpoint: str = ""  # the replay ROUTER, always bound
    kv_events_topic: str = "kv"
    kv_events_encoding: Literal["map", "array"] = "map"
    kv_events_buffer_steps: int = kv_events.DEFAULT_BUFFER_STEPS  # batches kept for replay

    @property
    def cost_model(self) -> bool:
        """Whether any of the cost model's options is on."""
        costs = (self.prefill_ms_per_token, self.kv_ms_per_block, self.prefill_interference)
        return bool(self.slots or self.prefix_cache_blocks or any(costs)) or self.slowdown != 1.0

    @property
    def lora_swap_s(self) -> float:
        """How long loading an adapter into a slot takes: ``lora_swap_ms``, or by default
        instant, and ``lora.DEFAULT_COST_SWAP_MS`` with the cost model on."""
        if self.lora_swap_ms is not None:
            return self.lora_swap_ms / 1000
        return lora.DEFAULT_COST_SWAP_MS / 1000 if self.cost_model else 0.0


class FakeEngine:
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
        self._idle = trio.Event()
        self._idle.set()
        self.catalog = lora.Catalog(cfg.models or (cfg.model,))
        self.adapter_slots = lora.AdapterSlots(cfg.max_loras)
        # vllm:lora_requests_info, as vLLM exports it with LoRA enabled
        self.lora_info = (
            lora.InfoSeries(cfg.max_loras, self.start_time) if self.catalog.adapters else None
        )
        self._lora_changed = trio.Event()  # set as adapter slots change (waiters retry)

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on loopback until ``stop()``; a restart reuses the same ports."""
        cfg = self.config
        port = self.url.rsplit(":", 1)[1] if self.url else cfg.port
        listeners = await trio.open_tcp_listeners(int(port), host=cfg.host)
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                if self.kv_events is not None:
                    self.prefix_cache.clear()  # a new engine's cache is empty, seq from 0
                    await nursery.start(self.kv_events.serve)
                self.kv_port = await nursery.start(
                    self.store.serve, cfg.host, self.kv_port or cfg.kv_port
                )
                self.url = f"http://{cfg.host}:{listeners[0].socket.getsockname()[1]}"
                self.start_time = time.time()
                nursery.start_soon(trio.serve_listeners, self.serve_stream, listeners)
                task_status.started(self.url)
        finally:
            with trio.CancelScope(shield=True):
                await self.puller.aclose()
                for listener in listeners:
                    await listener.aclose()

    def attach(self, host: str, port: int = 80, kv_port: int = 5600) -> str:
        """Serve on the in-memory network instead of sockets (timing tests)."""
        assert self.network is not None, "FakeEngine(network=...) is needed for attach()"
        self.host, self.kv_port = host, kv_port
        self.url = f"http://{host}:{port}"
        self.network.listen(host, port, self.serve_stream)
        self.network.listen(host, kv_port, self.store.serve_stream)
        return self.url

    def stop(self) -> None:
        """Stop answering (connections refused, open ones dropped), as a dead engine does."""
        if self.network is not None:
            host, port = self.url.removeprefix("http://").rsplit(":", 1)
            self.network.unlisten(host, int(port))
            self.network.unlisten(host, self.kv_port)
        if self._scope is not None:
            self._scope.cancel()
        for scope in self._connections:
            scope.cancel()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Answer HTTP/1.1 on one connection until it closes or the engine stops."""
        self.counters["connections"] += 1
        with trio.CancelScope() as scope:
            self._connections.add(scope)
            try:
                await serve_connection(stream, self.handle)
            finally:
                self._connections.discard(scope)

    # ---- routing -------------------------------------------------------------------------

    async def handle(self, req: Request, ex: Exchange) -> None:
        self.counters["http_requests"] += 1
        route = (req.method, req.path.split("?", 1)[0])
        if route == ("POST", "/v1/completions"):
            await self._completion(req, ex, chat=False)
        elif route == ("POST", "/v1/chat/completions"):
            await self._completion(req, ex, chat=True)
        elif route == ("POST", "/tokenize"):
            await self._tokenize(req, ex)
        elif route == ("POST", "/detokenize"):
            await self._detokenize(req, ex)
        elif route == ("GET", "/health"):
            await ex.respond(200, b"")
        elif route == ("GET", "/version"):
            await ex.respond(200, msgspec.json.encode({"version": VERSION}))
        elif route == ("GET", "/v1/models"):
            await ex.respond(200, self._models())
        elif route == ("GET", "/metrics"):
            await ex.respond(200, self._metrics(), b"text/plain; version=0.0.4; charset=utf-8")
        elif route == ("GET", "/fake/stats"):
            await ex.respond(200, msgspec.json.encode(self.stats()))
        elif route == ("GET", "/fake/log"):
            events = {"requests": list(self.log), "kv_events": self.store.events}
            await ex.respond(200, msgspec.json.encode(events))
        elif route == ("POST", "/fake/faults"):
            await self._push_faults(req, ex)
        elif route == ("DELETE", "/fake/faults"):
            self.faults.clear()
            await ex.respond(200, b"{}")
        elif route == ("POST", "/reset_prefix_cache"):
            self.reset_prefix_cache()
            await ex.respond(200, b"")
        elif route == ("GET", "/kv_event_sources") and self.kv_events is not None:
            # vLLM 0.32 answers its KVEventsConfig per data-parallel rank
            await ex.respond(200, msgspec.json.encode({"0": self.kv_events.sources()}))
        elif route == ("POST", "/fake/kv_events") and self.kv_events is not None:
            await self._kv_knobs(req, ex, self.kv_events)
        else:
            await ex.respond(404, b'{"detail":"Not Found"}')

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

    async def _kv_knobs(self, req: Request, ex: Exchange, publisher: KvEventPublisher) -> None:
        """``POST /fake/kv_events``: the fault knobs of the event stream (kv_events)."""
        try:
            knobs = kv_events.KNOBS.decode(req.body)
        except msgspec.MsgspecError as exc:
            await ex.respond(400, gen.error_body(str(exc), "BadRequestError", 400))
            return
        if knobs.restart:
            self.prefix_cache.clear()  # as a restarted engine's: empty, and no event says so
        await publisher.apply(knobs)
        await ex.respond(200, msgspec.json.encode(publisher.stats()))

    async def _push_faults(self, req: Request, ex: Exchange) -> None:
        try:
            faults = _FAULT_LIST.decode(req.body)
        except msgspec.MsgspecError as exc:
            await ex.respond(400, gen.error_body(str(exc), "BadRequestError", 400))
            return
        self.faults.push(*faults)
        await ex.respond(200, msgspec.json.encode({"queued": len(self.faults)}))

    async def _tokenize(self, req: Request, ex: Exchange) -> None:
        """vLLM's ``/tokenize`` of a ``prompt`` or of chat ``messages``: count, max_model_len
        and the prompt's token ids as the cost model has them (``cost.prompt_tokens``: the
        ids whose blocks the prefix cache holds and KV events publish), their text with
        ``return_token_strs``."""
        self._log_side_request(req)
        body = await self._side_body(req, ex)
        if body is None:
            return
        chat = "messages" in body
        tokens = cost.prompt_tokens(body, chat)
        strs = cost.token_strs(body, chat) if body.get("return_token_strs") is True else None
        reply = {
            "count": len(tokens),
            "max_model_len": self.config.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
        await ex.respond(200, msgspec.json.encode(reply))

    async def _detokenize(self, req: Request, ex: Exchange) -> None:
        """vLLM's ``/detokenize``: ``{"prompt": text}``. The fake's ids are word hashes, so
        the text is the vocabulary's words for them: deterministic, not the inverse."""
        self._log_side_request(req)
        body = await self._side_body(req, ex)
        if body is None:
            return
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            msg = "1 validation error:\n  body.tokens: Input should be a list of integers >= 0"
            await ex.respond(400, gen.error_body(msg, "Bad Request", 400, "body.tokens"))
            return
        text = "".join(gen.VOCAB[t % len(gen.VOCAB)] for t in tokens)
        await ex.respond(200, msgspec.json.encode({"prompt": text}))

    def _log_side_request(self, req: Request) -> None:
        """``/tokenize`` and ``/detokenize`` in the log, as legs are: what the router sent."""
        self._note(
            {
                "path": req.path,
                "request_id": req.headers.get("x-request-id", ""),
                "body": None,
                "traceparent": req.headers.get("traceparent"),
                "tracestate": req.headers.get("tracestate"),
            }
        )

    async def _side_body(self, req: Request, ex: Exchange) -> dict[str, Any] | None:
        """The body of a ``/tokenize`` or ``/detokenize``, checked as vLLM checks it (None:
        answered with the error already)."""
        body = await _object_body(req, ex)
        if body is None:
            return None
        model = body.get("model")
        if model is not None and not self.catalog.serves(model):
            msg = self.catalog.not_found(model)
            await ex.respond(404, gen.error_body(msg, "NotFoundError", 404, "model"))
            return None
        self.counters[req.path.strip("/")] += 1
        fault = self.faults.take("tokenize")
        if fault is None:
            return body
        self.counters[f"fault_{fault.kind}"] += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                await self._refuse(fault, ex)
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            ex.disconnected = True  # a write lost the race with the watcher
        return None

    def _models(self) -> bytes:
        """vLLM's model list: a card per name of the base model (its root the model's
        path: here its name), then one per adapter (its parent the base, its root the
        adapter's directory: here its name; and, as in vLLM, no max_model_len)."""
        created = int(self.start_time)
        cards = []
        for model in self.catalog.models.values():
            adapter = model.parent is not None
            permission = {
                "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, model.name).hex}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            cards.append(
                {
                    "id": model.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": model.name if adapter else self.catalog.base,
                    "parent": model.parent,
                    "max_model_len": None if adapter else self.config.max_model_len,
                    "permission": [permission],
                }
            )
        return msgspec.json.encode({"object": "list", "data": cards})

    def _metrics(self) -> bytes:
        c, label = self.counters, f'{{model_name="{self.catalog.base}"}}'
        pulled_bytes = c["kv_blocks_pulled"] * cost.KV_BYTES_PER_BLOCK  # nominal, see cost
        lines = [
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.start_time:.3f}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running - self.waiting}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} {self.waiting}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {self._kv_usage():.6f}",
            # the cache its KV events describe, as vLLM labels its cache config
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{cost.BLOCK_TOKENS}",'
            f'num_gpu_blocks="{self.prefix_cache.capacity or self.config.kv_blocks}"}} 1.0',
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {c['prompt_tokens']}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {c['generation_tokens']}",
            # counted in prompt tokens, as vLLM does; 0 without a prefix cache
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} {self.prefix_cache.queries}",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} {self.prefix_cache.hits}",
            # a transfer moves at least one block; a pull the prefix cache holds whole moves
            # none and is not one (vLLM then only notifies the producer)
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            f"vllm:nixl_xfer_time_seconds_count{label} {c['kv_transfers']}",
            "# TYPE vllm:nixl_bytes_transferred histogram",
            f"vllm:nixl_bytes_transferred_sum{label} {pulled_bytes}",
            f"vllm:nixl_bytes_transferred_count{label} {c['kv_transfers']}",
            "# TYPE vllm:nixl_num_failed_transfers counter",
            f"vllm:nixl_num_failed_transfers_total{label} {c['kv_pull_failed']}",
        ]
        if self.lora_info is not None:
            lines += self.lora_info.lines(time.time())
        return ("\n".join(lines) + "\n").encode()

    def _kv_usage(self) -> float:
        """The fraction of the KV cache that leases hold, and with the cost model also the
        prompts of admitted requests (vLLM's 0..1, despite the name). Prefix-cached blocks
        nobody uses count as free, as in vLLM."""
        held = self.store.blocks_held() + self.blocks_running
        return min(1.0, held / max(1, self.config.kv_blocks))

    # ---- completions ---------------------------------------------------------------------

    async def _completion(self, req: Request, ex: Exchange, *, chat: bool) -> None:
        self.counters["chat" if chat else "completions"] += 1
        body = await _object_body(req, ex)
        if body is None:
            return
        backend_id = req.headers.get("x-request-id", "")
        # one entry per leg: what the fault matrix reconciles against the client and journal
        entry: dict[str, Any] = {
            "path": req.path,
            "request_id": backend_id,
            "body": body,
            "start": trio.current_time(),
            "end": None,
            "tokens": 0,
            "disconnected": False,
            # the W3C trace context the leg carried (the router's spans, or the client's)
            "traceparent": req.headers.get("traceparent"),
            "tracestate": req.headers.get("tracestate"),
        }
        self._note(entry)
        # a reclaim leg's scripted fault strikes before the check that refuses it
        reclaim = self.faults.take("reclaim") if backend_id.endswith("-reclaim") else None
        problem = None if reclaim is not None else self._validate(body, chat)
        if problem is not None:
            await self._release_refused(body)
            await ex.respond(problem[0], problem[1])
            return
        kv = body.get("kv_transfer_params")
        leg: Literal["prefill", "decode"] = (
            "prefill" if isinstance(kv, dict) and kv.get("do_remote_decode") is True else "decode"
        )
        fault = reclaim or self.faults.take(leg)
        if fault is not None:
            self.counters[f"fault_{fault.kind}"] += 1
        if not self.running:
            self._idle = trio.Event()
        self.running += 1
        self._began.set()  # wake wait_running, then arm for the next one
        self._began = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                if fault is not None and fault.kind in ("status", "hang"):
                    await self._refuse(fault, ex)
                else:
                    async with self._adapter_loaded(body), self._admitted(body, chat):
                        await self._generate(
                            body, backend_id, ex, chat=chat, leg=leg, fault=fault, entry=entry
                        )
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            # a write lost the race with the watcher: the client is gone all the same
            ex.disconnected = True
        finally:
            self.running -= 1
            if not self.running:
                self._idle.set()
            entry["end"] = trio.current_time()
            entry["disconnected"] = ex.disconnected
            if ex.disconnected:
                self.counters[f"{leg}_disconnects"] += 1

    def _validate(self, body: dict[str, Any], chat: bool) -> tuple[int, bytes] | None:
        """The same checks (and error bodies) as vLLM's OpenAI server, for what we model."""
        model = body.get("model")
        if not self.catalog.serves(model):
            return 404, gen.error_body(self.catalog.not_found(model), "NotFoundError", 404, "model")
        max_tokens = body.get("max_completion_tokens" if chat else "max_tokens")
        if max_tokens is None and chat:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            msg = f"1 validation error:\n  body.max_tokens: invalid value {max_tokens!r}"
            return 400, gen.error_body(msg, "Bad Request", 400, "body.max_tokens")
        limit = self.config.max_model_len
        if isinstance(max_tokens, int) and max_tokens > limit:
            msg = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
            )
            return 400, gen.error_body(msg, "BadRequestError", 400, "max_tokens")
        _, prompt_tokens = gen.prompt_of(body, chat)
        if prompt_tokens > limit:
            # as real vLLM 0.32 answers (seen through the router by make e2e-vllm;
            # tests/captures/err_context_length.json): it stops counting at limit + 1
            over = limit + 1
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {over} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={over})"
            )
            return 400, gen.error_body(msg, "BadRequestError", 400)
        if prompt_tokens + (max_tokens or 1) > limit:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_tokens} input tokens. Please reduce the length of the input."
            )
            return 400, gen.error_body(msg, "BadRequestError", 400, "prompt")
        kv = body.get("kv_transfer_params")
        if kv is not None and not isinstance(kv, dict):
            msg = (
                "1 validation error:\n  body.kv_transfer_params: Input should be a valid dictionary"
            )
            return 400, gen.error_body(msg, "Bad Request", 400, "body.kv_transfer_params")
        if body.get("prompt_logprobs") is not None and body.get("stream") is True:
            # tests/captures/shapes/completion_prompt_logprobs.sse
            msg = (
                "`prompt_logprobs` are not available when `stream=True`. "
                "(parameter=prompt_logprobs)"
            )
            return 400, gen.error_body(msg, "BadRequestError", 400, "prompt_logprobs")
        n, temperature = body.get("n"), body.get("temperature")
        greedy = isinstance(temperature, int | float) and temperature < asks.GREEDY_BELOW
        if type(n) is int and n > 1 and greedy:
            # tests/captures/shapes/completion_n2_greedy.json
            msg = f"n must be 1 when using greedy sampling, got {n}."
            return 400, gen.error_body(msg, "BadRequestError", 400)
        return None

    def _served(self, body: dict[str, Any]) -> str:
        """The served name a request asks for (a reclaim leg is not checked: the base)."""
        model = body.get("model")
        return model if isinstance(model, str) and self.catalog.serves(model) else self.catalog.base

    @contextlib.asynccontextmanager
    async def _adapter_loaded(self, body: dict[str, Any]) -> AsyncIterator[None]:
        """Under a LoRA adapter, hold it in one of ``max_loras`` slots while answering
        (``lora.AdapterSlots``): a request whose adapter is not loaded takes a free slot or
        the least recently used idle adapter's (a swap), and pays ``lora_swap_s``; with
        every slot's adapter running, it waits (in ``waiting`` and
        ``waiting_lora_adapters``). The base model needs no slot."""
        adapter = self.catalog.adapter(self._served(body))
        if adapter is None:
            yield
            return
        slots = self.adapter_slots
        ticket = slots.arrive(adapter)
        grant = slots.admit(ticket)
        if grant is None:
            self._lora_note()
            self.waiting += 1
            self._queued.set()  # wake wait_queued, then arm for the next arrival
            self._queued = trio.Event()
            try:
                while grant is None:
                    await self._lora_changed.wait()
                    grant = slots.admit(ticket)
            finally:
                self.waiting -= 1
                if grant is None:  # the client left while it waited
                    slots.leave(ticket)
                    self._lora_note()
        self._lora_note()
        if grant.evicted is not None:
            self.counters["lora_swaps"] += 1
        try:
            if grant.load:
                self.counters["lora_loads"] += 1
                if self.config.lora_swap_s > 0:
                    await trio.sleep(self.config.lora_swap_s)
            yield
        finally:
            slots.release(adapter)
            self._lora_note()

    def _lora_note(self) -> None:
        """The adapter slots changed: the gauge's labels follow, and waiters retry."""
        if self.lora_info is not None:
            self.lora_info.note(self.adapter_slots.labels(), time.time())
        self._lora_changed.set()
        self._lora_changed = trio.Event()

    @contextlib.asynccontextmanager
    async def _admitted(self, body: dict[str, Any], chat: bool) -> AsyncIterator[None]:
        """Hold one of ``slots`` while answering (the prefill, or the KV pull and the decode
        stream); beyond them wait in FIFO order, counted in ``waiting`` (a client that
        leaves while queued leaves the queue). With the cost model an admitted request's
        prompt blocks count in ``vllm:kv_cache_usage_perc``."""
        if self._slots is not None:
            self.waiting += 1
            self._queued.set()  # wake wait_queued, then arm for the next arrival
            self._queued = trio.Event()
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
        blocks = 0
        if self.config.cost_model:
            blocks = -(-gen.prompt_of(body, chat)[1] // cost.BLOCK_TOKENS)
        self.blocks_running += blocks
        try:
            yield
        finally:
            self.blocks_running -= blocks
            if self._slots is not None:
                self._slots.release()

    async def _refuse(self, fault: Fault, ex: Exchange) -> None:
        """Faults that strike before the engine does any work."""
        if fault.kind == "status":
            await ex.respond(
                fault.status, gen.error_body(fault.message, "ScriptedFault", fault.status)
            )
        elif fault.kind == "hang":
            await trio.sleep_forever()

    async def _generate(
        self,
        body: dict[str, Any],
        backend_id: str,
        ex: Exchange,
        *,
        chat: bool,
        leg: Literal["prefill", "decode"],
        fault: Fault | None,
        entry: dict[str, Any],
    ) -> None:
        cfg = self.config
        _, prompt_tokens = gen.prompt_of(body, chat)
        resp_id = ("chatcmpl-" if chat else "cmpl-") + (backend_id or secrets.token_hex(8))
        model = self._served(body)  # echoed, as vLLM echoes an adapter's name
        adapter = self.catalog.adapter(model)
        shapes = gen.Shapes(resp_id, model, chat)
        stream = body.get("stream") is True
        kv = body.get("kv_transfer_params")
        remote = isinstance(kv, dict) and kv.get("do_remote_prefill") is True
        if not await self._prompt(body, chat, prompt_tokens, kv if remote else None, model):
            await self._transfer_failed(ex, stream)
            return
        self.counters["prompt_tokens"] += prompt_tokens
        produce = leg == "prefill" and not stream and cfg.role != "decode"
        if produce:
            self.counters["prefill"] += 1
        ask = asks.ask_of(body, chat, cfg.default_max_tokens, cfg.max_model_len, adapter=adapter)
        # a decode's reply joins the prefix cache once it is whole (vLLM caches the output)
        remember = leg == "decode" and self.prefix_cache.enabled
        if stream:
            finished = fault is None or fault.kind == "slow_drip"
            plan, replies = self._stream_plan(ask, shapes, prompt_tokens, finished)
            if await self._stream(shapes, plan, prompt_tokens, ex, fault, entry) and remember:
                self._remember_replies(body, chat, replies, adapter)
            return
        issued = None
        if produce:
            issued = self._produce(resp_id, prompt_tokens, chat, backend_id, model)
        descriptor = issued
        if issued is not None and fault is not None:
            descriptor = _corrupt(issued, fault)
        choices = samples(ask)
        tokens = sum(len(c.tokens) for c in choices)
        self.counters["generation_tokens"] += tokens
        response = answers.full(ask, shapes, choices, descriptor)
        if fault is not None and fault.kind == "close_mid_body":
            await ex.respond_partial(200, response)
            return
        await ex.respond(200, response)
        entry["tokens"] = tokens
        if issued is not None and descriptor is issued:
            self.store.delivered(issued["remote_request_id"])
        if remember:
            replies = [(c.prompt.text, c.text) for c in choices]
            self._remember_replies(body, chat, replies, adapter)

    def _stream_plan(
        self, ask: asks.Ask, shapes: gen.Shapes, prompt_tokens: int, finished: bool
    ) -> tuple[answers.StreamPlan, list[tuple[str, str]]]:
        """The stream's frames, and each choice's (prompt text, reply) as the client reads it."""
        if not ask.plain:
            choices = samples(ask)
            replies = [(c.prompt.text, c.text) for c in choices]
            return answers.stream_plan(ask, shapes, choices), replies
        [prompt] = ask.prompts
        ids = gen.reply_ids(prompt.ids, ask.max_tokens, ask.key(0), unlimited=ask.unlimited)
        plan = answers.plain_plan(
            ask,
            shapes,
            ids,
            finished=finished,
            prompt_tokens=prompt_tokens,
            chunk_tokens=self.config.chunk_tokens,
        )
        return plan, [(prompt.text, "".join(gen.VOCAB[i] for i in ids))]

    def _remember_replies(
        self,
        body: dict[str, Any],
        chat: bool,
        replies: list[tuple[str, str]],
        adapter: str | None,
    ) -> None:
        """Cache each finished (prompt text, reply) as the client's next turn will send it."""
        tokens = (cost.reply_tokens(body, chat, t, reply) for t, reply in replies)
        self._cache_insert(*tokens, adapter=adapter)

    async def _prompt(
        self,
        body: dict[str, Any],
        chat: bool,
        prompt_tokens: int,
        kv: dict[str, Any] | None,
        model: str,
    ) -> bool:
        """Compute the prompt for ``model`` (a served name), or pull its KV when ``kv`` is
        a descriptor (False: the pull failed). With a prefix cache, only the tokens it does
        not hold cost prefill time, and only the blocks it does not hold are pulled; blocks
        are cached per adapter. A consumer's lookup is counted in the cache's queries and
        hits too, as vLLM's scheduler looks up the local cache before the connector loads
        the rest."""
        cfg = self.config
        cache = self.prefix_cache
        adapter = self.catalog.adapter(model)
        tokens = cost.prompt_tokens(body, chat) if cache.enabled else []
        cached, held = cache.probe(tokens, adapter)
        if kv is not None and cfg.role != "prefill":
            blocks = cost.prompt_blocks(prompt_tokens) - held
            if not await self._pull(kv, blocks, self.catalog.weights(model)):
                return False
            self.counters["decode_remote"] += 1
        else:
            if cached:
                self.counters["prompt_tokens_cached"] += cached
            await self._compute_prompt(prompt_tokens - cached)
        self._cache_insert(tokens, adapter=adapter)
        return True

    async def _compute_prompt(self, uncached_tokens: int) -> None:
        cfg = self.config
        delay = cost.prefill_seconds(
            uncached_tokens, cfg.prefill_ms_per_token, cfg.prefill_delay_per_token_s, cfg.slowdown
        )
        if delay > 0:
            self.computing += 1  # running streams slow down meanwhile (prefill interference)
            try:
                await trio.sleep(delay)
            finally:
                self.computing -= 1

    def _produce(
        self, resp_id: str, prompt_tokens: int, chat: bool, origin: str, model: str
    ) -> dict[str, Any]:
        """Hold the prompt's blocks under a lease, marked with the weights ``model`` (a
        served name) runs under; the descriptor exactly as vLLM 0.32 writes it (it names no
        model: an adapter's is the same shape)."""
        suffix = secrets.token_hex(4)
        remote_request_id = f"{resp_id}-{suffix}" if chat else f"{resp_id}-0-{suffix}"
        weights = self.catalog.weights(model)
        lease = self.store.issue(remote_request_id, prompt_tokens, origin=origin, model=weights)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": lease.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": self.host,
            "remote_port": self.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": 0,
        }

    async def _pull(self, kv: dict[str, Any], blocks: int, weights: str) -> bool:
        """Pull the blocks named by the descriptor from the producer's side channel, of
        which ``blocks`` move (those the prefix cache does not hold): they cost
        ``kv_ms_per_block`` each, and are counted in ``kv_blocks_pulled``. The producer
        refuses KV computed under other weights than ``weights`` (``wrong_model``)."""
        host, port = kv.get("remote_host"), kv.get("remote_port")
        request = PullRequest(
            engine_id=str(kv.get("remote_engine_id")),
            request_id=str(kv.get("remote_request_id")),
            block_ids=kv.get("remote_block_ids"),
            consumer=self.engine_id,
            model=weights,
        )
        if not isinstance(host, str) or type(port) is not int:
            reply_reason = "incomplete"
            ok = False
        else:
            cfg = self.config
            delay = cost.pull_seconds(blocks, cfg.transfer_delay_s, cfg.kv_ms_per_block)
            if delay > 0:
                await trio.sleep(delay)
            reply = await self.puller.pull(host, port, request)
            ok, reply_reason = reply.ok, reply.reason
        if ok:
            self.counters["kv_pull_ok"] += 1
            self.counters["kv_blocks_pulled"] += blocks
            self.counters["kv_transfers"] += int(blocks > 0)
        else:
            self.counters["kv_pull_failed"] += 1
            self.counters[f"kv_pull_failed_{reply_reason}"] += 1
        return ok

    async def _release_refused(self, body: dict[str, Any]) -> None:
        """vLLM since vllm#41269: a consumer that refuses a request carrying a descriptor
        before admission tells the producer to free the blocks, with no transfer."""
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict) or kv.get("do_remote_prefill") is not True:
            return
        host, port = kv.get("remote_host"), kv.get("remote_port")
        if not isinstance(host, str) or type(port) is not int:
            return
        request = PullRequest(
            engine_id=str(kv.get("remote_engine_id")),
            request_id=str(kv.get("remote_request_id")),
            block_ids=kv.get("remote_block_ids"),
            consumer=self.engine_id,
            release_only=True,
        )
        reply = await self.puller.pull(host, port, request)  # bounded, never raises
        self.counters["kv_release_sent" if reply.ok else "kv_release_refused"] += 1

    async def _transfer_failed(self, ex: Exchange, stream: bool) -> None:
        """What vLLM answers when a KV load fails (captures/edge_deadport.txt)."""
        if stream:
            await ex.start_stream()
            await ex.write(gen.stream_error_event())
            await ex.end_stream()
        else:
            body = gen.error_body("Internal server error", "InternalServerError", 500)
            await ex.respond(500, body)

    async def _stream(
        self,
        shapes: gen.Shapes,
        plan: answers.StreamPlan,
        prompt_tokens: int,
        ex: Exchange,
        fault: Fault | None,
        entry: dict[str, Any],
    ) -> bool:
        """Stream the plan (or the fault); True when the generation ran to ``[DONE]``."""
        kind = fault.kind if fault is not None else None
        if fault is not None and kind == "script":
            await _play(fault.value, ex)
            return False
        interference = self.config.prefill_interference
        if fault is not None and kind == "slow_drip":
            itl, interference = fault.interval_s, 0.0  # a scripted pace is kept
        else:
            itl = self.config.itl_s * self.config.slowdown
        await ex.start_stream()
        if kind == "headers_then_silence":
            await trio.sleep_forever()
        if kind == "done_first":
            await ex.write(b"data: [DONE]\n\n")
            await ex.end_stream()
            return False
        for frame in plan.head:
            await ex.write(b"data: " + frame + b"\n\n")
        if kind == "metadata_then_silence":
            await ex.write(b": keep-alive\n\n")
            await ex.write(b"data: " + shapes.usage_chunk(prompt_tokens, 0) + b"\n\n")
            await trio.sleep_forever()
        frames = plan.tokens
        if fault is not None and kind != "slow_drip":
            frames = itertools.islice(frames, fault.tokens)
        for n, chunk in enumerate(frames):
            if itl > 0 and n:
                # each gap as the engine is now: a prompt that starts computing slows the
                # next tokens, not the gap already waited
                gap = (
                    cost.interfered_itl(itl, interference, self.computing) if interference else itl
                )
                await trio.sleep(gap)
            if chunk is not None:  # a token that sends no chunk (a tool call's tail)
                await ex.write(b"data: " + chunk + b"\n\n")
            self.counters["generation_tokens"] += 1
            entry["tokens"] += 1
            if entry["tokens"] == self._streamed_goal and self._streamed is not None:
                self._streamed.set()
        if fault is not None and kind != "slow_drip":
            await self._break_stream(fault, ex)
            return False
        if plan.tail is not None:
            await ex.write(b"data: " + plan.tail + b"\n\n")
        await ex.write(b"data: [DONE]\n\n")
        await ex.end_stream()
        return True

    async def _break_stream(self, fault: Fault, ex: Exchange) -> None:
        if fault.kind == "tokens_then_silence":
            if fault.keepalive_s > 0:
                await trio.sleep(fault.keepalive_s)
                await ex.write(b": keep-alive\n\n")
            await trio.sleep_forever()
        elif fault.kind == "tokens_then_close":
            await ex.abort()
        elif fault.kind == "stream_error":
            await ex.write(gen.stream_error_event(fault.message, fault.code))
            await ex.end_stream()
        elif fault.kind == "malformed_chunk":
            await ex.write(b"data: {not json\n\ndata: [DONE]\n\n")
            await ex.end_stream()
        elif fault.kind == "oversized_event":
            await ex.write(b"data: " + b"x" * (2 << 20))
            await trio.sleep_forever()


async def _play(steps: list[tuple[str, Any]], ex: Exchange) -> None:
    """A scripted decode response, step by step (the ``script`` fault)."""
    for op, arg in steps:
        if op == "sleep":
            await trio.sleep(arg)
        elif op == "headers":
            await ex.start_stream()
        elif op == "write":
            await ex.write(arg)
        elif op == "end":
            await ex.end_stream()
            return
        elif op == "close":
            await ex.abort()
            return
        elif op == "hang":
            await trio.sleep_forever()


def _corrupt(descriptor: dict[str, Any], fault: Fault) -> dict[str, Any] | None:
    """The descriptor a broken producer hands out."""
    if fault.kind == "no_descriptor":
        return None
    if fault.kind == "bad_engine_id":
        return {**descriptor, "remote_engine_id": fault.value}
    if fault.kind == "bad_block_ids":
        return {**descriptor, "remote_block_ids": fault.value}
    return descriptor


async def _object_body(req: Request, ex: Exchange) -> dict[str, Any] | None:
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
