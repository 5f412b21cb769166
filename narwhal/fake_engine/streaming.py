"""A streamed completion written out: its frames at the engine's pace (``itl_s``, the
slowdown, prefill interference, the decode batch), ``[DONE]``, and every scripted fault that
breaks a stream (silence, a close, an error event, a malformed or oversized chunk, a script of
its own).
"""

from __future__ import annotations

import itertools
from typing import Any

import trio

from narwhal.fake_engine import answers, cost
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.engine_base import EngineBase
from narwhal.fake_engine.faults import Fault
from narwhal.fake_engine.http import Exchange


class Streaming(EngineBase):
    """A completion's stream, frame by frame at the engine's pace, or the fault scripted for it."""

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
        growth = self.config.decode_batch_growth
        if fault is not None and kind == "slow_drip":
            # a scripted pace is kept
            itl, interference, growth = fault.interval_s, 0.0, 0.0
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
        self.decoding += 1  # in the batch from its first token to its last
        try:
            for n, chunk in enumerate(frames):
                if itl > 0 and n:
                    await trio.sleep(self._gap(itl, interference, growth))
                if chunk is not None:  # a token that sends no chunk (a tool call's tail)
                    await ex.write(b"data: " + chunk + b"\n\n")
                self.counters["generation_tokens"] += 1
                entry["tokens"] += 1
                if entry["tokens"] == self._streamed_goal and self._streamed is not None:
                    self._streamed.set()
        finally:
            self.decoding -= 1
        if fault is not None and kind != "slow_drip":
            await self._break_stream(fault, ex)
            return False
        if plan.tail is not None:
            await ex.write(b"data: " + plan.tail + b"\n\n")
        await ex.write(b"data: [DONE]\n\n")
        await ex.end_stream()
        return True

    def _gap(self, itl: float, interference: float, growth: float) -> float:
        """The delay before the next token, as the engine is now: a prompt that starts
        computing, or a stream that joins the batch, slows the next tokens, not the gap
        already waited."""
        if growth:
            itl = cost.batched_itl(itl, growth, self.decoding)
        if interference:
            itl = cost.interfered_itl(itl, interference, self.computing)
        return itl

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
