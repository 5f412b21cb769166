"""Where one prefill/decode chain's legs go: the shell around placement
(``narwhal.core.placement``) for one request. It reads the request's placement keys once
(its prefix, its prompt's blocks, its token ids, its LoRA adapter), asks the fleet which
engines may take a leg, lets the request's machine decide the route an attempt takes
(one local leg, or a prefill and a handoff), counts each placement, and tells the prefix
index and the cost model what the legs did.

Decode first (``local_prefill_tokens`` or ``local_prefill_when_busy``) places the consumer
before the producer, and an attempt may then run on its consumer alone.
"""

from __future__ import annotations

import trio

from narwhal.core.config import FleetConfig
from narwhal.core.disaggregation import Decision, decode_first, local_or_remote, wants_prompt_side
from narwhal.core.engine_state import EngineState, Leg
from narwhal.core.faults import NoCapacity, Phase
from narwhal.core.placement import Holdings, Placed, choose
from narwhal.core.policies import prefix_key
from narwhal.core.precise_index import TokenPrompt
from narwhal.core.prefix_index import Prompt, prompt_of, reply_text
from narwhal.core.request import RequestMachine
from narwhal.core.request_actions import AfterFault, GoLocal, PlaceProducer, Prefill
from narwhal.core.request_events import ConsumerPlaced, ProducerPlaced
from narwhal.core.requests import ClientRequest
from narwhal.core.token_ids import given_ids
from narwhal.router import predicted
from narwhal.router.predicted import Forecast
from narwhal.router.run_record import RouterState
from narwhal.router.token_path import TokenPath
from narwhal.stream.rules import Reply

Route = GoLocal | Prefill  # the legs an attempt runs, every engine named


class Placer:
    """One request's placement: its keys, read once, and each attempt's engines."""

    __slots__ = (
        "_adapter",
        "_forecast",
        "_prefix",
        "_prompt",
        "_tokens",
        "config",
        "indexing",
        "machine",
        "req",
        "router",
    )

    def __init__(
        self, router: RouterState, config: FleetConfig, req: ClientRequest, machine: RequestMachine
    ) -> None:
        self.router = router
        self.config = config
        self.req = req
        self.machine = machine
        self._forecast: Forecast | None = None  # policy "predicted": the attempt's plan
        placement = config.placement
        # the LoRA adapter it runs under (None: a base model): the prefix indexes keep
        # each adapter's blocks apart
        model = req.model
        self._adapter = model if model and router.fleet.catalog.adapter(model) else None
        # the prefix index is kept when placement reads it
        self.indexing = placement.prefix_affinity or decode_first(placement)
        # what placement keys on, read once, for every attempt; the body then holds only
        # the JSON that came. The prefix keys producer affinity (None: affinity off)
        self._prefix: str | None = None
        if placement.prefix_affinity:
            self._prefix = prefix_key(req.body, chat=req.chat)
        self._prompt: Prompt | None = None  # its blocks, for the prefix index
        if self.indexing:  # decode first reads the blocks too, and implies indexing
            self._prompt = prompt_of(req.body, chat=req.chat, adapter=self._adapter)
        # its token ids, for engines whose KV events say what they hold: a prompt of ids
        # is its own; others are asked of the engines' tokenizer before the first placement
        self._tokens: TokenPrompt | None = None
        if self.indexing and config.kv_events.mode != "off":
            given = given_ids(req.body, chat=req.chat)
            self._tokens = None if given is None else TokenPrompt(given, self._adapter)
        req.body.forget_prompt()

    def local_possible(self) -> bool:
        """Local on any consumer (the whole prompt is under ``local_prefill_tokens``), or
        wherever the producers are busy (``local_prefill_when_busy``); never a request
        whose answer needs the producer's prompt side."""
        placement = self.config.placement
        if wants_prompt_side(self.req.body):
            return False
        threshold = placement.local_prefill_tokens
        short = threshold > 0 and self._prompt_blocks().tokens < threshold
        return short or placement.local_prefill_when_busy or placement.policy == "predicted"

    def unqueued_ttft(self) -> float | None:
        """Policy "predicted": the least TTFT any plan predicts with nothing queued ahead."""
        fleet, now, req = self.router.fleet, trio.current_time(), self.req
        holdings = self._holdings(now)
        return predicted.unqueued_ttft(fleet, self.config, holdings, now, req.model, req.body)

    def _holdings(self, now: float) -> Holdings:
        fleet = self.router.fleet
        return Holdings(self._prompt_blocks(), fleet.prefixes, now, fleet.precise, self._tokens)

    def _prompt_blocks(self) -> Prompt:
        if self._prompt is None:  # once per request: every attempt sees the same blocks
            self._prompt = prompt_of(self.req.body, chat=self.req.chat, adapter=self._adapter)
        return self._prompt

    async def token_ids(self, rid: str) -> None:
        """The prompt's token ids, asked of an engine's tokenizer where they can change
        placement (engines whose KV events say what they hold)."""
        tokens = self.router.tokens
        first = decode_first(self.config.placement)
        if self.indexing and self._tokens is None and tokens.wanted(decode_first=first):
            self._tokens = await tokens.ids_of(self.req, rid, self._adapter)

    def _producers(self) -> list[str]:
        fleet = self.router.fleet
        candidates, _ = fleet.placeable("prefill", trio.current_time(), self.req.model)
        return [engine.id for engine in candidates]

    def consumers(self) -> list[str]:
        fleet = self.router.fleet
        candidates, _ = fleet.placeable("decode", trio.current_time(), self.req.model)
        return [engine.id for engine in candidates]

    # ---- placement -------------------------------------------------------------------------

    def place(self, leg: Leg, other_leg: str | None = None) -> EngineState:
        return self._count(leg, self._choose(leg, other_leg))

    def _choose(self, leg: Leg, other_leg: str | None = None) -> Placed:
        """Where placement puts ``leg`` now, and why (nothing counted yet)."""
        fleet, health = self.router.fleet, self.router.health
        model = self.req.model
        candidates, held_in = fleet.placeable(leg, trio.current_time(), model)
        health.note_placement(leg, held_in, model)
        placed = choose(
            candidates,
            leg,
            self.config.placement,
            rng=self.router.rng,
            now=trio.current_time(),
            turn=fleet.turn,
            avoid=self.machine.failed_engines,
            other_leg=other_leg,
            key=self._prefix if leg == "prefill" else None,
            ring=fleet.ring,
            prompt=self._prompt_blocks() if self.config.placement.prefix_affinity else None,
            index=fleet.prefixes,
            precise=fleet.precise,
            tokens=self._tokens,
            adapter=self._adapter,
            limits=self.config.admission,
        )
        if placed is None:
            raise NoCapacity(
                f"no placeable {'producer' if leg == 'prefill' else 'consumer'} engine",
                phase=Phase.ADMISSION,
            )
        return placed

    def _count(self, leg: Leg, placed: Placed) -> EngineState:
        """The leg goes where it was ``placed``: counted, and an adapter noted there."""
        self.router.metrics.placements_of(leg, placed.reason).inc()
        if self._adapter is not None:  # on its way there: the engine's series may not say
            placed.engine.adapters.placed(self._adapter)
        return placed.engine

    def _disaggregation(self, consumer: EngineState) -> Decision:
        """Whether this attempt skips the remote prefill (conditional disaggregation,
        decode first). A request whose answer needs the prompt side the producer computes
        (an echo, prompt logprobs, the prompt's token ids) always has it."""
        if wants_prompt_side(self.req.body):
            return "disaggregated"
        placement, flow = self.config.placement, self.config.admission
        now = trio.current_time()
        uncached = self._holdings(now).uncached(consumer.id)
        limits = (placement.metrics_interval_s, flow.engine_waiting_limit, flow.kv_usage_limit)
        busy = placement.local_prefill_when_busy and self.router.fleet.saturated(
            "prefill", now, *limits, model=self.req.model
        )
        return local_or_remote(
            uncached,
            placement,
            producers_saturated=busy,
            consumer_saturated=busy and consumer.room(now, *limits, "decode")[0] <= 0,
        )

    def route(self, cls: str) -> Route | AfterFault:
        """A fresh attempt's route (``cls``: its class in the admission queue), as the
        machine decided it with the engines placed: one local leg, or a prefill and a
        handoff (its consumer placed now, or once the descriptor is in hand)."""
        self._forecast = None
        planned = self._predicted(cls) if self.config.placement.policy == "predicted" else None
        if planned is not None:
            return planned
        if decode_first(self.config.placement):
            return self._route_decode_first()
        return self._route_producer_first()

    def _route_decode_first(self) -> Route | AfterFault:
        machine = self.machine
        placed = self._choose("decode")
        decision = self._disaggregation(placed.engine)
        if machine.wants_other_consumer(placed.engine.id, decision, self._producers):
            other = self._choose("decode", other_leg=placed.engine.id)
            if other.engine is not placed.engine:
                placed, decision = other, self._disaggregation(other.engine)
        consumer = self._count("decode", placed)
        local = machine.handle(ConsumerPlaced(consumer.id, decision))
        if type(local) is GoLocal:
            return self._counted(local, decision)
        producer = self.place("prefill", other_leg=consumer.id)
        now = trio.current_time()
        placed_too = ProducerPlaced(producer.id, consumer.id, None, 1, now)
        return self._counted(machine.handle(placed_too), decision)

    def _predicted(self, cls: str) -> Route | AfterFault | None:
        """Policy "predicted": the plan of least predicted TTFT (None: no plan, such as a
        request that needs its prefill leg on a fleet of one engine; placed as before)."""
        fleet, now, req, machine = self.router.fleet, trio.current_time(), self.req, self.machine
        holdings, avoid = self._holdings(now), machine.failed_engines
        seen = self._forecast = predicted.plan_attempt(
            fleet, self.config, holdings, now, model=req.model, avoid=avoid, cls=cls, body=req.body
        )
        if seen is None:
            return None
        machine.attempt_line.predicted_ttft_s = round(seen.plan.ttft_s, 4)
        consumer = self._count("decode", Placed(fleet.by_id[seen.plan.consumer], "predicted"))
        if seen.plan.producer is None:
            local = machine.handle(ConsumerPlaced(consumer.id, "local_predicted"))
            return self._counted(local, "local_predicted")
        producer = self._count("prefill", Placed(fleet.by_id[seen.plan.producer], "predicted"))
        placed = ProducerPlaced(producer.id, consumer.id, None, 1, now)
        return self._counted(machine.handle(placed), "disaggregated")

    def _route_producer_first(self) -> Route | AfterFault:
        now = trio.current_time()
        consumers, _ = self.router.fleet.placeable("decode", now, self.req.model)
        only = self.machine.only_engine([c.id for c in consumers])
        producer = self.place("prefill", other_leg=only)
        placed = ProducerPlaced(producer.id, None, only, len(consumers), now)
        route = self.machine.handle(placed)
        return self._counted(route, None) if type(route) is GoLocal else route

    def _counted(
        self, route: Route | PlaceProducer | AfterFault, decision: Decision | None
    ) -> Route | AfterFault:
        """The route's disaggregation decision, counted: a local leg's own, else
        ``decision`` (None: not counted)."""
        if isinstance(route, GoLocal):
            decision = route.decision
        elif not isinstance(route, Prefill):
            assert not isinstance(route, PlaceProducer)  # a producer was placed
            return route
        if decision is not None:
            self.router.metrics.disaggregation_of(decision).inc()
        return route

    def continuation(self) -> tuple[EngineState, EngineState]:
        """A continuation's engines (docs/contract.md section 6.4): a consumer that has not
        failed this request if one is left, then a producer apart from it where one is
        left. Whether they may take it is the machine's to say."""
        self._forecast = None  # placed by the rules: a continuation's prompt is its own
        consumer = self.place("decode")
        if consumer.id in self.machine.failed_engines:  # refused: no producer is placed
            return consumer, consumer
        return self.place("prefill", other_leg=consumer.id), consumer

    # ---- what the legs teach: the prefix index, the cost model -----------------------------

    def prefilled(self, producer: EngineState, started: float) -> None:
        """A fresh prefill that began at ``started`` ended well on ``producer``."""
        now = trio.current_time()
        if self._forecast is not None:
            predicted.learn_prefill(self.router.fleet.costs, self._forecast, now - started, now)
        if self.machine.continuation is None and self.indexing:
            self._remember(producer, self._prompt_blocks())

    def decoded(
        self,
        consumer: EngineState,
        path: TokenPath | None,
        reply: Reply | None,
        sent: float,
        cls: str,
    ) -> None:
        """A decode leg sent at ``sent`` ended well on ``consumer``: what it teaches the
        cost model (``cls``: the request's class), and that the consumer holds the prompt
        and what it generated (a next turn starts with both)."""
        seen = self._forecast
        if seen is not None and path is not None:
            first, last = path.first_token_at, path.last_output_at
            predicted.learn_decode(self.router.fleet.costs, seen, sent, first, last, path.tokens)
            target = self.config.admission.targets(cls).tpot_slo_s
            metrics = self.router.metrics
            predicted.account(metrics, seen, first, last, path.tokens, cls=cls, tpot_slo_s=target)
        if self.indexing and reply is not None:
            text = reply_text(reply.text(), chat=self.req.chat)
            self._remember(consumer, self._prompt_blocks().followed_by(text))

    def _remember(self, engine: EngineState, prompt: Prompt) -> None:
        self.router.fleet.prefixes.record(engine.id, prompt.blocks, trio.current_time())
