"""``serve --workers N``: N processes that act as one router (SPEC 3), and their parent.

The parent (``Supervisor``) serves nothing itself. It checks the address as a single
router would, then gives each worker its own listening socket on the same host and port
(``SO_REUSEPORT``: the kernel spreads new connections over the workers' sockets by a hash
of their addresses, so no worker can take another's share, as one worker's accept burst
(``narwhal.frontdoor.listener``) could from one shared queue) and a control channel (one end of
a socketpair, JSON lines: ``Message``). Each worker is ``narwhal.router.serving.serve`` in its own
process, exactly as a single router: lifespan, active health, the drain.

* SIGTERM or SIGINT to the parent: every worker is told to stop and drains as one router
  does (new connections refused, ``/ready`` 503, streams finish within
  ``serving.graceful_timeout_s`` or end with the terminal event, one journal line each);
  the parent waits for all of them and exits 0 when all did. A worker still running past
  hypercorn's graceful bound plus ``STOP_MARGIN_S`` is killed and the exit status is 1.
* SIGHUP to the parent, or ``POST /narwhal/reload`` to any worker: the parent asks every
  worker to reload (SIGHUP: and to reopen the journal) and collects their answers; the
  POST is answered once every worker has answered, with each worker's change. A reload
  is applied inside each worker's event loop: no worker restarts, no request waits.
* Workers ignore SIGTERM, SIGINT and SIGHUP (a terminal's Ctrl-C or systemd's signal to
  the whole control group reaches them too): they take orders from the parent only, and
  when the parent is gone (the channel closes) they drain and exit.
* A worker that exits unexpectedly is restarted on a fresh listener, at most ``RESTARTS``
  times within ``RESTART_WINDOW_S``; past that, or when a worker fails before every
  worker has started, the parent stops the others and exits with the worker's status
  (1 when it was killed by a signal). Either way its live gauges are dropped at once
  (prometheus-client's ``mark_process_dead``): metrics count live workers only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.utils import repr_socket_addr
from prometheus_client.multiprocess import mark_process_dead

from narwhal.config_files import load_config
from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.faults import InvalidFleetFile, ReloadNotApplied, ReloadUnanswered
from narwhal.core.limits import check_workers
from narwhal.kv_relay import start_relay
from narwhal.logs import announce, log_event
from narwhal.router.service import Router
from narwhal.router.serving import hypercorn_config, serve

log = logging.getLogger("narwhal.workers")

SPEC_ENV = "NARWHAL_WORKER"  # a worker's WorkerSpec, as JSON
RESTARTS = 5  # unexpected exits restarted within RESTART_WINDOW_S; one more stops the router
RESTART_WINDOW_S = 60.0
RELOAD_BOUND_S = 10.0  # a worker answers a reload within this, or is reported silent
STOP_MARGIN_S = 10.0  # past hypercorn's graceful bound: lifespan shutdown, journal flush
SEND_BOUND_S = 5.0  # one control message; a peer that does not read is treated as gone
GAUGE_REFRESH_S = 5.0  # a worker's clock-driven gauges, for scrapes answered by another
MAX_MESSAGE = 1 << 20
# A worker's first act is to ignore the signals meant for the parent, before any import,
# so that one sent to the whole process group while the worker starts cannot end it. The
# words after the program are for ps: "narwhal-worker 0/2".
WORKER_COMMAND = (
    "import signal; "
    "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]; "
    "from narwhal.commands import worker_main; "
    "raise SystemExit(worker_main())"
)


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker is started with (``SPEC_ENV``); the parent's copy has no fds."""

    index: int
    count: int
    config: str  # absolute path of the fleet file
    host: str
    port: int
    journal: str | None = None
    log_format: Literal["text", "json"] = "text"
    log_level: str = "info"
    certfile: str | None = None
    keyfile: str | None = None
    listen_fd: int = -1  # the worker's own listening socket (already listening)
    control_fd: int = -1  # its end of the control channel
    # [kv_events] mode = "listen": where the parent hands on every batch it receives
    kv_relay: str = ""

    @staticmethod
    def from_environment() -> WorkerSpec:
        return msgspec.json.decode(os.environ[SPEC_ENV], type=WorkerSpec)


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    """One line of the control channel.

    worker -> parent: ``serving`` (started), ``reload`` (a POST asked; ``id`` is the
    worker's), ``reloaded`` (its answer to the parent's ``reload``: ``results`` holds one).
    parent -> worker: ``reload`` (``journal``: reopen it too), ``reload-done`` (every
    worker's answer to the worker's ``reload`` of that ``id``), ``stop`` (drain and exit).
    """

    op: Literal["serving", "reload", "reloaded", "reload-done", "stop"]
    id: int = 0
    journal: bool = False
    results: list[dict[str, Any]] = []


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(Message).decode


class Channel:
    """JSON lines over one end of the control socketpair."""

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._buffer = bytearray()
        self._lock = trio.Lock()

    async def send(self, message: Message) -> bool:
        """False when the other side is gone, or does not read within ``SEND_BOUND_S``
        (the channel is closed then: a line cut in half is never followed by another)."""
        data = _encode(message) + b"\n"
        with trio.move_on_after(SEND_BOUND_S):
            async with self._lock:
                try:
                    await self._stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return False
                return True
        await self.aclose()
        return False

    async def receive(self) -> Message | None:
        """The next message; None once the other side is gone (or broke the protocol)."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                try:
                    return _decode(line)
                except msgspec.MsgspecError:
                    log.error("control channel: not a message: %r", line[:200])
                    return None
            if len(self._buffer) > MAX_MESSAGE:
                return None
            try:
                data = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._buffer += data

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):  # closing a socket does not block
            await self._stream.aclose()


# ---- the parent's side ----------------------------------------------------------------------


def bind_worker_sockets(hc: HypercornConfig, count: int) -> list[socket.socket]:
    """One listening socket per worker on ``hc.bind``, all with ``SO_REUSEPORT``.

    The address is checked first by binding it as a single router would (no
    ``SO_REUSEPORT``), so a port another process listens on, with or without the option
    (another narwhal among them), is an ``OSError`` here rather than a silent share of its
    traffic; port 0 becomes one free port for every worker. ``hc`` keeps that port and
    ``workers = count`` (hypercorn then sets ``SO_REUSEPORT``) for later restarts."""
    probe = hc.create_sockets()  # bound, not listening; hc.workers is 1: no SO_REUSEPORT
    try:
        port = (*probe.secure_sockets, *probe.insecure_sockets)[0].getsockname()[1]
    finally:
        for sock in (*probe.secure_sockets, *probe.insecure_sockets):
            sock.close()
    host = hc.bind[0].rsplit(":", 1)[0]
    hc.bind = [f"{host}:{port}"]
    hc.workers = count
    listeners: list[socket.socket] = []
    try:
        for _ in range(count):
            listeners.append(worker_socket(hc))
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def worker_socket(hc: HypercornConfig) -> socket.socket:
    """A new listener on ``hc.bind``, joining the workers' ``SO_REUSEPORT`` group."""
    sockets = hc.create_sockets()
    sock = (*sockets.secure_sockets, *sockets.insecure_sockets)[0]
    try:
        sock.listen(hc.backlog)
    except OSError:
        sock.close()
        raise
    return sock


def restart_allowed(exits: deque[float], now: float) -> bool:
    """Record an unexpected exit at ``now``; True while at most ``RESTARTS`` exits fall
    within the last ``RESTART_WINDOW_S``."""
    exits.append(now)
    while exits and exits[0] <= now - RESTART_WINDOW_S:
        exits.popleft()
    return len(exits) <= RESTARTS


def failure_status(returncode: int) -> int:
    """The parent's exit status for a worker that failed: the worker's own (a startup
    failure's, ``narwhal.startup.EXIT_STATUS_HELP``), or 1 when it exited 0 unasked or a
    signal ended it."""
    return returncode if 0 < returncode < 128 else 1


@dataclass
class _Worker:
    index: int
    process: trio.Process | None = None
    channel: Channel | None = None
    serving: bool = False
    exits: deque[float] = field(default_factory=deque)


@dataclass
class _Collect:
    """Answers to one reload round, by worker index."""

    expected: set[int]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)

    def add(self, result: dict[str, Any]) -> None:
        index = result.get("worker")
        if isinstance(index, int) and index in self.expected:
            self.results[index] = result
            if set(self.results) >= self.expected:
                self.done.set()


class Supervisor:
    """The parent of ``serve --workers N``: run with ``trio.run(supervisor.run)``, which
    returns the exit status."""

    def __init__(
        self,
        spec: WorkerSpec,
        fleet: FleetConfig,
        hc: HypercornConfig,
        listeners: list[socket.socket],
    ) -> None:
        self.spec = spec
        self.fleet = fleet
        self.hc = hc
        first = listeners[0]
        scheme = "https" if hc.ssl_enabled else "http"
        self.url = f"{scheme}://{repr_socket_addr(first.family, first.getsockname())}"
        self._listeners = listeners
        self._workers = [_Worker(i) for i in range(spec.count)]
        self.status = 0
        self.stopping = False
        self._announced = False
        self._spawned = False  # every worker was started once
        self._all_exited = trio.Event()
        self._reload_lock = trio.Lock()
        self._round = 0
        self._collecting: dict[int, _Collect] = {}
        self._nursery: trio.Nursery | None = None
        self._own_metrics_dir: str | None = None
        # [kv_events] mode = "listen": one process can bind the address, so the parent
        # does, and hands every batch to every worker (narwhal.kv_relay)
        self._kv_relay = ""
        if fleet.kv_events.mode == "listen":
            self._kv_relay = start_relay(fleet.kv_events.listen)
        self.metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or ""
        if not self.metrics_dir:
            # every worker writes its metrics here; a scrape of any worker sums them all
            self.metrics_dir = self._own_metrics_dir = tempfile.mkdtemp(prefix="narwhal-prom-")

    async def run(self) -> int:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self._signals)
                listeners, self._listeners = self._listeners, []
                for worker, listener in zip(self._workers, listeners, strict=True):
                    await self._spawn(worker, listener)
                self._spawned = True
                self._check_all_exited()
                await self._all_exited.wait()
                nursery.cancel_scope.cancel()
        finally:
            for sock in self._listeners:
                sock.close()
            if self._own_metrics_dir is not None:
                shutil.rmtree(self._own_metrics_dir, ignore_errors=True)
        return self.status

    # workers

    async def _spawn(self, worker: _Worker, listener: socket.socket) -> None:
        assert self._nursery is not None
        n = len(self._workers)
        ours, theirs = socket.socketpair()
        spec = msgspec.structs.replace(
            self.spec,
            index=worker.index,
            listen_fd=listener.fileno(),
            control_fd=theirs.fileno(),
            kv_relay=self._kv_relay,
        )
        env = {
            **os.environ,
            SPEC_ENV: _encode(spec).decode(),
            "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir,
        }
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", WORKER_COMMAND, "narwhal-worker", f"{worker.index}/{n}"],
                stdin=subprocess.DEVNULL,
                env=env,
                pass_fds=(listener.fileno(), theirs.fileno()),
            )
        except OSError as exc:
            ours.close()
            log_event(log, logging.ERROR, "cannot start a worker", {"worker": worker.index})
            log.error("%s", exc)
            self._fail(1)
            self._stop()
            self._check_all_exited()
            return
        finally:
            listener.close()  # the worker's now: its socket closes with it
            theirs.close()
        channel = Channel(ours)
        worker.process, worker.channel, worker.serving = process, channel, False
        log_event(log, logging.INFO, "worker started", {"worker": worker.index, "pid": process.pid})
        self._nursery.start_soon(self._watch, worker, process, channel)
        if self.stopping:  # asked to stop while this one was starting
            await channel.send(Message("stop"))

    async def _watch(self, worker: _Worker, process: trio.Process, channel: Channel) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen, worker, channel)
            returncode = await process.wait()
            nursery.cancel_scope.cancel()
        await channel.aclose()
        # its live gauges count no more
        mark_process_dead(process.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        worker.process = worker.channel = None
        worker.serving = False
        await self._exited(worker, process.pid, returncode)

    async def _exited(self, worker: _Worker, pid: int, returncode: int) -> None:
        fields: dict[str, Any] = {"worker": worker.index, "pid": pid, "status": returncode}
        if self.stopping:
            if returncode != 0:
                log_event(log, logging.ERROR, "worker failed to drain", fields)
                self._fail(failure_status(returncode))
            self._check_all_exited()
            return
        if not self._announced:
            log_event(log, logging.ERROR, "worker exited while starting", fields)
            self._fail(failure_status(returncode))
            self._stop()
            return
        if not restart_allowed(worker.exits, trio.current_time()):
            fields["restarts"] = RESTARTS
            fields["window_s"] = RESTART_WINDOW_S
            log_event(log, logging.ERROR, "worker exits too often; stopping", fields)
            self._fail(failure_status(returncode))
            self._stop()
            return
        log_event(log, logging.ERROR, "worker exited; restarting it", fields)
        try:
            listener = worker_socket(self.hc)
        except OSError as exc:
            log.error("cannot listen for worker %d again: %s", worker.index, exc)
            self._fail(1)
            self._stop()
            self._check_all_exited()
            return
        await self._spawn(worker, listener)

    async def _listen(self, worker: _Worker, channel: Channel) -> None:
        assert self._nursery is not None
        while (message := await channel.receive()) is not None:
            if message.op == "serving":
                worker.serving = True
                self._serving(worker)
            elif message.op == "reload":
                reply_to = (channel, message.id)
                self._nursery.start_soon(self._reload, "POST /narwhal/reload", False, reply_to)
            elif message.op == "reloaded":
                collect = self._collecting.get(message.id)
                if collect is not None and message.results:
                    collect.add(message.results[0])

    def _serving(self, worker: _Worker) -> None:
        if self._announced:
            pid = worker.process.pid if worker.process else None
            log_event(log, logging.WARNING, "worker serving", {"worker": worker.index, "pid": pid})
            return
        if all(w.serving for w in self._workers) and not self.stopping:
            self._announced = True
            n, fleet = len(self._workers), self.fleet
            announce(
                f"narwhal: serving {fleet.model} on {self.url} with {len(fleet.engines)} "
                f"engine(s) in {n} workers",
                {"model": fleet.model, "url": self.url, "workers": n},
                self.spec.log_format,
            )

    def _fail(self, status: int) -> None:
        if self.status == 0:
            self.status = status

    def _stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        assert self._nursery is not None
        live = [w for w in self._workers if w.process is not None]
        log_event(log, logging.WARNING, "stopping workers", {"workers": len(live)})
        for worker in live:
            if worker.channel is not None:
                self._nursery.start_soon(worker.channel.send, Message("stop"))
        self._nursery.start_soon(self._kill_stragglers)
        self._check_all_exited()

    def _check_all_exited(self) -> None:
        if self.stopping and self._spawned and all(w.process is None for w in self._workers):
            self._all_exited.set()

    def _stop_bound_s(self) -> float:
        hc = hypercorn_config(self.fleet, self.spec.host, self.spec.port)
        return float(hc.graceful_timeout) + STOP_MARGIN_S

    async def _kill_stragglers(self) -> None:
        await trio.sleep(self._stop_bound_s())
        for worker in self._workers:
            if worker.process is not None and worker.process.returncode is None:
                pid = worker.process.pid
                log_event(log, logging.ERROR, "worker still running; killed", {"pid": pid})
                self._fail(1)
                worker.process.kill()

    async def _signals(self, *, task_status: trio.TaskStatus[None]) -> None:
        assert self._nursery is not None
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._nursery.start_soon(self._reload, "SIGHUP", True)
                else:
                    self._stop()

    # reloads

    async def _reload(
        self, reason: str, journal: bool, reply_to: tuple[Channel, int] | None = None
    ) -> None:
        """One round: every worker with a channel reloads; with ``reply_to`` (the channel of
        the worker whose POST asked, and its id) every worker's answer goes back to it."""
        async with self._reload_lock:
            self._round += 1
            number = self._round
            targets = [(w.index, w.channel) for w in self._workers if w.channel is not None]
            collect = _Collect({index for index, _ in targets})
            self._collecting[number] = collect
            try:
                for index, channel in targets:
                    if not await channel.send(Message("reload", id=number, journal=journal)):
                        collect.add({"worker": index, "error": "worker gone"})
                with trio.move_on_after(RELOAD_BOUND_S):
                    await collect.done.wait()
            finally:
                del self._collecting[number]
        silent = {"error": f"no answer within {RELOAD_BOUND_S:g}s"}
        results = [collect.results.get(index, {"worker": index, **silent}) for index, _ in targets]
        self._report(reason, results)
        if reply_to is not None:
            channel, asked = reply_to
            await channel.send(Message("reload-done", id=asked, results=results))

    def _report(self, reason: str, results: list[dict[str, Any]]) -> None:
        failed = [r for r in results if "error" in r]
        summary = [
            {k: v for k, v in r.items() if k in ("worker", "pid", "engines", "added", "removed")}
            | ({"error": str(r["error"]).splitlines()[0]} if "error" in r else {})
            for r in results
        ]
        level = logging.ERROR if failed else logging.WARNING
        log_event(log, level, "workers reloaded", {"reason": reason, "workers": summary})
        if failed:
            text = f"{failed[0]['error']}\nkeeping the running fleet"
            announce(text, {"kept": True}, self.spec.log_format)
            return
        with contextlib.suppress(ConfigError):
            self.fleet = load_config(self.spec.config)  # its graceful timeout bounds a stop


# ---- a worker's side ------------------------------------------------------------------------


class ParentLink:
    """A worker's view of the group (``narwhal.router.app.WorkerGroup``): its index, the
    parent's orders, and reloads that reach every worker."""

    def __init__(self, spec: WorkerSpec, router: Router, channel: Channel) -> None:
        self.index = spec.index
        self.count = spec.count
        self.router = router
        self.channel = channel
        self.stop = trio.Event()  # the parent said stop, or is gone
        self._asked = 0
        self._answers: dict[int, list[dict[str, Any]]] = {}
        self._answered: dict[int, trio.Event] = {}

    async def run(self) -> None:
        """Follow the parent's orders until it says stop or is gone (then drain)."""
        while (message := await self.channel.receive()) is not None:
            if message.op == "stop":
                self.stop.set()
            elif message.op == "reload":
                result = self.reload_here(reopen_journal=message.journal)
                await self.channel.send(Message("reloaded", id=message.id, results=[result]))
            elif message.op == "reload-done":
                event = self._answered.get(message.id)
                if event is not None:  # else its POST gave up waiting (504)
                    self._answers[message.id] = message.results
                    event.set()
        if not self.stop.is_set():
            log.warning("worker %d: the parent is gone; draining", self.index)
            self.stop.set()

    def reload_here(self, *, reopen_journal: bool) -> dict[str, Any]:
        mine: dict[str, Any] = {"worker": self.index, "pid": os.getpid()}
        if reopen_journal:
            self.router.journal.reopen()
        try:
            return mine | self.router.reload_file()
        except ConfigError as exc:
            return mine | {"error": exc.render(), "problems": exc.problems}

    async def reload_everywhere(self) -> tuple[int, bytes]:
        """``POST /narwhal/reload``: (status, body). A file that does not load is refused
        here and changes nothing anywhere; else every worker reloads it and the answer
        comes once every worker has answered."""
        path = self.router.config_path
        try:
            if path is None:
                raise ConfigError("<none>", ["the router was not started from a fleet file"])
            check_workers(load_config(path), self.count, path)  # refused here, not by each
        except ConfigError as exc:
            return InvalidFleetFile(exc).answer()
        self._asked += 1
        asked = self._asked
        self._answered[asked] = answered = trio.Event()
        try:
            if await self.channel.send(Message("reload", id=asked)):
                with trio.move_on_after(RELOAD_BOUND_S + SEND_BOUND_S + 1.0):
                    await answered.wait()
        finally:
            del self._answered[asked]
        results = self._answers.pop(asked, None)
        if results is None:
            return ReloadUnanswered().answer()
        failed = [r["worker"] for r in results if "error" in r]
        if failed:
            return ReloadNotApplied(failed, results).answer()
        mine = next((r for r in results if r.get("worker") == self.index), results[0])
        change = {k: mine[k] for k in ("engines", "added", "removed") if k in mine}
        return 200, _encode({**change, "workers": results})


def run_worker(spec: WorkerSpec, fleet: FleetConfig, router: Router) -> int:
    """Serve as worker ``spec.index`` until the parent says stop (or is gone); 0 once
    drained."""
    listener = socket.socket(fileno=spec.listen_fd)
    control = socket.socket(fileno=spec.control_fd)
    tls = spec.certfile is not None and spec.keyfile is not None
    sockets = Sockets([listener], [], []) if tls else Sockets([], [listener], [])
    trio.run(_serve_worker, spec, fleet, router, sockets, control)
    return 0


async def _serve_worker(
    spec: WorkerSpec, fleet: FleetConfig, router: Router, sockets: Sockets, control: socket.socket
) -> None:
    link = ParentLink(spec, router, Channel(control))
    router.kv_subscriber.relay = spec.kv_relay
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.run)
        nursery.start_soon(_refresh_gauges, router)
        async with trio.open_nursery() as server:
            await server.start(
                partial(
                    serve,
                    fleet,
                    host=spec.host,
                    port=spec.port,
                    router=router,
                    shutdown_trigger=link.stop.wait,
                    certfile=spec.certfile,
                    keyfile=spec.keyfile,
                    sockets=sockets,
                    workers=link,
                )
            )
            await link.channel.send(Message("serving"))
        nursery.cancel_scope.cancel()  # drained: stop following the parent


async def _refresh_gauges(router: Router) -> None:
    """Clock-driven gauges are brought up to date when a worker answers a scrape; the
    scrape sums every worker's, so each worker refreshes its own now and then too."""
    while True:
        await trio.sleep(GAUGE_REFRESH_S)
        router.health.refresh_gauges()
