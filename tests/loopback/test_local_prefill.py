"""Conditional disaggregation over loopback sockets (contract 4.4): what a client gets from a
local attempt, what the engines saw, and how a stream cut after output is told (a local
leg that never answers is timed exactly in ``tests/shell/test_local_prefill.py``)."""

from __future__ import annotations

import msgspec
import trio

from narwhal.core.config import EngineConfig, PlacementConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, post_raw, start_fleet

LOCAL = PlacementConfig(local_prefill_tokens=128, metrics_interval_s=0.0)
ROLES = {"p0": "prefill", "d0": "decode"}
SHORT = {"model": MODEL, "prompt": "a short prompt", "max_tokens": 6}


async def _fleet(nursery: trio.Nursery, placement: PlacementConfig = LOCAL) -> Harness:
    return await start_fleet(
        nursery,
        ROLES,
        placement=placement,
        serving=ServingConfig(prefill_timeout_s=0.4, graceful_timeout_s=0.5),
        engine=EngineConfig(first_token_timeout_s=0.3),
    )


async def test_streamed_and_whole_answers_equal_the_disaggregated_ones(
    nursery: trio.Nursery,
) -> None:
    local, always = await _fleet(nursery), await _fleet(nursery, PlacementConfig())
    for stream in (True, False):
        for path, body in (
            ("/v1/completions", SHORT),
            ("/v1/chat/completions", {**SHORT, "messages": [{"role": "user", "content": "hi"}]}),
        ):
            asked = {**body, "stream": stream, "temperature": 0}
            ours, theirs = await local.post(path, asked), await always.post(path, asked)
            assert (ours.status, theirs.status) == (200, 200)
            if stream:
                assert ours.events()[-1] == b"[DONE]"
                assert _texts(ours.events()) == _texts(theirs.events())
            else:
                assert ours.json()["choices"] == theirs.json()["choices"]
                assert ours.json()["usage"] == theirs.json()["usage"]
    assert local.engines["p0"].counters["prefill"] == 0  # four requests, no producer leg
    assert always.engines["p0"].counters["prefill"] == 4
    assert all(a.local for line in local.router.journal.lines for a in line.attempts)
    await finish(local)
    await finish(always)


def _texts(events: list[bytes]) -> list[bytes]:
    """The events without their ids and timestamps, which differ by request."""
    out = []
    for event in events[:-1]:
        chunk = msgspec.json.decode(event)
        out.append(msgspec.json.encode(chunk["choices"]))
    return out


async def test_a_local_stream_cut_after_output_ends_with_a_terminal_event(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    harness.engines["d0"].faults.push(Fault(kind="tokens_then_close", tokens=2, leg="decode"))
    reply = await post_raw(harness, "/v1/completions", {**SHORT, "stream": True})
    assert reply.status == 200
    assert not reply.ended
    events = reply.events()
    assert events[-1] != b"[DONE]"
    assert b'"error"' in events[-1]
    assert harness.router.journal.lines[-1].outcome == "failed"
    await finish(harness)


async def test_a_long_prompt_is_handed_off_when_the_one_producer_is_also_a_consumer(
    nursery: trio.Nursery,
) -> None:
    # p0 produces and consumes, d0 only consumes: decode first may pick p0 as the consumer,
    # and the one producer is then the consumer itself. A long prompt is still handed off,
    # to d0, rather than computed on p0 alone; a short one may run on either alone.
    harness = await start_fleet(
        nursery, {"p0": "both", "d0": "decode"}, placement=LOCAL, serving=ServingConfig()
    )
    for n in range(4):
        long = {**SHORT, "prompt": f"{n}: a long prompt that no engine holds " * 40}
        assert (await harness.post("/v1/completions", long)).status == 200
    legs = [
        (a.producer, a.consumer, a.local)
        for ln in harness.router.journal.lines
        for a in ln.attempts
    ]
    assert legs == [("p0", "d0", False)] * 4
    assert harness.engines["d0"].counters["kv_pull_ok"] == 4
    await finish(harness)
