"""A request's token ids as its engines' tokenizer gives them, for the precise prefix index.

``[kv_events] tokenizer = "engine"`` asks the engine's own ``POST /tokenize``; a path to
the model's ``tokenizer.json`` tokenizes a text completion prompt here, with Hugging Face
``tokenizers`` (the library vLLM's own fast tokenizer is), and still asks the engine for a
chat, whose template only the engine renders.

Asked only while some engine's KV-event stream is live (else nothing would read them),
once per request before its first placement, of a placeable engine over the data pool,
bounded by ``TOKENIZE_TIMEOUT_S`` (or ``engine.health_timeout_s`` when shorter), and not
asked again for ``BACKOFF_S`` after a failure: an engine whose ``/tokenize`` hangs costs one
request that bound, not every request; a prompt sent again is answered from a bounded
cache. Any failure leaves the request on the approximate index: placement never waits on
this past its bound, and a tokenizer that fails never fails a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import trio

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.engine_state import LEGS, EngineState
from narwhal.core.faults import RequestFault
from narwhal.core.fleet import Fleet
from narwhal.core.precise_index import TokenPrompt
from narwhal.core.requests import ClientRequest, spliceable
from narwhal.core.token_ids import IdsCache, read_tokens, tokenize_body
from narwhal.engines.client import EngineClient

_encode = msgspec.json.Encoder().encode
TOKENIZE_TIMEOUT_S = 0.5  # vLLM tokenizes a long prompt in milliseconds; past this, estimate
BACKOFF_S = 5.0  # after a failed /tokenize, requests go on the estimate this long


class TokenHost(Protocol):
    config: FleetConfig
    fleet: Fleet
    client: EngineClient


class LocalTokenizer:
    """A ``tokenizer.json`` read at start, for text completion prompts."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise OSError(
                "needs the tokenizers package (pip install 'narwhal[tokenizer]')"
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:  # the library's own error type is not exported
            raise OSError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None

    def ids(self, prompt: str, add_special_tokens: bool) -> list[int]:
        return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)


class TokenSource:
    def __init__(self, router: TokenHost, pick: Callable[[str | None], EngineState]) -> None:
        self.router = router
        self._pick = pick  # a placeable engine: every one tokenizes alike
        self.cache = IdsCache()
        self.asked = self.failed = 0
        self._quiet_until = -1.0  # a failure's back-off: no call before then
        self.local: LocalTokenizer | None = None
        self.configure(router.config)

    def configure(self, config: FleetConfig) -> None:
        """Read the fleet file's tokenizer (at start and on reload); ``ConfigError`` when
        a ``tokenizer.json`` cannot be read."""
        path = config.kv_events.tokenizer
        if path == "engine":
            self.local = None
            return
        try:
            self.local = LocalTokenizer(path)
        except OSError as exc:
            problem = f"kv_events.tokenizer: cannot read {path}: {exc}"
            raise ConfigError("<fleet>", [problem]) from None

    def wanted(self, *, decode_first: bool) -> bool:
        """Whether a request's ids could change what placement does: events on, and an
        engine with a live stream among two or more candidates for a leg, or, decode first,
        a live consumer (its uncached part decides whether the attempt is local). A fleet
        of one producer and one consumer that always disaggregates pays nothing."""
        fleet, now = self.router.fleet, trio.current_time()
        if self.router.config.kv_events.mode == "off" or now < self._quiet_until:
            return False
        for leg in LEGS:
            candidates = fleet.placeable(leg, now)[0]
            contested = len(candidates) >= 2 or (decode_first and leg == "decode")
            if contested and any(fleet.precise.live(e.id) is not None for e in candidates):
                return True
        return False

    async def ids_of(
        self, req: ClientRequest, rid: str, adapter: str | None = None
    ) -> TokenPrompt | None:
        """The request's ids (under ``adapter``: its blocks are that adapter's), or None
        when they cannot be had within the bound."""
        prompt = None if self.local is None or req.chat else req.body.get("prompt")
        if self.local is not None and isinstance(prompt, str):
            special = req.body.get("add_special_tokens", True) is not False
            return TokenPrompt(self.local.ids(prompt, special), adapter)
        model = req.model or self.router.config.model
        body = tokenize_body(spliceable(req.body), model, chat=req.chat)
        payload = _encode(body)
        cached = self.cache.get(payload)
        if cached is not None:
            return TokenPrompt(cached, adapter)
        ids = await self._ask(payload, rid, model)
        if ids is None:
            self.failed += 1
            self._quiet_until = trio.current_time() + BACKOFF_S
            return None
        self.cache.put(payload, ids)
        return TokenPrompt(ids, adapter)

    async def _ask(self, payload: bytes, rid: str, model: str) -> Sequence[int] | None:
        self.asked += 1
        with trio.move_on_after(
            min(TOKENIZE_TIMEOUT_S, self.router.config.engine.health_timeout_s)
        ):
            try:
                engine = self._pick(model)
                data = await self.router.client.pass_through(
                    engine.url, "/tokenize", payload, request_id=f"{rid}-a1-tokenize"
                )
            except RequestFault:
                return None
            return read_tokens(data)
        return None
