"""Fan-out (contract 3): ``n > 1`` and a list of prompts run as independent prefill/decode
requests, merged into one response whose choices are indexed as OpenAI does (prompt-major,
then ``n``).

``FanOutRun`` stands where a ``RequestRun`` stands for ``Router.handle`` (same life cycle,
same journal line: it holds a ``RunRecord`` of its own, ``run.record``). Each sub-request
is a ``RequestRun`` of its own (its attempts, retries, reservations, backend ids
``<id>-p<prompt>-n<j>-a<attempt>-prefill|decode``), run as a child of this request's
nursery: a client disconnect, the deadline or the drain cancels them all at once. The
children write to a ``_ChildSink``; this class merges:

* streaming: each child's frames go out as they come, their choice ``index`` rewritten;
  the first output of any child commits the response; the children's ``[DONE]`` and usage
  chunks are held back, and one usage chunk (summed) and one ``[DONE]`` end the stream;
* JSON: each child's assembled answer becomes one choice; ``usage`` is summed, the prompt
  counted once per prompt as vLLM does.

A child that fails fails the whole request: before the commit point with its JSON error,
after it with the terminal event (contract 3), the other children cancelled.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from narwhal.core.config import FleetConfig
from narwhal.core.fanout_parent import FanOutParent
from narwhal.core.faults import RequestFault
from narwhal.core.lifecycle import State
from narwhal.core.records import JournalLine
from narwhal.core.request_events import CHILD_OUTPUT, CLIENT_LEFT, FINISHED, ChildReached
from narwhal.core.requests import ClientRequest
from narwhal.router.request_run import RequestRun
from narwhal.router.run_record import ClientSink, Measures, RouterState, RunRecord
from narwhal.stream.sse import DONE, DONE_FRAME, frame, framed_payloads

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class FanOutRun:
    """One client request answered by several prefill/decode requests."""

    __slots__ = (
        "_answers",
        "_template",
        "_usage",
        "_write_lock",
        "children",
        "parent",
        "prompt_of",
        "record",
    )

    def __init__(
        self,
        router: RouterState,
        config: FleetConfig,
        req: ClientRequest,
        rid: str,
        sink: ClientSink,
    ) -> None:
        self._write_lock = trio.Lock()
        # its own machine: it stands where the furthest child has come
        parent = self.parent = FanOutParent()
        record = self.record = RunRecord(
            config, req, rid, sink, parent, write_lock=self._write_lock
        )
        self.children: list[RequestRun] = []
        self.prompt_of: list[int] = []
        for k, (p, j, sub) in enumerate(req.split()):
            child = RequestRun(
                router,
                config,
                sub,
                f"{rid}-p{p}-n{j}",
                _ChildSink(self, k),
                arrival=record.arrival,
                fanout_index=k,
                progress=self._child_reached,
            )
            self.children.append(child)
            self.prompt_of.append(p)
        self._usage: dict[int, Any] = {}  # streaming: each child's last usage
        self._answers: dict[int, dict[str, Any]] = {}  # JSON: each child's answer
        self._template: dict[str, Any] | None = None  # a child's usage chunk, to shape ours on

    # ---- the record, summed over the children --------------------------------------------

    def measures(self) -> Measures:
        each = [c.measures() for c in self.children]
        prompts = [m.prompt_tokens for m in each if m.prompt_tokens is not None]
        return Measures(
            [a for m in each for a in m.attempts],
            min((m.prefill_s for m in each if m.prefill_s is not None), default=None),
            min((m.first_byte_s for m in each if m.first_byte_s is not None), default=None),
            sum(m.tokens for m in each),
            sum(prompts) if prompts else None,
        )

    def journal_line(self) -> JournalLine:
        return self.record.journal_line(self.measures())

    def cancel(self) -> None:
        """The client went away, or could not be told of the failure."""
        self.record.cancelled(self.parent.handle(CLIENT_LEFT))

    def _child_reached(self, state: State) -> None:
        self.parent.handle(ChildReached(state))

    def beyond_target(self) -> RequestFault | None:
        return None  # its children are planned when they run, each for its own choice

    def local_possible(self) -> bool:
        return False  # its children are placed when they run

    async def execute(self) -> None:
        """Run every child; the first fault cancels the others and is raised."""
        failed: list[RequestFault] = []

        async def child(run: RequestRun, scope: trio.CancelScope) -> None:
            try:
                await run.execute()
            except RequestFault as fault:
                failed.append(fault)
                scope.cancel()

        span, trace = self.record.span, self.record.trace
        async with trio.open_nursery() as nursery:
            for run in self.children:
                run.record.span = span  # their attempts are children of the request's span
                run.record.trace = trace  # tracing off: the client's context, to every leg
                nursery.start_soon(child, run, nursery.cancel_scope)
        if failed:
            raise failed[0]
        await self._answer_merged()

    # ---- following the children ----------------------------------------------------------

    async def child_output(self, k: int, data: bytes) -> None:
        """Frames from child ``k``'s stream: re-indexed and sent (the first commits)."""
        frames = []
        for payload in framed_payloads(data):
            if payload == DONE:
                continue
            chunk = _decode(payload)
            if not isinstance(chunk, dict):
                continue
            choices = chunk.get("choices") or []
            if not choices and chunk.get("usage") is not None:
                self._usage[k] = chunk["usage"]  # summed into one usage chunk at the end
                self._template = chunk  # vLLM's usage chunk: its keys, fingerprint included
                continue
            for choice in choices:
                if isinstance(choice, dict):
                    choice["index"] = k + (choice.get("index") or 0)
            frames.append(frame(_encode(chunk)))
        if not frames:
            return
        sink = self.record.sink
        async with self._write_lock:
            commits = self.parent.handle(CHILD_OUTPUT)
            if commits:
                await sink.commit(b"".join(frames))
            elif commits is not None:
                await sink.send(b"".join(frames))

    def child_answer(self, k: int, body: bytes) -> None:
        answer = _decode(body)
        if isinstance(answer, dict):
            self._answers[k] = answer

    async def _answer_merged(self) -> None:
        record, req, sink = self.record, self.record.req, self.record.sink
        record.completed()
        if not req.stream:
            self.parent.handle(FINISHED)
            with record.last_write():
                await sink.respond_json(200, _encode(self._merged_answer()))
            return
        tail = b""
        if req.include_usage and self._usage:
            usage_chunk = {
                **(self._template or {}),
                "choices": [],
                "usage": self._summed([self._usage.get(k) for k in range(len(self.children))]),
            }
            tail = frame(_encode(usage_chunk))
        async with self._write_lock:
            committed = self.parent.handle(FINISHED)
            with record.last_write():
                if committed:
                    await sink.end(tail + DONE_FRAME)
                else:
                    await sink.commit(tail + DONE_FRAME)
                    await sink.end()

    def _merged_answer(self) -> dict[str, Any]:
        first = self._answers.get(0, {})
        choices = []
        for k in range(len(self.children)):
            answer = self._answers.get(k, {})
            for choice in answer.get("choices") or []:
                choices.append({**choice, "index": k + (choice.get("index") or 0)})
        usages = [self._answers.get(k, {}).get("usage") for k in range(len(self.children))]
        return {**first, "choices": choices, "usage": self._summed(usages)}

    def _summed(self, usages: list[Any]) -> dict[str, Any] | None:
        """Completion tokens of every child; the prompt once per prompt (vLLM's count)."""
        if not any(isinstance(u, dict) for u in usages):
            return None
        prompt = completion = 0
        counted: set[int] = set()
        first: dict[str, Any] = {}
        for k, usage in enumerate(usages):
            if not isinstance(usage, dict):
                continue
            first = first or usage
            completion += int(usage.get("completion_tokens") or 0)
            if self.prompt_of[k] not in counted:
                counted.add(self.prompt_of[k])
                prompt += int(usage.get("prompt_tokens") or 0)
        return {
            **first,
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


class _ChildSink:
    """Where a child's output goes: to its parent's merge, never to the client directly."""

    __slots__ = ("k", "parent")

    def __init__(self, parent: FanOutRun, k: int) -> None:
        self.parent = parent
        self.k = k

    async def commit(self, data: bytes) -> None:
        await self.parent.child_output(self.k, data)

    async def send(self, data: bytes) -> None:
        await self.parent.child_output(self.k, data)

    async def end(self, data: bytes = b"") -> None:
        await self.parent.child_output(self.k, data)

    def delivered(self) -> bool:
        return True  # to the parent's merge; whether the client got it is the parent's

    @property
    def direct(self) -> None:
        return None  # a child's output is merged: it waits on the parent's writes

    async def cut(self, data: bytes, *, abandon: bool = False) -> None:
        await self.parent.child_output(self.k, data)  # a child's fault is its parent's to tell

    async def respond_json(self, status: int, body: bytes) -> None:
        if status == 200:
            self.parent.child_answer(self.k, body)
        # a child's failure is raised from its execute(); the parent tells the client
