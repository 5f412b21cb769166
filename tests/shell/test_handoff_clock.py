"""The handoff clock covers the send (contract 5): a descriptor is never sent to a consumer
once it is older than the lease allows (or ``serving.handoff_timeout_s``), however long the
decode leg waits for a pool slot or a connect after the age was first checked. Timed to the
tick on trio's MockClock over the in-memory network."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import trio

from narwhal.core.config import EngineConfig, ServingConfig
from tests.support.fleet import MODEL
from tests.support.memory_fleet import MemoryFleet, memory_fleet

# a 3-token prompt ("one two three") at 0.5 s a token: the descriptor is 1.5 s old in hand
STREAM = {"model": MODEL, "prompt": "one two three", "max_tokens": 8, "stream": True}
PREFILL_S = 1.5
LEASE = EngineConfig(kv_lease_s=4.0, first_token_timeout_s=10.0, max_connections=1)


def decode_requests(fleet: MemoryFleet) -> list[Any]:
    """What reached the consumer: any request there carried the descriptor."""
    return list(fleet.consumer.log)


async def test_a_full_consumer_pool_cannot_outwait_the_lease(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """The age is fine when the descriptor comes back (1.5 s of a 3.9 s limit); the
    consumer's only connection is busy well past the limit. The decode request is never
    sent: the client gets 504 at the limit to the tick, not at the first-token budget."""
    fleet = await memory_fleet(nursery, prefill_delay=0.5, engine=LEASE)
    limiter = fleet.router.client.limiter(fleet.consumer.url)
    busy = object()
    await limiter.acquire_on_behalf_of(busy)  # another request holds the only slot
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert status == 504
    assert when == pytest.approx(LEASE.lease_limit_s)
    assert message.startswith("KV handoff expired")
    assert decode_requests(fleet) == []
    (attempt,) = fleet.router.journal.lines[-1].attempts
    assert attempt.handoff_fate == "expired"
    limiter.release_on_behalf_of(busy)


async def test_a_slow_connect_to_the_consumer_cannot_outwait_the_handoff_limit(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """``serving.handoff_timeout_s`` 2 s, a consumer whose connect hangs (5 s connect
    budget): the clock fires at 2.0 s from the producer leg's start, not at the connect's
    timeout, and the consumer holds nothing."""
    engine = EngineConfig(first_token_timeout_s=10.0, connect_timeout_s=5.0)
    fleet = await memory_fleet(
        nursery,
        prefill_delay=0.5,
        engine=engine,
        serving=ServingConfig(handoff_timeout_s=2.0),
    )
    assert fleet.network is not None
    parts = urlsplit(fleet.consumer.url)
    fleet.network.blackhole(parts.hostname or "", parts.port or 80)
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (2.0, 504)
    assert message.startswith("KV handoff expired")
    assert "was sent" in message  # the send, not the age at the descriptor's arrival
    assert decode_requests(fleet) == []
    (attempt,) = fleet.router.journal.lines[-1].attempts
    assert attempt.handoff_fate == "expired"


async def test_a_consumer_with_room_takes_the_descriptor_at_once(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """The clock costs nothing when nothing waits: the stream completes, decoded."""
    fleet = await memory_fleet(nursery, prefill_delay=0.5, engine=LEASE)
    sink = await fleet.request(STREAM)
    assert sink.events[-1][1] == "end"
    assert trio.current_time() == PREFILL_S
    (attempt,) = fleet.router.journal.lines[-1].attempts
    assert attempt.handoff_fate == "decoded"
