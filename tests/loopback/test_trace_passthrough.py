"""Tracing off (the default): a client's W3C trace context reaches both engine legs unchanged.

From the wire: a client sends ``traceparent``/``tracestate`` to ``narwhal serve``'s router over
loopback; what each leg carried is read back from the fake engines' ``GET /fake/log``.
"""

from __future__ import annotations

from typing import Any

import httpcore
import msgspec
import pytest
import trio

from narwhal.observe import tracing
from tests.support.fleet import MODEL, Harness, finish, start_fleet

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}


async def _legs(harness: Harness) -> dict[str, tuple[str | None, str | None]]:
    """Per leg (``p0:prefill``, ``d0:decode``): the trace headers the engine saw."""
    seen: dict[str, tuple[str | None, str | None]] = {}
    async with httpcore.AsyncConnectionPool() as http:
        for eid, engine in harness.engines.items():
            reply = await http.request("GET", engine.url + "/fake/log")
            for entry in msgspec.json.decode(reply.content)["requests"]:
                leg = entry["request_id"].rsplit("-", 1)[-1]
                seen[f"{eid}:{leg}"] = (entry["traceparent"], entry["tracestate"])
    return seen


@pytest.mark.parametrize("stream", [False, True])
async def test_both_legs_carry_the_clients_trace_context_unchanged(
    nursery: trio.Nursery, stream: bool
) -> None:
    assert not tracing.ENABLED
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    reply = await harness.post("/v1/completions", {**BODY, "stream": stream}, headers)
    assert reply.status == 200
    await harness.router.wait_drained()
    both = (TRACEPARENT, TRACESTATE)
    assert await _legs(harness) == {"p0:prefill": both, "d0:decode": both}
    await finish(harness)


async def test_every_sub_request_of_a_fan_out_carries_it(nursery: trio.Nursery) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    body: dict[str, Any] = {**BODY, "prompt": ["one", "two"]}
    reply = await harness.post("/v1/completions", body, {"traceparent": TRACEPARENT})
    assert reply.status == 200
    await harness.router.wait_drained()
    entries = [e for engine in harness.engines.values() for e in engine.log]
    assert len(entries) == 4
    assert {(e["traceparent"], e["tracestate"]) for e in entries} == {(TRACEPARENT, None)}
    await finish(harness)


@pytest.mark.parametrize(
    "traceparent",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero parent id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # 00 has 4 fields
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0x",
        "not a traceparent",
    ],
)
async def test_a_malformed_traceparent_is_not_forwarded(
    nursery: trio.Nursery, traceparent: str
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    headers = {"traceparent": traceparent, "tracestate": TRACESTATE}
    reply = await harness.post("/v1/completions", BODY, headers)
    assert reply.status == 200  # the request is served all the same
    await harness.router.wait_drained()
    assert await _legs(harness) == {"p0:prefill": (None, None), "d0:decode": (None, None)}
    await finish(harness)


async def test_a_later_version_with_more_fields_is_forwarded(nursery: trio.Nursery) -> None:
    """W3C: a vendor reads a higher version's first four fields and passes it on."""
    later = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    reply = await harness.post("/v1/completions", BODY, {"traceparent": later})
    assert reply.status == 200
    await harness.router.wait_drained()
    assert await _legs(harness) == {"p0:prefill": (later, None), "d0:decode": (later, None)}
    await finish(harness)
