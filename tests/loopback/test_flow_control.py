"""Flow control on the wire (contract 3, 4.5): the priority and tenant headers, the queue's
429s with ``Retry-After``, a client leaving while queued, and what an operator reads
(``/metrics``, ``/narwhal/engines``, the journal). The drain's 503 to a queued request,
which needs no socket to show, is timed exactly in ``tests/shell/test_admission_queue.py``.

The producer's prefill hangs for the request that holds it, and ``engine_waiting_limit =
1`` makes that one leg fill it: everything sent after it waits in the router.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from narwhal.core.config import AdmissionConfig, PlacementConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, post_raw, start_fleet

BODY = {"model": MODEL, "prompt": "hold on", "max_tokens": 2}
PD = {"p0": "prefill", "d0": "decode"}
ONE_AT_A_TIME = AdmissionConfig(engine_waiting_limit=1, max_queued=1, max_queue_wait_s=20.0)
SERVING = ServingConfig(graceful_timeout_s=1.0, prefill_timeout_s=30.0, request_timeout_s=40.0)


async def _saturated(nursery: trio.Nursery, **sections: Any) -> Harness:
    """A fleet whose producer is held by one hanging prefill (started here; ``_release``
    ends it, as its client leaving would)."""
    sections.setdefault("admission", ONE_AT_A_TIME)
    h = await start_fleet(
        nursery,
        PD,
        serving=SERVING,
        placement=PlacementConfig(metrics_interval_s=0.0),
        **sections,
    )
    h.engines["p0"].faults.push(Fault(kind="hang", leg="prefill"))
    held = trio.CancelScope()
    HOLDS[h.url] = held

    async def hold() -> None:
        with held:
            await post_raw(h, "/v1/completions", {**BODY, "prompt": "held"})

    nursery.start_soon(hold)
    with trio.fail_after(10):
        await h.engines["p0"].wait_running()
    return h


HOLDS: dict[str, trio.CancelScope] = {}


async def _release(h: Harness, *, disconnects: int = 1) -> None:
    """The held request's client leaves; then every test's end checks (``finish``)."""
    HOLDS.pop(h.url).cancel()
    await finish(h, disconnects=disconnects)


async def _queued(h: Harness, n: int, cls: str | None = None) -> dict[str, Any]:
    """``/narwhal/engines`` once ``n`` requests (of ``cls``, or in all) wait in the queue,
    as an operator sees it."""
    for _ in range(500):
        view: dict[str, Any] = (await h.get("/narwhal/engines")).json()
        queued = view["queued"]
        if (queued[cls] if cls else sum(queued.values())) == n:
            return view
    raise AssertionError(f"the queue never held {n}")


async def test_an_unknown_priority_or_tenant_is_a_400_naming_the_header(pd: Harness) -> None:
    for header, value in (("x-narwhal-priority", "urgent"), ("x-narwhal-tenant", "a b")):
        reply = await pd.post("/v1/completions", BODY, {header: value})
        assert reply.status == 400
        error = reply.json()["error"]
        assert error["message"].startswith(f"{header}:")
        assert error["param"] == header
        assert reply.headers["x-request-id"]
    assert [line.outcome for line in pd.router.journal.lines] == ["rejected", "rejected"]
    assert not pd.engines["p0"].log  # refused before any engine leg
    ok = await pd.post("/v1/completions", BODY, {"x-narwhal-priority": "batch"})
    assert ok.status == 200
    await pd.router.wait_drained()  # its journal line is written after its last byte
    assert pd.router.journal.lines[-1].cls == "batch"


async def test_a_full_queue_answers_429_queue_full_with_retry_after(
    nursery: trio.Nursery,
) -> None:
    h = await _saturated(nursery)
    nursery.start_soon(post_raw, h, "/v1/completions", {**BODY, "prompt": "queued"})
    view = await _queued(h, 1)
    assert view["queued"]["default"] == 1
    p0 = next(e for e in view["engines"] if e["id"] == "p0")
    assert p0["saturation"]["saturated"] == "waiting"
    assert p0["saturation"]["ours_not_started"] == 1

    refused = await h.post("/v1/completions", BODY)
    assert refused.status == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"] == "queue full"
    # an interactive arrival displaces the queued default request instead
    urgent = {"x-narwhal-priority": "interactive"}
    nursery.start_soon(post_raw, h, "/v1/completions", {**BODY, "prompt": "urgent"}, urgent)
    displaced = await _queued(h, 1, "interactive")
    assert displaced["queued"] == {"interactive": 1, "default": 0, "batch": 0}
    metrics = (await h.get("/metrics")).body.decode()
    shed = 'narwhal_queue_shed_total{class="default",model="%s",reason="%s"} 1.0'
    assert shed % (MODEL, "queue_full") in metrics
    assert shed % (MODEL, "displaced") in metrics
    assert f'narwhal_queue_depth{{class="interactive",model="{MODEL}"}} 1.0' in metrics
    assert 'narwhal_engine_saturated{engine="p0",reason="waiting"} 1.0' in metrics
    await _release(h)


async def test_a_client_that_leaves_while_queued_never_reaches_an_engine(
    nursery: trio.Nursery,
) -> None:
    h = await _saturated(nursery)
    host, port = h.url.removeprefix("http://").split(":")
    body = msgspec.json.encode({**BODY, "prompt": "leaves"})
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    await _queued(h, 1)
    await stream.aclose()
    await _queued(h, 0)  # gone from the queue while the producer is still held
    line = next(line for line in h.router.journal.lines if line.outcome == "cancelled")
    assert line.attempts == []
    assert len(h.engines["p0"].log) == 1  # the held request's prefill only
    await _release(h, disconnects=2)


@pytest.mark.parametrize("priority_from", ["key", "header"])
async def test_the_class_may_come_from_the_client_key(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, priority_from: str
) -> None:
    monkeypatch.setenv("NARWHAL_TEST_CLASS_KEYS", "interactive:fast-key,slow-key")
    serving = ServingConfig(graceful_timeout_s=0.5, api_keys_env="NARWHAL_TEST_CLASS_KEYS")
    flow = AdmissionConfig(priority_from=priority_from)  # type: ignore[arg-type]
    h = await start_fleet(nursery, PD, serving=serving, admission=flow)
    asks = {"fast-key": "batch", "slow-key": "interactive", "interactive:fast-key": "batch"}
    seen = {}
    for key, header in asks.items():
        headers = {"authorization": f"Bearer {key}", "x-narwhal-priority": header}
        reply = await h.post("/v1/completions", BODY, headers)
        await h.router.wait_drained()
        seen[key] = (reply.status, h.router.journal.lines[-1].cls)
    if priority_from == "key":  # the key's class; a key of no class takes the default
        assert seen == {
            "fast-key": (200, "interactive"),
            "slow-key": (200, "default"),
            "interactive:fast-key": (401, None),
        }
    else:  # the entry is the key, as written
        assert seen == {
            "fast-key": (401, None),
            "slow-key": (200, "interactive"),
            "interactive:fast-key": (200, "batch"),
        }
    await finish(h)
