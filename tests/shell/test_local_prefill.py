"""Conditional disaggregation on trio's MockClock over in-memory streams (contract 4.4): which
requests skip the producer, what their one leg carries, and how long it may take."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import trio

from narwhal.core.config import (
    AdmissionConfig,
    EngineConfig,
    PlacementConfig,
    ServingConfig,
)
from narwhal.core.prefix_index import prompt_of
from narwhal.fake_engine.faults import Fault
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, RecordingSink, memory_fleet

LOCAL = PlacementConfig(local_prefill_tokens=256, metrics_interval_s=0.0)
SHORT = {"model": MODEL, "prompt": "one two three four", "max_tokens": 8, "stream": True}
LONG = {**SHORT, "prompt": "word " * 400}  # 2,000 bytes: about 500 tokens


def _legs(fleet: MemoryFleet) -> dict[str, list[dict[str, Any]]]:
    engines = [("p0", fleet.producer), ("d0", fleet.consumer)]
    engines += [(f"d{i + 1}", e) for i, e in enumerate(fleet.others)]
    return {name: list(engine.log) for name, engine in engines}


def _text(sink: RecordingSink) -> bytes:
    """What the client read, its ``created`` fields zeroed: the wall clock's second, which
    two requests may straddle."""
    data = b"".join(data for _, what, data in sink.events if what in ("commit", "send", "end"))
    return re.sub(rb'"created": ?\d+', b'"created":0', data)


def _decisions(fleet: MemoryFleet) -> dict[str, float]:
    family = fleet.router.metrics.disaggregation
    samples = (s for m in family.collect() for s in m.samples if s.name.endswith("_total"))
    return {s.labels["decision"]: s.value for s in samples}


async def test_a_short_prompt_is_served_by_its_consumer_alone(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, placement=LOCAL)
    local = await fleet.request(SHORT)
    legs = _legs(fleet)
    assert legs["p0"] == []  # no producer leg
    (leg,) = legs["d0"]
    assert "kv_transfer_params" not in leg["body"]
    assert leg["request_id"] == "rid-a1-decode"
    line = fleet.router.journal.lines[-1]
    assert line.outcome == "completed"
    assert line.prefill_s is None
    assert line.prompt_tokens == 4  # the consumer's own count, from its usage
    assert line.attempts[0].local
    assert line.attempts[0].producer is None
    assert _decisions(fleet)["local_short"] == 1
    # the same request disaggregated streams the same bytes
    always = await memory_fleet(nursery)
    assert _text(await always.request(SHORT)) == _text(local)
    assert len(always.producer.log) == 1


async def test_a_long_prompt_and_an_echo_are_disaggregated(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, placement=LOCAL)
    await fleet.request(LONG)
    await fleet.request({**SHORT, "echo": True, "stream": False})
    assert len(fleet.producer.log) == 2
    assert all(not a.local for line in fleet.router.journal.lines for a in line.attempts)
    assert _decisions(fleet)["disaggregated"] == 2


async def test_a_local_first_token_waits_the_prefill_and_first_token_budgets(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery,
        placement=LOCAL,
        serving=ServingConfig(prefill_timeout_s=4.0, graceful_timeout_s=0.5),
        engine=EngineConfig(first_token_timeout_s=2.5),
    )
    fleet.consumer.faults.push(Fault(kind="hang", leg="decode"))
    sink = await fleet.request(SHORT)
    assert sink.events[-1][1] == "json"  # nothing was streamed: a JSON error, not an event
    when, status, message = sink.error
    assert (when, status) == (6.5, 504)  # both budgets, one after the other, to the tick
    assert message.startswith("no first token within 6.5s from engine d0")
    line = fleet.router.journal.lines[-1]
    assert line.outcome == "failed"
    assert line.attempts[0].local
    assert line.prefill_s is None


async def test_a_failed_local_attempt_is_retried_on_another_consumer(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery,
        consumers=2,
        placement=LOCAL,
        serving=ServingConfig(max_attempts=3, graceful_timeout_s=0.5),
    )
    for engine in (fleet.consumer, *fleet.others):
        engine.faults.push(Fault(kind="status", status=503, leg="decode"))
    sink = await fleet.request(SHORT)
    assert sink.events[-1][1] == "end"
    first, second, third = fleet.router.journal.lines[-1].attempts
    assert first.local
    assert second.local
    assert third.local
    assert first.consumer != second.consumer  # a retry goes to other engines
    assert first.error
    assert second.error
    assert third.error is None


async def test_the_next_turn_goes_to_the_consumer_that_served_the_last(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, consumers=3, placement=LOCAL)
    system = {"role": "system", "content": "you answer in words " * 60}
    messages = [system, {"role": "user", "content": "first question " * 20}]
    body = {"model": MODEL, "max_tokens": 16, "stream": True}
    served = []
    for turn in range(4):
        sink = await fleet.request({**body, "messages": messages}, "/v1/chat/completions")
        reply = "".join(_contents(sink))
        served.append(fleet.router.journal.lines[-1].attempts[0])
        messages = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"question {turn}"},
        ]
    assert not served[0].local  # the first turn: nothing cached anywhere, a long prompt
    assert all(a.local for a in served[1:])  # then only the new message and the reply
    assert len({a.consumer for a in served}) == 1


def _contents(sink: RecordingSink) -> list[str]:
    out = []
    parser = SSEParser()
    for _, what, data in sink.events:
        if what not in ("commit", "send", "end"):
            continue
        for payload in parser.feed(data):
            if payload == b"[DONE]":
                continue
            for choice in msgspec.json.decode(payload).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return out


BUSY = PlacementConfig(local_prefill_when_busy=True, metrics_interval_s=0.0)


async def _saturated_producer(nursery: trio.Nursery, placement: PlacementConfig) -> MemoryFleet:
    """Two consumers and one producer, which a hung prefill holds saturated (a waiting
    limit of 1); the hung request holds a consumer's room for its decode too."""
    fleet = await memory_fleet(
        nursery,
        consumers=2,
        placement=placement,
        admission=AdmissionConfig(engine_waiting_limit=1, max_queue_wait_s=5.0),
    )
    fleet.producer.faults.push(Fault(kind="hang", leg="prefill"))
    nursery.start_soon(fleet.request, LONG)
    await fleet.producer.wait_logged(1)
    return fleet


async def test_busy_producers_send_a_long_prompt_to_a_consumer_with_room(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _saturated_producer(nursery, BUSY)
    sink = await fleet.request(LONG)
    assert sink.events[-1][1] == "end", sink.events
    assert fleet.router.journal.lines[-1].attempts[0].local
    assert _decisions(fleet)["local_busy"] == 1


async def test_busy_producers_hold_back_a_long_prompt_not_a_short_one(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _saturated_producer(nursery, LOCAL)
    short = await fleet.request(SHORT)
    assert trio.current_time() == 0.0  # it did not wait
    assert short.events[-1][1] == "end"
    line = fleet.router.journal.lines[-1]
    assert line.queued_s == 0.0
    assert line.attempts[0].local
    waited = await fleet.request(LONG)
    assert waited.error[1] == 429  # the producer stayed saturated past max_queue_wait_s


async def test_busy_producers_hold_back_what_needs_them_even_when_busy_may_go_local(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await _saturated_producer(nursery, BUSY)
    echo = await fleet.request({**LONG, "echo": True, "stream": False})
    assert echo.error[1] == 429  # it needs the producer's prompt side: it waited for room
    assert len(fleet.producer.log) == 1  # and never reached the saturated producer


async def test_an_engine_that_stops_answering_health_checks_is_believed_cold(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, placement=LOCAL)
    await fleet.request(LONG)
    index, blocks = fleet.router.fleet.prefixes, prompt_of(LONG, chat=False).blocks
    assert index.match("d0", blocks, trio.current_time()) == len(blocks)
    fleet.consumer.stop()  # its next health checks fail: it leaves (virtual time)
    await trio.sleep(3 * fleet.router.config.engine.health_interval_s)
    assert not fleet.router.fleet.by_id["d0"].up
    assert index.match("d0", blocks, trio.current_time()) == 0
