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

import time

import msgspec
import trio

from narwhal.fake_engine.completions import Completions
from narwhal.fake_engine.http import Exchange, Request, serve_connection
from narwhal.fake_engine.side_endpoints import SideEndpoints

VERSION = "0.32.0"


class FakeEngine(Completions, SideEndpoints):
    """The fake engine: its state (``EngineBase``), its endpoints, and its serve loop."""

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
            if not await self._struck("metrics", ex):
                text = b"text/plain; version=0.0.4; charset=utf-8"
                await ex.respond(200, self._metrics(), text)
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
