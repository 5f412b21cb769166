"""A request's token ids from its engines' own tokenizer, for the precise prefix index
(``[kv_events] tokenizer = "engine"``).

Asked only while some engine's KV-event stream is live (else nothing would read them),
once per request before its first placement, of a placeable engine over the data pool,
bounded by ``engine.health_timeout_s``; a prompt sent again is answered from a bounded
cache. Any failure leaves the request on the approximate index: placement never waits on
this past its bound, and a tokenizer that fails never fails a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import trio

from narwhal.core.config import FleetConfig
from narwhal.core.faults import RequestFault
from narwhal.core.fleet import EngineState, Fleet
from narwhal.core.precise_index import TokenPrompt
from narwhal.core.requests import ClientRequest, spliceable
from narwhal.core.token_ids import IdsCache, read_tokens, tokenize_body
from narwhal.engines.client import EngineClient

_encode = msgspec.json.Encoder().encode


class TokenHost(Protocol):
    config: FleetConfig
    fleet: Fleet
    client: EngineClient


class TokenSource:
    def __init__(self, router: TokenHost, pick: Callable[[], EngineState]) -> None:
        self.router = router
        self._pick = pick  # a placeable engine: every one tokenizes alike
        self.cache = IdsCache()
        self.asked = self.failed = 0

    def wanted(self) -> bool:
        """Whether a request's ids would be read: events on, and some stream live."""
        config = self.router.config.kv_events
        return config.mode != "off" and self.router.fleet.precise.any_live()

    async def ids_of(self, req: ClientRequest, rid: str) -> TokenPrompt | None:
        """The request's ids, or None when they cannot be had within the bound."""
        body = tokenize_body(spliceable(req.body), self.router.config.model, chat=req.chat)
        payload = _encode(body)
        cached = self.cache.get(payload)
        if cached is not None:
            return TokenPrompt(cached)
        ids = await self._ask(payload, rid)
        if ids is None:
            self.failed += 1
            return None
        self.cache.put(payload, ids)
        return TokenPrompt(ids)

    async def _ask(self, payload: bytes, rid: str) -> Sequence[int] | None:
        self.asked += 1
        with trio.move_on_after(self.router.config.engine.health_timeout_s):
            try:
                engine = self._pick()
                data = await self.router.client.pass_through(
                    engine.url, "/tokenize", payload, request_id=f"{rid}-a1-tokenize"
                )
            except RequestFault:
                return None
            return read_tokens(data)
        return None
