"""``POST /tokenize`` and ``/detokenize`` (contract 3): the client's body, unchanged, to one
placeable engine, and its answer, admitted and journaled like a completion. Which engine,
and the model the body names, are the pure core's (``narwhal.core.pass_through``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import trio

from narwhal.core.clocks import Clock, ran_out
from narwhal.core.config import FleetConfig
from narwhal.core.engine_state import EngineState
from narwhal.core.faults import AtEngine, DeadlineExpired, Phase, RequestFault
from narwhal.core.fleet import Fleet
from narwhal.core.pass_through import pass_engine, pass_model
from narwhal.engines.client import EngineClient
from narwhal.observe import tracing
from narwhal.observe.logs import log_request
from narwhal.router.admission import Admission
from narwhal.router.journal import AttemptLine, Caller, Journal, JournalLine, Outcome


class PassHost(Protocol):
    """What a pass-through needs from the router (``narwhal.router.service.Router``)."""

    config: FleetConfig
    fleet: Fleet
    client: EngineClient
    admission: Admission
    journal: Journal
    rng: random.Random
    drain_deadline: float
    running: set[trio.CancelScope]  # the scopes a drain brings its deadline to

    def export(self, line: JournalLine) -> None: ...  # a finished request's metrics

    def limit_fault(
        self, limit: trio.CancelScope, deadline: float, timeout: float, phase: Phase
    ) -> RequestFault: ...


class PassThrough:
    def __init__(self, router: PassHost) -> None:
        self.router = router

    async def answer(
        self,
        path: str,
        body: bytes,
        rid: str,
        caller: Caller,
        headers: Sequence[tuple[bytes, bytes]],
        wait_disconnect: Callable[[], Awaitable[None]],
    ) -> tuple[int, bytes] | None:
        """``POST /tokenize`` or ``/detokenize`` (contract 3): the client's body, unchanged, to
        one placeable engine, and its answer; a fault is answered as a leg's would be (4xx
        passed through, timeouts 504, others 502). Admitted like a completion (it counts
        against ``max_inflight`` and the drain waits for it), journaled once. None: the
        client left, nobody is left to answer (the leg is cancelled at once)."""
        arrival, arrived_at = trio.current_time(), time.time()
        attempt = AttemptLine(number=1)
        answer: tuple[int, bytes] | None = None
        fault: RequestFault | None = None
        self.router.admission.admit()
        self.router.admission.take_slot()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on, wait_disconnect, nursery.cancel_scope)
                try:
                    answer = 200, await self._leg(path, body, rid, headers, attempt, arrival)
                except RequestFault as exc:
                    fault = exc
                    answer = fault.answer()
                nursery.cancel_scope.cancel()  # the watcher's task
        finally:
            self.router.admission.done()
            self.router.admission.release()
            line = _pass_line(path, rid, caller, attempt, answer, fault, arrival, arrived_at)
            self.router.journal.write(line)
            self.router.export(line)
            log_request(line)
        return answer

    async def _leg(
        self,
        path: str,
        body: bytes,
        rid: str,
        headers: Sequence[tuple[bytes, bytes]],
        attempt: AttemptLine,
        arrival: float,
    ) -> bytes:
        """The engine's answer within ``prefill_timeout_s`` (prompt-side work), the request
        deadline and the drain."""
        serving = self.router.config.serving
        timeout = serving.request_timeout_s
        with trio.CancelScope(deadline=min(arrival + timeout, self.router.drain_deadline)) as limit:
            self.router.running.add(limit)
            try:
                body, model = pass_model(body, self.router.fleet.catalog, self.router.config.model)
                engine = self.engine(model)
                if engine.spec.role == "decode":
                    attempt.consumer = engine.id
                else:
                    attempt.producer = engine.id
                budget = serving.prefill_timeout_s
                with trio.move_on_after(budget) as clock:
                    with AtEngine(engine.id, engine.url):
                        return await self.router.client.pass_through(
                            engine.url,
                            path,
                            body,
                            request_id=f"{rid}-a1-{path.strip('/')}",
                            trace=tracing.incoming(headers),
                        )
                raise ran_out(
                    Clock.PREFILL,
                    budget,
                    phase=Phase.PREFILL,
                    engine_id=engine.id,
                    leg=path,
                    scope=clock,
                )
            finally:
                self.router.running.discard(limit)
        raise self.router.limit_fault(limit, arrival + timeout, timeout, Phase.PREFILL)

    def engine(self, model: str | None = None) -> EngineState:
        """The engine a tokenizer request goes to (``narwhal.core.pass_through.pass_engine``)."""
        return pass_engine(self.router.fleet, trio.current_time(), self.router.rng, model)


async def _cancel_on(event: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
    await event()
    scope.cancel()


def _pass_line(
    path: str,
    rid: str,
    caller: Caller,
    attempt: AttemptLine,
    answer: tuple[int, bytes] | None,
    fault: RequestFault | None,
    arrival: float,
    arrived_at: float,
) -> JournalLine:
    """The journal line of a passed-through request (no tokens: nothing is generated)."""
    outcome: Outcome = "cancelled" if answer is None else "completed"
    if fault is not None:
        outcome = "expired" if isinstance(fault, DeadlineExpired) else "failed"
    placed = attempt.producer is not None or attempt.consumer is not None
    return JournalLine(
        request_id=rid,
        endpoint=path,
        stream=False,
        outcome=outcome,
        status=None if answer is None else answer[0],
        phase=fault.phase if fault is not None else (None if answer else "prefill"),
        message=fault.message if fault is not None else None,
        attempts=[attempt] if placed else [],
        prefill_s=None,
        first_byte_s=None,
        tokens=0,
        duration_s=trio.current_time() - arrival,
        at=round(arrived_at, 3),
        client=caller.client,
        key=caller.key,
    )
