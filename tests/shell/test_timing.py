"""Timeouts to the tick, on trio's MockClock over in-memory streams (no real sleeps).

Router, engine client and fake engines all run on ``tests.support.memory_network``; with
autojump, virtual time only moves when everything waits, so each timeout fires at exactly
its budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trustme

from narwhal.core.config import EngineConfig, RecoveryConfig, ServingConfig
from narwhal.core.faults import ConnectTimeout
from narwhal.engines.client import EngineClient
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL
from tests.support.memory_fleet import memory_fleet
from tests.support.memory_network import MemoryNetwork

STREAM = {"model": MODEL, "prompt": "one two three", "max_tokens": 8, "stream": True}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
}


async def test_success_takes_no_virtual_time(nursery: trio.Nursery, autojump_clock: Any) -> None:
    fleet = await memory_fleet(nursery)
    sink = await fleet.request(STREAM)
    assert sink.events[-1][1] == "end"
    assert trio.current_time() == 0.0
    assert fleet.router.journal.lines[-1].outcome == "completed"


async def test_first_token_timeout_counts_the_header_delay(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, engine=EngineConfig(first_token_timeout_s=2.5))
    for kind in ("hang", "headers_then_silence"):
        fleet.consumer.faults.push(Fault(kind=kind, leg="decode"))  # type: ignore[arg-type]
        start = trio.current_time()
        sink = await fleet.request(STREAM)
        when, status, message = sink.error
        assert when - start == 2.5
        assert status == 504
        assert message.startswith("no first token within 2.5s")
        assert sink.events[-1][1] != "commit"


async def test_metadata_chunks_do_not_satisfy_the_first_token_budget(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, engine=EngineConfig(first_token_timeout_s=2.5))
    fleet.consumer.faults.push(Fault(kind="metadata_then_silence"))
    sink = await fleet.request(CHAT, "/v1/chat/completions")
    when, status, message = sink.error
    assert (when, status) == (2.5, 504)
    assert message.startswith("no first token within")
    assert [what for _, what, _ in sink.events] == ["json"]  # nothing was committed


async def test_silence_fires_at_last_chunk_plus_budget_and_metadata_resets_it(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, itl_s=1.0, engine=EngineConfig(decode_read_timeout_s=10.0))
    # tokens at t=0, 1, 2 then silence: the stream is declared dead at 2 + 10
    fleet.consumer.faults.push(Fault(kind="tokens_then_silence", tokens=3))
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (12.0, 504)
    assert message.startswith("engine went silent between tokens")
    assert sink.events[0][1] == "commit"  # headers went out with the first token
    # the same, with a keep-alive comment 5 s after the last token: dead at 2 + 5 + 10
    fleet.consumer.faults.push(Fault(kind="tokens_then_silence", tokens=3, keepalive_s=5.0))
    start = trio.current_time()
    sink = await fleet.request(STREAM)
    when, status, _ = sink.error
    assert (when - start, status) == (17.0, 504)


async def test_zero_silence_budget_falls_back_to_the_deadline(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery,
        serving=ServingConfig(request_timeout_s=30.0),
        engine=EngineConfig(decode_read_timeout_s=0.0),
    )
    fleet.consumer.faults.push(Fault(kind="tokens_then_silence", tokens=2))
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (30.0, 504)
    assert message.startswith("request deadline expired")
    assert fleet.router.journal.lines[-1].outcome == "expired"


async def test_prefill_timeout_is_the_whole_leg(nursery: trio.Nursery, autojump_clock: Any) -> None:
    fleet = await memory_fleet(nursery, serving=ServingConfig(prefill_timeout_s=3.0))
    fleet.producer.faults.push(Fault(kind="hang"))
    sink = await fleet.request(STREAM)
    assert sink.error == (3.0, 504, "prefill on engine p0 took longer than 3s")
    assert not fleet.consumer.log  # no decode leg without a descriptor


async def test_handoff_age_counts_from_the_producer_leg(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    # a 3-token prompt at 1 s per token: the descriptor is 3 s old when it arrives
    fleet = await memory_fleet(
        nursery, prefill_delay=1.0, serving=ServingConfig(handoff_timeout_s=2.0)
    )
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (3.0, 504)
    assert message.startswith("KV handoff expired")
    assert not fleet.consumer.log


async def test_the_deadline_covers_retries_and_backoff(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery,
        serving=ServingConfig(
            request_timeout_s=10.0, prefill_timeout_s=3.0, max_attempts=5, retry_backoff_s=0.05
        ),
    )
    fleet.producer.faults.push(*[Fault(kind="hang")] * 5)
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (10.0, 504)
    assert message.startswith("request deadline expired")
    line = fleet.router.journal.lines[-1]
    assert line.outcome == "expired"
    assert [a.retry for a in line.attempts] == ["retry", "retry", "retry", None]
    assert len(fleet.producer.log) == 4


async def test_connect_timeout_on_the_prefill_leg(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, engine=EngineConfig(connect_timeout_s=1.5))
    host, port = fleet.producer.url.removeprefix("http://").split(":")
    fleet.producer.network.blackhole(host, int(port))  # type: ignore[union-attr]
    sink = await fleet.request(STREAM)
    when, status, message = sink.error
    assert (when, status) == (1.5, 504)
    assert message.startswith("connect to engine")


async def test_the_tls_handshake_is_bounded_by_the_connect_timeout(
    nursery: trio.Nursery, autojump_clock: Any, tmp_path: Path
) -> None:
    """A peer that takes the connection and never answers the ClientHello: the connect
    budget covers the connect and the handshake together, a ConnectTimeout (504)."""
    ca_file = tmp_path / "engines-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    network = MemoryNetwork(nursery)
    network.listen("127.0.0.1", 8443, _never_answers)
    client = EngineClient(ca_file=str(ca_file), connect_timeout_s=0.2, connect=network.open_stream)
    url = "https://127.0.0.1:8443"
    with pytest.raises(ConnectTimeout) as caught:
        await client.get(url, "/health")
    assert trio.current_time() == 0.2
    assert caught.value.status == 504
    assert client.connections()[url] == (0, 0)
    await client.aclose()


async def _never_answers(stream: trio.abc.Stream) -> None:
    async with stream:
        await stream.receive_some()  # the ClientHello, left unanswered
        await trio.sleep_forever()


async def test_connection_delay_spends_the_first_token_budget(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery, engine=EngineConfig(first_token_timeout_s=2.5, connect_timeout_s=5.0)
    )
    host, port = fleet.consumer.url.removeprefix("http://").split(":")
    fleet.consumer.network.blackhole(host, int(port))  # type: ignore[union-attr]
    sink = await fleet.request(STREAM)
    assert sink.error[:2] == (2.5, 504)
    assert sink.error[2].startswith("no first token within 2.5s")


async def test_measurement_contract(nursery: trio.Nursery, autojump_clock: Any) -> None:
    """prefill_s ends at producer completion; first_byte_s at the first generated token; the
    difference is the KV transfer plus decode queueing."""
    fleet = await memory_fleet(nursery, prefill_delay=1.0)  # 3-token prompt: 3 s of prefill
    fleet.consumer.config = msgspec.structs.replace(fleet.consumer.config, transfer_delay_s=0.5)
    await fleet.request(STREAM)
    line = fleet.router.journal.lines[-1]
    assert (line.prefill_s, line.first_byte_s, line.tokens) == (3.0, 3.5, 8)
    assert line.ttft_s == line.prefill_s  # the journal's compatibility name for it
    assert line.outcome == "completed"
    assert line.attempts[0].producer == "p0"
    assert line.attempts[0].consumer == "d0"


async def test_quarantine_excludes_a_failed_engine_and_readmits_it_on_time(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(
        nursery, consumers=2, recovery=RecoveryConfig(failure_quarantine_s=5.0, eject_after=10)
    )
    d0, d1 = fleet.consumer, fleet.others[0]
    d0.faults.push(Fault(kind="status", status=503))
    for _ in range(2):  # placement alternates: d0 gets one of the first two requests
        await fleet.request(STREAM)
        if d0.counters["fault_status"]:
            break
    assert d0.counters["fault_status"] == 1
    failed_at = trio.current_time()
    served = len(d1.log)
    for _ in range(4):
        await fleet.request(STREAM)
    assert len(d1.log) == served + 4  # d0 is quarantined: all traffic goes to d1
    await trio.sleep_until(failed_at + 4.9)
    await fleet.request(STREAM)
    assert len(d1.log) == served + 5
    await trio.sleep_until(failed_at + 5.0)
    before = len(d0.log)
    for _ in range(2):
        await fleet.request(STREAM)
    assert len(d0.log) == before + 1  # back in rotation, exactly on time
    assert fleet.router.fleet.by_id["d0"].breaker.state.value == "closed"


async def test_the_last_consumer_is_never_quarantined(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    fleet = await memory_fleet(nursery, recovery=RecoveryConfig(failure_quarantine_s=5.0))
    fleet.consumer.faults.push(Fault(kind="status", status=503))
    await fleet.request(STREAM)
    sink = await fleet.request(STREAM)  # at once: the only consumer stays placeable
    assert sink.events[-1][1] == "end"
    assert trio.current_time() == 0.0
