"""No descriptor number outlives its socket (docs/architecture.md, "Descriptors"; contract 8,
invariant 13).

A socket is closed by tasks other than its reader: a client's by the app's task after a
``Connection: close`` answer, an engine's by whoever gives the exchange up. The kernel hands
the freed number to the next socket the process opens, so a reader that kept the number
would read, or wait on, another connection: an engine leg's read then failed with trio's
``BusyResourceError`` (a 500 on a healthy fleet), or a newly accepted client's request was
read by the stale loop and never answered. Each test here closes a socket under a waiting
reader at the worst moment, gives its number to another socket at once, and checks that
the other socket's owner gets its bytes and the stale reader ends cleanly."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing
import zmq
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.worker_context import WorkerContext

from narwhal.core.faults import StreamBroken
from narwhal.engines.client import DecodeStream, EngineClient
from narwhal.frontdoor.connection import ClientConnection
from narwhal.frontdoor.server_end import ServerEnd
from narwhal.lowlevel import zmq_trio
from narwhal.lowlevel.fast_io import read_when_ready
from narwhal.router.stream_reactor import StreamReactor
from tests.support.fleet import MODEL
from tests.support.wire import CHUNK, EVENT, HEAD, serve_once

THEIR_BYTES = b"another connection's bytes"
READ_LOOP = "client read loop"


class NumberTaken:
    """Sockets opened until one holds ``fd``, the number a close just freed (the kernel
    gives the lowest free number, so this is the next socket any task would open)."""

    def __init__(self, fd: int) -> None:
        self.opened: list[socket.socket] = []
        self.owner: socket.socket | None = None
        self.peer: socket.socket | None = None
        for _ in range(64):
            ours, theirs = socket.socketpair()
            self.opened += [ours, theirs]
            for sock, other in ((ours, theirs), (theirs, ours)):
                if sock.fileno() == fd:
                    self.owner, self.peer = sock, other
                    sock.setblocking(False)
                    other.sendall(THEIR_BYTES)  # bytes waiting for their owner
                    return
        raise AssertionError(f"no socket took descriptor {fd}")

    def owner_reads(self) -> bytes:
        """What the owner finds waiting: all of ``THEIR_BYTES``, unless a stale reader
        took them."""
        assert self.owner is not None
        try:
            return self.owner.recv(4096)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        for sock in self.opened:
            sock.close()


class CloseBeforeStep(trio.abc.Instrument):
    """When the task named ``name`` is about to run after a wake-up, call ``act`` first:
    what another task does in the same scheduler batch, between the read loop's wake-up
    and its next step."""

    def __init__(self, name: str, act: Callable[[], None]) -> None:
        self.name, self.act = name, act
        self.armed = False
        self.fired = False

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.armed and task.name == self.name:
            self.armed, self.fired = False, True
            self.act()


class Hooks:
    """The app's hooks for a connection: no body limit; a failed connection is counted."""

    def __init__(self) -> None:
        self.failures = 0

    def max_request_bytes(self) -> int | None:
        return None

    def connection_failed(self) -> None:
        self.failures += 1


async def ends_closed(wait: Callable[[], Awaitable[object]], out: list[str]) -> None:
    """Await ``wait()``; note "closed" when it ends with the socket closed under it."""
    try:
        await wait()
    except trio.ClosedResourceError:
        out.append("closed")


async def unused_app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("no request reaches the app")


async def test_a_client_socket_closed_after_its_fin_woke_the_read_loop_is_not_read_again() -> None:
    """The client sends its FIN; the read loop is woken; before it runs, another task closes
    the socket and a new socket takes its number, with bytes waiting. The read loop must
    end without reading them (it read them before: the new socket's owner lost its
    request) and the connection must end without an error."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    client = socket.create_connection(listener.socket.getsockname())
    server = await listener.accept()
    assert isinstance(server, trio.SocketStream)
    context = WorkerContext(None)
    context.terminated = ServerEnd(context.terminated)
    hooks = Hooks()
    conn = ClientConnection(unused_app, HypercornConfig(), context, {}, server, hooks=hooks)
    fd = server.socket.fileno()
    taken: list[NumberTaken] = []

    def close_and_reuse() -> None:
        server.socket.close()  # as the app's task closes it after a `Connection: close`
        taken.append(NumberTaken(fd))

    instrument = CloseBeforeStep(READ_LOOP, close_and_reuse)
    trio.lowlevel.add_instrument(instrument)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.run, name=READ_LOOP)
                await trio.testing.wait_all_tasks_blocked()  # the read loop waits
                instrument.armed = True
                client.shutdown(socket.SHUT_WR)  # the client's FIN wakes it
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert instrument.fired
    assert taken[0].owner_reads() == THEIR_BYTES
    assert hooks.failures == 0  # the loop ended cleanly: no error reached the boundary
    taken[0].close()
    client.close()
    await listener.aclose()


async def first_event(client: EngineClient, url: str) -> DecodeStream:
    """A decode stream open on ``url``, its first event read: the next read waits."""
    stream = await client.decode(url, "/v1/completions", {"model": MODEL}, None).__aenter__()
    assert await stream.read() == EVENT
    return stream


async def test_an_engine_connection_closed_while_its_reader_waits_ends_that_read(
    nursery: trio.Nursery,
) -> None:
    """A decode leg waits for its next token; another task closes the leg's connection
    (the request given up from elsewhere, a shutdown). The reader ends with the engine's
    broken stream (a 502, never trio's BusyResourceError), and the socket that takes the
    number next keeps its bytes."""
    url = await serve_once(nursery, [HEAD + CHUNK], [])
    client = EngineClient()
    stream = await first_event(client, url)
    parkable = stream.park_socket()  # the leg's connection
    assert parkable is not None
    fd = parkable.fileno()
    raised: list[StreamBroken] = []

    async def read_next() -> None:
        try:
            await stream.read()
        except StreamBroken as exc:
            raised.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as readers:
            readers.start_soon(read_next)
            await trio.testing.wait_all_tasks_blocked()  # it waits on the socket
            await stream.aclose()
            taken = NumberTaken(fd)
    assert len(raised) == 1
    assert raised[0].status == 502
    assert "connection to engine" in str(raised[0])
    assert taken.owner_reads() == THEIR_BYTES
    assert client.limiter(url).borrowed_tokens == 0
    taken.close()
    await client.aclose()


async def test_a_parked_engine_connection_closed_by_another_task_is_handed_back(
    nursery: trio.Nursery,
) -> None:
    """The same while the leg is parked in the stream reactor, whose epoll trio's close
    cannot wake: the closer tells the reactor first, the parked request raises the broken
    stream, the registration is gone, and a socket that takes the number parks and is
    served as any other."""
    reactor = StreamReactor()
    await nursery.start(reactor.run)
    url = await serve_once(nursery, [HEAD + CHUNK], [])
    client = EngineClient()
    stream = await first_event(client, url)
    parkable = stream.park_socket()
    assert parkable is not None
    fd = parkable.fileno()
    raised: list[StreamBroken] = []

    async def parked() -> None:
        try:
            await reactor.park(parkable, stream.read_nowait)
        except StreamBroken as exc:
            raised.append(exc)

    with trio.fail_after(10):
        async with trio.open_nursery() as waiting:
            waiting.start_soon(parked)
            await trio.testing.wait_all_tasks_blocked()
            await stream.aclose()
            taken = NumberTaken(fd)
        assert len(raised) == 1
        assert raised[0].status == 502
        assert reactor._parked == {}
        # the number's new socket parks afresh and its owner's bytes are served to it
        assert taken.owner is not None
        owner = taken.owner
        assert await reactor.park(_Wrapped(owner), lambda: owner.recv(4096)) == THEIR_BYTES
    taken.close()
    await client.aclose()


class _Wrapped:
    """A plain socket as the reactor parks it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.before_close: Callable[[BaseException], None] | None = None

    def fileno(self) -> int:
        return self.sock.fileno()


async def test_a_parked_socket_closed_without_a_word_is_not_served_to_its_successor(
    nursery: trio.Nursery,
) -> None:
    """A parked socket closed behind the reactor's back (no ``before_close``): the socket
    that takes its number and parks gets its own callback, and the stale request is
    handed back closed rather than left waiting on a number that is no longer its."""
    reactor = StreamReactor()
    await nursery.start(reactor.run)
    ours, theirs = socket.socketpair()
    fd = ours.fileno()
    outcomes: list[str] = []

    def stale() -> Awaitable[object]:
        return reactor.park(_Wrapped(ours), lambda: "the stale request's callback")

    with trio.fail_after(10):
        async with trio.open_nursery() as waiting:
            waiting.start_soon(ends_closed, stale, outcomes)
            await trio.testing.wait_all_tasks_blocked()
            ours.close()
            taken = NumberTaken(fd)
            assert taken.owner is not None
            owner = taken.owner
            got = await reactor.park(_Wrapped(owner), lambda: owner.recv(4096))
    assert got == THEIR_BYTES
    assert outcomes == ["closed"]
    theirs.close()
    taken.close()


async def test_a_zmq_socket_closed_while_a_task_waits_frees_its_number() -> None:
    """The ZMQ bridge waits on ``zmq.FD``'s number in trio; ``zmq_trio.close`` tells trio
    first (``notify_closing``), so the waiter ends and a socket that takes the number later
    can be waited on (a registration left behind makes that wait BusyResourceError)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for round_ in range(3):
            pull = context.socket(zmq.PULL)
            push = context.socket(zmq.PUSH)
            pull.bind(f"inproc://descriptors-{round_}")
            push.connect(f"inproc://descriptors-{round_}")
            ended: list[str] = []
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ends_closed, partial(zmq_trio.recv_multipart, pull), ended)
                    await trio.testing.wait_all_tasks_blocked()
                    zmq_trio.close(pull)
            assert ended == ["closed"]
            # a new pair, whose descriptors may reuse the closed one's numbers, still works
            again = context.socket(zmq.PULL)
            again.bind(f"inproc://descriptors-again-{round_}")
            push2 = context.socket(zmq.PUSH)
            push2.connect(f"inproc://descriptors-again-{round_}")
            push2.send_multipart([b"hello"])
            with trio.fail_after(10):
                assert await zmq_trio.recv_multipart(again) == [b"hello"]
            for sock in (again, push2, push):
                zmq_trio.close(sock)
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("size", [1, 65536])
async def test_read_when_ready_raises_closed_for_a_socket_closed_before_its_step(size: int) -> None:
    """The helper itself: a socket closed between its wake-up and its read, whose number
    another socket took with bytes waiting, raises ``ClosedResourceError`` and reads none."""
    ours, theirs = trio.socket.socketpair()
    fd = ours.fileno()
    taken: list[NumberTaken] = []

    def close_and_reuse() -> None:
        ours.close()
        taken.append(NumberTaken(fd))

    instrument = CloseBeforeStep("reader", close_and_reuse)
    raised: list[BaseException] = []

    async def reader() -> None:
        try:
            await read_when_ready(ours, size)
        except trio.ClosedResourceError as exc:
            raised.append(exc)

    trio.lowlevel.add_instrument(instrument)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader, name="reader")
                await trio.testing.wait_all_tasks_blocked()
                instrument.armed = True
                await theirs.send(b"wake")
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert instrument.fired
    assert len(raised) == 1
    assert taken[0].owner_reads() == THEIR_BYTES
    theirs.close()
    taken[0].close()
