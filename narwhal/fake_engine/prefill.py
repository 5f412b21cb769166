"""How a completion gets its prompt's KV: computed here (prefill time per uncached token,
the prefix cache), or pulled from the producer its descriptor names (the side channel,
``kv_channel``); the descriptor a producer issues with its lease, the release a refused
consumer sends, and what vLLM answers when a KV load fails.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import trio

from narwhal.fake_engine import cost
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.engine_base import EngineBase
from narwhal.fake_engine.http import Exchange
from narwhal.fake_engine.kv_channel import PullRequest


class Prefill(EngineBase):
    """A completion's prompt side: compute it here, or pull its KV from a producer."""

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
        """Compute ``uncached_tokens`` (counted in ``prompt_tokens_computed``: the work a
        router's placement left to this engine); with ``prefill_slots``, only that many
        prompts at once, the rest waiting (in ``waiting``, as vLLM's queue of requests not
        yet scheduled)."""
        cfg = self.config
        self.counters["prompt_tokens_computed"] += uncached_tokens
        delay = cost.prefill_seconds(
            uncached_tokens, cfg.prefill_ms_per_token, cfg.prefill_delay_per_token_s, cfg.slowdown
        )
        if delay <= 0:
            return
        async with self._prefill_slot():
            self.computing += 1  # running streams slow down meanwhile (prefill interference)
            try:
                await trio.sleep(delay)
            finally:
                self.computing -= 1

    @contextlib.asynccontextmanager
    async def _prefill_slot(self) -> AsyncIterator[None]:
        """One of ``prefill_slots`` while a prompt is computed (FIFO, like the slots); no
        limit of its own without them."""
        slots = self._prefill_slots
        if slots is None:
            yield
            return
        self.waiting += 1
        self._queued.set()  # wake wait_queued, then arm for the next arrival
        self._queued = trio.Event()
        try:
            await slots.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            slots.release()

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
