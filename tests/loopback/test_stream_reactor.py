"""The stream reactor: parked decode streams are read from one task, and every
way out of a park (a result, an error, cancellation, the reactor stopping) leaves the
parked request's task in charge with its socket unregistered."""

from __future__ import annotations

import gc
import math
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.config import EngineConfig
from narwhal.core.lifecycle import Input, Lifecycle
from narwhal.core.request_events import Committed, FirstToken
from narwhal.engines.client import EngineClient
from narwhal.fake_engine.faults import Fault
from narwhal.frontdoor.send_lock import SendLock
from narwhal.observe.batched_histogram import RequestBuckets
from narwhal.observe.metrics import Metrics
from narwhal.router.stream_reactor import (
    HAND_BACK,
    STALE_DUES_FACTOR,
    STALE_DUES_SLACK,
    TIME_UP,
    StreamReactor,
)
from narwhal.router.token_path import ClientStream, TokenPath
from narwhal.stream.assemble import Assembler
from narwhal.stream.rules import StreamRelay
from tests.support.fleet import MODEL, finish, post_raw, start_fleet
from tests.support.wire import CHUNK, EVENT, HEAD, serve_once


class Parked:
    """A socket as the reactor parks it (``narwhal.lowlevel.fast_io.Parkable``): its number now, and
    the hook its closer calls first."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.before_close: Callable[[BaseException], None] | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        hook, self.before_close = self.before_close, None
        if hook is not None:
            hook(trio.ClosedResourceError("closed by another task"))
        self.sock.close()


def reader(sock: socket.socket, got: list[bytes], until: bytes) -> Callable[[], object]:
    """An ``on_ready`` that reads what is there and hands back ``"done"`` after ``until``."""

    def on_ready() -> object:
        data = sock.recv(4096)
        got.append(data)
        return "done" if b"".join(got).endswith(until) else None

    return on_ready


@pytest.fixture
async def reactor(nursery: trio.Nursery) -> StreamReactor:
    reactor = StreamReactor()
    await nursery.start(reactor.run)
    return reactor


async def test_a_parked_task_sleeps_until_its_callback_hands_back(reactor: StreamReactor) -> None:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        result: list[object] = []

        async def parked() -> None:
            result.append(await reactor.park(Parked(ours), reader(ours, got, b"end")))

        nursery.start_soon(parked)
        for part in (b"one ", b"two ", b"end"):
            await trio.testing.wait_all_tasks_blocked()
            theirs.send(part)
    assert result == ["done"]
    assert b"".join(got) == b"one two end"
    assert len(got) == 3  # one call per readiness, in the reactor's task
    ours.close()
    theirs.close()


async def test_what_the_callback_raises_is_raised_in_the_parked_task(
    reactor: StreamReactor,
) -> None:
    ours, theirs = socket.socketpair()

    def broken() -> object:
        raise ValueError("engine garbage")

    theirs.send(b"x")
    with pytest.raises(ValueError, match="engine garbage"):
        await reactor.park(Parked(ours), broken)
    # the socket is free again: parking it once more registers it anew
    assert await reactor.park(Parked(ours), lambda: "again") == "again"
    ours.close()
    theirs.close()


async def test_on_due_is_called_at_its_time_and_names_the_next(
    reactor: StreamReactor, autojump_clock: trio.testing.MockClock
) -> None:
    ours, theirs = socket.socketpair()
    start = trio.current_time()
    calls: list[float] = []

    def on_due() -> float:
        calls.append(trio.current_time() - start)
        if len(calls) == 3:
            raise ValueError("the third call fails")
        return trio.current_time() + 2.0

    with pytest.raises(ValueError, match="third"):
        await reactor.park(Parked(ours), lambda: None, start + 1.0, on_due)
    assert calls == pytest.approx([1.0, 3.0, 5.0])
    ours.close()
    theirs.close()


async def test_on_due_saying_none_hands_the_request_back_time_up(
    reactor: StreamReactor, autojump_clock: trio.testing.MockClock
) -> None:
    ours, theirs = socket.socketpair()
    start = trio.current_time()
    assert await reactor.park(Parked(ours), lambda: None, start + 1.0, lambda: None) is TIME_UP
    assert trio.current_time() == start + 1.0
    ours.close()
    theirs.close()


async def test_a_sooner_due_parked_while_the_reactor_waits_is_called_at_its_time(
    reactor: StreamReactor, autojump_clock: trio.testing.MockClock
) -> None:
    """The reactor waits under a timer of its own, armed at the earliest due; a request
    that parks with a sooner one wakes it to arm it anew (it moves no other task's clock)."""
    later, theirs = socket.socketpair()
    sooner, others = socket.socketpair()
    start = trio.current_time()
    called: list[float] = []

    def time_up() -> None:
        called.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reactor.park, Parked(later), lambda: None, start + 100.0, time_up)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(10):  # virtual: had the reactor slept on, at its first due
            assert await reactor.park(Parked(sooner), lambda: None, start + 1.0, time_up) is TIME_UP
        assert called == [1.0]
        nursery.cancel_scope.cancel()
    for sock in (later, theirs, sooner, others):
        sock.close()


async def test_a_deadline_that_has_come_cancels_at_the_next_checkpoint(
    mock_clock: trio.testing.MockClock,
) -> None:
    """What a parked request relies on when it is handed back ``TIME_UP``: its task puts its
    clock's deadline back to a time that has come (now included: virtual time stands
    still here) and is cancelled by that clock at its next checkpoint, which says so."""
    for before in (0.0, 1.0):
        with trio.CancelScope(deadline=math.inf) as clock:
            clock.deadline = trio.current_time() - before
            await trio.lowlevel.checkpoint()
            pytest.fail("the clock's deadline had come")
        assert clock.cancelled_caught


async def test_cancellation_unparks_and_the_callback_never_runs_after(
    reactor: StreamReactor, autojump_clock: trio.testing.MockClock
) -> None:
    ours, theirs = socket.socketpair()
    calls: list[str] = []
    start = trio.current_time()
    with trio.move_on_after(0.05) as scope:
        await reactor.park(Parked(ours), lambda: calls.append("late"))
    assert scope.cancelled_caught
    assert trio.current_time() == start + 0.05  # the deadline, to the tick (virtual time)
    theirs.send(b"after the deadline")
    await trio.testing.wait_all_tasks_blocked()
    await trio.sleep(0.01)  # virtual: a turn of the reactor's loop, had the socket stayed in it
    assert calls == []
    ours.close()
    theirs.close()


async def test_a_stopping_reactor_hands_every_parked_task_back(nursery: trio.Nursery) -> None:
    reactor = StreamReactor()
    stop = trio.CancelScope()

    async def run_until_stopped(task_status: trio.TaskStatus[None]) -> None:
        with stop:
            await reactor.run(task_status=task_status)

    await nursery.start(run_until_stopped)
    ours, theirs = socket.socketpair()
    results: list[object] = []
    async with trio.open_nursery() as parked:
        parked.start_soon(lambda: _park_into(reactor, ours, results))
        await trio.testing.wait_all_tasks_blocked()
        stop.cancel()
    assert results == [HAND_BACK]
    assert not reactor.running
    # and with no reactor running, a park is a checkpoint that says: read it yourself
    assert await reactor.park(Parked(ours), lambda: "never") is HAND_BACK
    ours.close()
    theirs.close()


async def _park_into(reactor: StreamReactor, sock: socket.socket, results: list[object]) -> None:
    results.append(await reactor.park(Parked(sock), lambda: None))


async def test_the_send_lock_may_be_released_by_another_task() -> None:
    """A partial client write begun in the reactor's task is finished, and the lock
    released, by the request's task (trio's Lock refuses that)."""
    lock = SendLock()
    lock.acquire_nowait()
    assert lock.locked()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_release, lock)
    assert not lock.locked()
    async with lock:
        assert lock.locked()
    assert not lock.locked()


async def _release(lock: SendLock) -> None:
    lock.release()


async def test_a_body_read_whole_with_its_head_is_never_parked(nursery: trio.Nursery) -> None:
    """The bytes that came with the head may hold the whole body: its socket will not be
    readable again (keep-alive), so parking on it would wait for ever."""
    url = await serve_once(nursery, [HEAD + CHUNK + b"0\r\n\r\n"], [])
    client = EngineClient()
    async with client.decode(url, "/v1/completions", {"model": MODEL}, None) as stream:
        assert await stream.read() == EVENT
        assert stream.park_socket() is None
        assert stream.read_nowait() is None
        assert await stream.read() is None
    await client.aclose()


async def test_read_nowait_says_nothing_yet_then_the_batch_then_go_on(
    nursery: trio.Nursery,
) -> None:
    gates = [trio.Event(), trio.Event()]
    url = await serve_once(nursery, [HEAD + CHUNK, CHUNK + CHUNK, b"0\r\n\r\n"], gates)
    client = EngineClient()
    async with client.decode(url, "/v1/completions", {"model": MODEL}, None) as stream:
        assert await stream.read() == EVENT
        assert stream.park_socket() is not None
        assert stream.read_nowait() == b""  # nothing there yet
        gates[0].set()
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(stream.park_socket())  # type: ignore[arg-type]
        assert stream.read_nowait() == EVENT + EVENT
        gates[1].set()
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(stream.park_socket())  # type: ignore[arg-type]
        assert stream.read_nowait() is None  # the end: read() finishes it
        assert await stream.read() is None
    await client.aclose()


async def test_streams_and_json_answers_are_relayed_from_the_reactor(
    nursery: trio.Nursery,
) -> None:
    # tokens 2 ms apart: one socket read each, so the stream parks between them
    pd = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.002}
    )
    reactor = pd.router.reactor
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 12}
    reply = await pd.post("/v1/completions", {**body, "stream": True})
    assert reply.status == 200
    events = [e for e in reply.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    texts = [msgspec.json.decode(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert len([t for t in texts if t]) == 12
    streamed = reactor.parks
    assert streamed >= 1
    answer = await pd.post("/v1/completions", body)
    assert answer.status == 200
    assert msgspec.json.decode(answer.body)["usage"]["completion_tokens"] == 12
    assert reactor.parks > streamed
    await finish(pd)


# ---- the silence clock of a parked stream ---------------------------------------------

SILENCE = 10.0
TOKEN = (
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":" fox","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


class _WatchedClock:
    """The decode clock as ``TokenPath`` sees it, a real cancel scope underneath: each write
    of its deadline is kept, with the task that wrote it."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self.scope = scope
        self.writes: list[tuple[trio.lowlevel.Task, float]] = []

    @property
    def deadline(self) -> float:
        return self.scope.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        self.writes.append((trio.lowlevel.current_task(), value))
        self.scope.deadline = value


class _SocketStream:
    """A decode stream over one end of a socketpair: SSE bytes, no HTTP framing. Each read
    without waiting (the reactor's, while parked) notes its task and the clock's deadline."""

    def __init__(self, sock: socket.socket, clock: _WatchedClock) -> None:
        self.sock = sock
        self.parked = Parked(sock)
        self.clock = clock
        self.reads: list[tuple[trio.lowlevel.Task, float]] = []

    def park_socket(self) -> Parked:
        return self.parked

    def read_nowait(self) -> bytes | None:
        self.reads.append((trio.lowlevel.current_task(), self.clock.deadline))
        try:
            return self.sock.recv(65536) or None
        except BlockingIOError:
            return b""

    async def read(self) -> bytes | None:
        await trio.lowlevel.wait_readable(self.sock)
        return self.sock.recv(65536) or None

    async def fail(self, exc: BaseException) -> None:
        return None

    async def drain(self) -> None:
        return None


class _Nowhere:
    """The client's sink and direct write in one: every write goes out at once, nowhere."""

    async def commit(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    async def send(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()

    def write_nowait(self, body: bytes) -> bool:
        return True

    async def write_rest(self) -> None:
        await trio.lowlevel.checkpoint()


class _Decoding:
    """A request's machine where its decode leg has been dispatched: it hears the
    stream's first token and its commit, in that order."""

    def __init__(self) -> None:
        self.lifecycle = Lifecycle()
        for step in (Input.PREFILL, Input.DESCRIPTOR, Input.DISPATCH):
            self.lifecycle.advance(step)

    def handle(self, event: FirstToken | Committed) -> None:
        self.lifecycle.advance(Input.FIRST_TOKEN if type(event) is FirstToken else Input.COMMIT)


def silence_ends(gaps: list[float]) -> float:
    """When the old clock (moved on every read) fires: ``SILENCE`` after the read before
    the first gap that long, or after the last read."""
    t = 0.0
    for gap in gaps:
        if gap >= SILENCE:
            break
        t += gap
    return t + SILENCE


@dataclass
class Relayed:
    ended: float  # virtual seconds from the start
    timed_out: bool  # the decode clock ran out (else: the stream's end)
    path: TokenPath
    clock: _WatchedClock
    stream: _SocketStream
    owner: trio.lowlevel.Task  # the request's task, which owns the clock
    dues: int  # the reactor's pushes on its dues heap


async def _relay(
    sends: list[tuple[float, bytes]], *, budget: float = 100.0, json: bool = False
) -> Relayed:
    """Relay what the engine sends (each after its gap, then nothing) through a parked
    stream under its decode clock (``budget``: the first-token budget; ``json``: assembled
    for a JSON answer, else streamed), until the end or the clock runs out."""
    reactor = StreamReactor()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    with ours, theirs:
        return await _relay_over(reactor, ours, theirs, sends, budget, json)


async def _relay_over(
    reactor: StreamReactor,
    ours: socket.socket,
    theirs: socket.socket,
    sends: list[tuple[float, bytes]],
    budget: float,
    json: bool,
) -> Relayed:
    async with trio.open_nursery() as nursery:
        await nursery.start(reactor.run)

        async def engine() -> None:
            for gap, data in sends:
                await trio.sleep(gap)
                theirs.send(data)
            await trio.sleep_forever()

        nursery.start_soon(engine)
        start = trio.current_time()
        scope = trio.CancelScope(deadline=start + budget)
        clock = _WatchedClock(scope)
        gauge = RequestBuckets(Metrics(["d0"], model="m").token_gap)
        if json:
            relay = StreamRelay(Assembler(chat=False, model="m"))
            client = ClientStream(_Nowhere(), _Decoding(), None, None)
        else:
            relay, client = (
                StreamRelay(None),
                ClientStream(_Nowhere(), _Decoding(), None, _Nowhere()),
            )
        path = TokenPath(client, relay, clock, SILENCE, gauge, reactor)  # type: ignore[arg-type]
        stream = _SocketStream(ours, clock)
        with scope:
            await path.relay_all(stream)  # type: ignore[arg-type]
        ended = trio.current_time() - start
        nursery.cancel_scope.cancel()
    owner = trio.lowlevel.current_task()
    return Relayed(ended, scope.cancelled_caught, path, clock, stream, owner, reactor._seq)


async def _relay_until_silent(gaps: list[float]) -> float:
    relayed = await _relay([(0.0, TOKEN)] + [(gap, TOKEN) for gap in gaps])
    assert relayed.timed_out
    return relayed.ended


gap_values = st.one_of(
    st.floats(0.01, SILENCE * 0.49), st.floats(SILENCE * 0.51, SILENCE * 0.99), st.floats(11, 15)
)


@settings(max_examples=40, deadline=None)
@given(st.lists(gap_values, max_size=25))
def test_a_parked_stream_goes_silent_exactly_silence_after_its_last_read(gaps: list[float]) -> None:
    """While parked, the decode clock is lifted and the reactor's task keeps its expiry in
    floats, calling ``TokenPath.on_due`` at most once a silence, not on every read: the
    clock still runs out when the old one, moved on every read, would have."""
    fired = trio.run(_relay_until_silent, gaps, clock=trio.testing.MockClock(autojump_threshold=0))
    assert fired == pytest.approx(silence_ends(gaps), abs=1e-6)


async def test_only_the_request_task_moves_its_decode_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While parked, tokens flowing, the reactor's task reads and writes without moving
    the request's decode clock: it is lifted while parked, and every write of its deadline
    is the request's task's. The reactor's dues are pushed when a due comes, not per read:
    each moves the due to the last read's expiry, at least half a silence on."""
    gaps = [SILENCE * 0.05] * 200 + [SILENCE * 0.9] * 3
    relayed = await _relay([(0.0, TOKEN)] + [(gap, TOKEN) for gap in gaps])
    assert relayed.timed_out
    assert relayed.ended == pytest.approx(sum(gaps) + SILENCE)
    parked = [deadline for task, deadline in relayed.stream.reads if task is not relayed.owner]
    assert len(parked) >= len(gaps)  # the tokens after the first were read in the reactor
    assert set(parked) == {math.inf}
    assert relayed.clock.writes
    assert {task for task, _ in relayed.clock.writes} == {relayed.owner}
    assert relayed.dues <= 1 + 2 * relayed.ended / SILENCE
    assert relayed.dues < len(gaps) / 10


async def test_a_parked_stream_silent_past_its_budget_is_cut_by_its_own_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    relayed = await _relay([(0.0, TOKEN), (1.0, TOKEN), (1.0, TOKEN)])
    assert relayed.timed_out
    assert relayed.ended == 2.0 + SILENCE
    assert relayed.path.first_token_at is not None  # the leg says: silent between tokens
    assert relayed.clock.scope.deadline == relayed.ended + relayed.path.first_token_at


@pytest.mark.parametrize("json", [False, True], ids=["stream", "json"])
async def test_a_parked_stream_whose_tokens_keep_coming_is_not_cut(
    json: bool, autojump_clock: trio.testing.MockClock
) -> None:
    sends = [(0.0, TOKEN)] + [(SILENCE * 0.9, TOKEN)] * 30 + [(SILENCE * 0.9, DONE)]
    relayed = await _relay(sends, json=json)
    assert not relayed.timed_out
    assert relayed.ended == pytest.approx(31 * SILENCE * 0.9)
    assert relayed.path.tokens == 31


@pytest.mark.parametrize("json", [False, True], ids=["stream", "json"])
async def test_the_first_token_budget_holds_while_parked(
    json: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """A comment is no token: the first-token budget runs on while the reactor reads it."""
    relayed = await _relay([(1.0, b": keep-alive\n\n")] * 5, budget=3.0, json=json)
    assert relayed.timed_out
    assert relayed.ended == 3.0
    assert relayed.path.first_token_at is None  # the leg says: no first token
    assert any(task is not relayed.owner for task, _ in relayed.stream.reads)


async def test_a_json_answer_parked_before_its_first_token_then_keeps_the_silence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A JSON answer's first token is read in the reactor (nothing is written until the
    end): its silence clock takes over from the longer first-token budget at once."""
    relayed = await _relay([(1.0, TOKEN), (1.0, TOKEN)], budget=100.0, json=True)
    assert relayed.timed_out
    assert relayed.ended == 2.0 + SILENCE
    assert relayed.path.first_token_at is not None
    assert {task for task, _ in relayed.clock.writes} == {relayed.owner}


async def test_parked_streams_keep_the_decode_budgets(nursery: trio.Nursery) -> None:
    """Over real sockets, the leg's faults: silent between tokens, no first token; and a
    slow drip within the silence runs well past it."""
    silence = 0.4
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine=EngineConfig(first_token_timeout_s=silence, decode_read_timeout_s=silence),
    )
    reactor, engine = harness.router.reactor, harness.engines["d0"]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": True}
    parks = reactor.parks
    engine.faults.push(Fault(kind="tokens_then_silence", tokens=2))
    reply = await post_raw(harness, "/v1/completions", body)
    *tokens, terminal = reply.events()
    assert len(tokens) == 2
    assert msgspec.json.decode(terminal)["error"]["message"].startswith(
        "engine went silent between tokens"
    )
    assert reactor.parks > parks
    parks = reactor.parks
    engine.faults.push(Fault(kind="headers_then_silence", leg="decode"))
    reply = await post_raw(harness, "/v1/completions", body)
    assert reply.status == 504
    assert reply.json()["error"]["message"].startswith(f"no first token within {silence}s")
    assert reactor.parks > parks
    parks = reactor.parks
    engine.faults.push(Fault(kind="slow_drip", interval_s=silence / 4))  # 8 tokens: 4 silences
    reply = await post_raw(harness, "/v1/completions", body)
    assert reply.status == 200
    assert reply.events()[-1] == b"[DONE]"
    assert len(reply.events()) == 9
    assert reactor.parks > parks
    await finish(harness)


async def test_a_request_that_left_is_not_kept_alive_until_its_due(
    reactor: StreamReactor,
) -> None:
    """A due far ahead outlives the park that asked for it; what the park held (the
    request's callbacks and all they reach) must not: at thousands of requests a second
    that was tens of MiB of finished requests."""

    class Request:  # stands for a request's objects, reached from its callbacks
        def on_ready(self) -> object:
            return "done"

        def on_due(self) -> float:
            return trio.current_time() + 3600

    ours, theirs = socket.socketpair()
    theirs.send(b"x")
    request = Request()
    gone = weakref.ref(request)
    far = trio.current_time() + 3600
    assert await reactor.park(Parked(ours), request.on_ready, far, request.on_due) == "done"
    del request
    # the next stream served takes the reactor loop's own reference to the last one
    theirs.send(b"y")
    assert await reactor.park(Parked(ours), lambda: "next") == "next"
    gc.collect()
    assert gone() is None
    ours.close()
    theirs.close()


async def test_moved_dues_do_not_pile_up(reactor: StreamReactor) -> None:
    """Each move of a due leaves a stale entry until its time; the heap is rebuilt before
    it holds more than a few per parked stream."""
    ours, theirs = socket.socketpair()
    async with trio.open_nursery() as nursery:
        parked = Parked(ours)
        nursery.start_soon(reactor.park, parked, lambda: None, trio.current_time() + 60)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(10 * STALE_DUES_SLACK):
            reactor.set_due(parked, trio.current_time() + 60 + i)
            assert len(reactor._dues) <= STALE_DUES_FACTOR + STALE_DUES_SLACK + 1
        nursery.cancel_scope.cancel()
    ours.close()
    theirs.close()
