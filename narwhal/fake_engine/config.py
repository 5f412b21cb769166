"""The fake engine's settings (``FakeEngineConfig``): what it serves and as which role, its
ports, its pace, its KV cache and lease, and the options of the cost model, the KV events
and the LoRA adapters, each off by default.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from narwhal.fake_engine import kv_events, lora


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
    prefill_slots: int = 0  # of which computing their prompt at once (0: as many as slots)
    prefill_ms_per_token: float = 0.0  # per uncached prompt token, added to the delay above
    prefix_cache_blocks: int = 0  # LRU of 16-token prompt blocks (0: no prefix cache)
    kv_ms_per_block: float = 0.0  # per pulled block not cached, added to transfer_delay_s
    # while prompts are computed here, streams' itl x (1 + this x the prompts computing)
    prefill_interference: float = 0.0
    # each stream's itl x (1 + this x the other streams decoding at once)
    decode_batch_growth: float = 0.0
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
        costs = (
            self.prefill_ms_per_token,
            self.kv_ms_per_block,
            self.prefill_interference,
            self.decode_batch_growth,
        )
        slots = self.slots or self.prefill_slots
        return bool(slots or self.prefix_cache_blocks or any(costs)) or self.slowdown != 1.0

    @property
    def lora_swap_s(self) -> float:
        """How long loading an adapter into a slot takes: ``lora_swap_ms``, or by default
        instant, and ``lora.DEFAULT_COST_SWAP_MS`` with the cost model on."""
        if self.lora_swap_ms is not None:
            return self.lora_swap_ms / 1000
        return lora.DEFAULT_COST_SWAP_MS / 1000 if self.cost_model else 0.0
