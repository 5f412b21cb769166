"""The fake engine's endpoints beside the completions, as vLLM 0.32 answers them:
``/tokenize`` and ``/detokenize``, the model list, the Prometheus ``/metrics`` a router
scrapes, and the knobs tests turn (scripted faults, the KV-event stream's faults).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
import trio

from narwhal.fake_engine import cost, kv_events
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.engine_base import EngineBase, object_body
from narwhal.fake_engine.faults import Fault
from narwhal.fake_engine.http import Exchange, Request
from narwhal.fake_engine.kv_publisher import KvEventPublisher

_FAULT_LIST = msgspec.json.Decoder(list[Fault])


class SideEndpoints(EngineBase):
    """Every endpoint but the completions: ``/tokenize``, ``/detokenize``, ``/v1/models``,
    ``/metrics``, and the tests' knobs (``/fake/faults``, ``/fake/kv_events``)."""

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
        body = await object_body(req, ex)
        if body is None:
            return None
        model = body.get("model")
        if model is not None and not self.catalog.serves(model):
            msg = self.catalog.not_found(model)
            await ex.respond(404, gen.error_body(msg, "NotFoundError", 404, "model"))
            return None
        self.counters[req.path.strip("/")] += 1
        return None if await self._struck("tokenize", ex) else body

    async def _struck(self, leg: Literal["tokenize", "metrics"], ex: Exchange) -> bool:
        """Whether a fault queued for ``leg`` answered instead (an error, or a hang)."""
        fault = self.faults.take(leg)
        if fault is None:
            return False
        self.counters[f"fault_{fault.kind}"] += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ex.watch_disconnect, nursery.cancel_scope)
                await self._refuse(fault, ex)
                nursery.cancel_scope.cancel()
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            ex.disconnected = True  # a write lost the race with the watcher
        return True

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
