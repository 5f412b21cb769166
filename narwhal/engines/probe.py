"""One crossed KV handoff outside client traffic: the inference probe, lifecycle validation
and ``narwhal check`` all run this (a real one-token prefill, then a real decode).

Each leg is bounded by its own budget. The result says which side failed, so a probe can
tell "the engine under test failed" from "its peer failed" (inconclusive).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from typing import Literal

import msgspec
import trio

from narwhal.core.connector import PrefillResult
from narwhal.core.faults import RequestFault
from narwhal.engines.client import DecodeStream, EngineClient
from narwhal.stream.rules import Fault, Finish, StreamRelay

Side = Literal["producer", "consumer"]
_counter = itertools.count(1)


class HandoffResult(msgspec.Struct):
    ok: bool
    tokens: int = 0
    prefill_s: float = 0.0
    first_token_s: float | None = None  # from the start of the decode leg
    failed_side: Side | None = None
    error: str | None = None
    # a descriptor no decode leg took (the consumer failed before accepting it): it pins
    # KV on the producer until its lease unless the caller has it reclaimed
    orphan: PrefillResult | None = None
    request_id: str = ""  # the probe's backend id stem (``<id>-prefill``, ``<id>-decode``)
    started: float = 0.0  # when the prefill leg started: the descriptor's age counts from it


def probe_prompt(engine_id: str) -> str:
    """A fresh, unique prompt, so no prefix cache answers for the engine."""
    return f"narwhal probe {engine_id} {next(_counter)} {secrets.token_hex(6)}"


async def crossed_handoff(
    client: EngineClient,
    model: str,
    producer_url: str,
    consumer_url: str,
    *,
    leg_timeout_s: float,
    prompt: str,
    max_tokens: int = 4,
    request_id: str = "",
) -> HandoffResult:
    """Prefill on the producer, decode on the consumer with its descriptor, to [DONE]."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    rid = request_id or f"probe-{secrets.token_hex(6)}"
    start = trio.current_time()
    with trio.move_on_after(leg_timeout_s) as prefill_clock:
        try:
            result = await client.prefill(
                producer_url, "/v1/completions", body, request_id=f"{rid}-prefill"
            )
        except RequestFault as fault:
            return HandoffResult(ok=False, failed_side="producer", error=fault.message)
    if prefill_clock.cancelled_caught:
        return HandoffResult(
            ok=False,
            failed_side="producer",
            error=f"prefill took longer than {leg_timeout_s:g}s",
        )
    prefill_s = trio.current_time() - start
    decode_start = trio.current_time()
    first: list[float] = []
    accepted = False  # the consumer answered the decode leg: reading the KV is its job
    error: str | None = None
    tokens = 0
    with trio.move_on_after(leg_timeout_s) as decode_clock:
        try:
            async with client.decode(
                consumer_url, "/v1/completions", body, result, request_id=f"{rid}-decode"
            ) as stream:
                accepted = True
                tokens = await count_tokens(stream, lambda: first.append(trio.current_time()))
        except RequestFault as fault:
            error = fault.message
    if decode_clock.cancelled_caught:
        error = f"decode gave no complete stream within {leg_timeout_s:g}s"
    if decode_clock.cancelled_caught or error is not None:
        return HandoffResult(
            ok=False,
            prefill_s=prefill_s,
            failed_side="consumer",
            error=error,
            orphan=None if accepted else result,
            request_id=rid,
            started=start,
        )
    return HandoffResult(
        ok=True,
        tokens=tokens,
        prefill_s=prefill_s,
        first_token_s=first[0] - decode_start if first else None,
    )


async def count_tokens(stream: DecodeStream, on_first: Callable[[], None] | None = None) -> int:
    """Read a decode stream to ``[DONE]`` by the client path's rules (``StreamRelay``); the
    number of generated tokens (at least one). A broken stream raises its fault."""
    relay = StreamRelay(_Discard())
    async for data in stream:
        before = relay.tokens
        action = relay.feed(data)
        if relay.tokens and not before and on_first is not None:
            on_first()
        if isinstance(action, Fault):
            raise action.fault
        if isinstance(action, Finish):
            return relay.tokens
    raise relay.end_of_stream().fault


class _Discard:
    """A probe keeps no output: only the relay's token count and verdict matter."""

    def add(self, payload: bytes) -> None:
        pass

    def body(self) -> bytes:
        return b""


class _Version(msgspec.Struct):
    version: str = ""


class _Card(msgspec.Struct):
    id: str = ""


class _Models(msgspec.Struct):
    data: list[_Card] = []


def version_matches(version: str, pinned: str) -> bool:
    """Exact, or the same release with a local build tag (``0.32.0+cpu`` for ``0.32.0``)."""
    return version == pinned or version.split("+", 1)[0] == pinned


async def identity_problem(
    client: EngineClient, url: str, *, model: str, pinned_version: str | None, timeout_s: float
) -> str | None:
    """None when the engine answers ``/health``, runs the pinned version (if any) and lists
    ``model``; otherwise what is wrong, in words."""
    with trio.move_on_after(timeout_s):
        try:
            status, _ = await client.get(url, "/health")
            if status != 200:
                return f"/health answered {status}"
            status, body = await client.get(url, "/version")
            version = msgspec.json.decode(body, type=_Version).version if status == 200 else "?"
            if pinned_version is not None and not version_matches(version, pinned_version):
                return f"version {version!r}, the contract pins {pinned_version!r}"
            status, body = await client.get(url, "/v1/models")
            models = [c.id for c in msgspec.json.decode(body, type=_Models).data]
            if status != 200 or model not in models:
                return f"does not serve model {model!r} (serves {models})"
            return None
        except RequestFault as fault:
            return f"unreachable: {fault.message}"
        except (msgspec.MsgspecError, RecursionError) as exc:
            return f"unreadable answer: {exc}"
    return f"no answer within {timeout_s:g}s"
