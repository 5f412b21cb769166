"""``POST /v1/completions`` and ``/v1/chat/completions`` as vLLM 0.32 with NixlConnector
answers them: its checks and error bodies, the slots and LoRA adapter slots a request
holds while it is answered, the prompt side (``prefill``), and the answer, streamed
(``streaming``) or whole, with the descriptor a producer hands out.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import trio

from narwhal.fake_engine import answers, asks, cost
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.engine_base import object_body
from narwhal.fake_engine.faults import Fault
from narwhal.fake_engine.http import Exchange, Request
from narwhal.fake_engine.prefill import Prefill
from narwhal.fake_engine.samples import samples
from narwhal.fake_engine.streaming import Streaming


class Completions(Prefill, Streaming):
    """``POST /v1/completions`` and ``/v1/chat/completions``."""

    async def _completion(self, req: Request, ex: Exchange, *, chat: bool) -> None:
        self.counters["chat" if chat else "completions"] += 1
        body = await object_body(req, ex)
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


def _corrupt(descriptor: dict[str, Any], fault: Fault) -> dict[str, Any] | None:
    """The descriptor a broken producer hands out."""
    if fault.kind == "no_descriptor":
        return None
    if fault.kind == "bad_engine_id":
        return {**descriptor, "remote_engine_id": fault.value}
    if fault.kind == "bad_block_ids":
        return {**descriptor, "remote_block_ids": fault.value}
    return descriptor
