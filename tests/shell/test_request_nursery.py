"""Each request runs in a nursery of its own (docs/architecture.md, "The life of one
request"), on trio's MockClock over in-memory streams: what it started beside its main
line ends with it, and its limit (the deadline) answers the client once, in time."""

from __future__ import annotations

from typing import Any

import msgspec
import trio
import trio.testing

from narwhal.core.config import ServingConfig
from narwhal.core.requests import parse_request
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL
from tests.support.memory_fleet import RecordingSink, memory_fleet

BODY = {"model": MODEL, "prompt": "word", "max_tokens": 2}


async def test_the_disconnect_watch_ends_with_the_request(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """A server with no disconnect callback: the request's nursery runs a task that waits
    for the client to go, which never happens here. The request still ends at once when
    its answer is out, and leaves no task behind."""
    fleet = await memory_fleet(nursery)
    req = parse_request(msgspec.json.encode(BODY), endpoint="/v1/completions", model=MODEL)
    sink = RecordingSink()
    with trio.fail_after(5):
        run = await fleet.router.handle(req, "rid", sink, trio.sleep_forever)
    assert run.record.outcome == "completed"
    assert sink.finished
    assert trio.current_time() < 1.0  # handle returned: its nursery's watch task ended


async def test_the_deadline_answers_504_once_and_the_watch_ends(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """A prefill that hangs: the request's deadline (its nursery's limit) ends it at the
    deadline with one 504 the client reads, and the watch task ends with it."""
    fleet = await memory_fleet(nursery, serving=ServingConfig(request_timeout_s=3.0))
    fleet.producer.faults.push(Fault(kind="hang", leg="prefill"))
    req = parse_request(msgspec.json.encode(BODY), endpoint="/v1/completions", model=MODEL)
    sink = RecordingSink()
    with trio.fail_after(60):
        run = await fleet.router.handle(req, "rid", sink, trio.sleep_forever)
    when, status, message = sink.error
    assert (when, status) == (3.0, 504), message
    assert [what for _, what, _ in sink.events] == ["json"]  # one answer
    assert run.record.outcome == "expired"
    assert fleet.router.journal.lines[-1].status == 504


async def test_a_scope_around_the_request_cancels_it_without_an_answer(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    """Cancelled from outside (its connection's end), the request is cancelled: it answers
    nothing (nobody would read it) and its journal line says so."""
    fleet = await memory_fleet(nursery)
    fleet.producer.faults.push(Fault(kind="hang", leg="prefill"))
    req = parse_request(msgspec.json.encode(BODY), endpoint="/v1/completions", model=MODEL)
    sink = RecordingSink()
    with trio.move_on_after(2.0):
        await fleet.router.handle(req, "rid", sink, trio.sleep_forever)
    assert sink.events == []
    assert fleet.router.journal.lines[-1].outcome == "cancelled"
