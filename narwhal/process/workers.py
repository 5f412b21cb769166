"""``serve --workers N``: N processes that act as one router (contract 3), and their parent.

The parent (``Supervisor``) serves nothing itself. It checks the address as a single
router would, then gives each worker its own listening socket on the same host and port
(``SO_REUSEPORT``: the kernel spreads new connections over the workers' sockets by a hash
of their addresses, so no worker can take another's share, as one worker's accept burst
(``narwhal.frontdoor.listener``) could from one shared queue) and a control channel (one end of
a socketpair, JSON lines: ``Message``). Each worker is ``narwhal.router.serving.serve`` in its own
process, exactly as a single router: lifespan, active health, the drain.

This module is the parent's side; the control channel both sides speak is
``narwhal.process.worker_channel``, and a worker's side (its link to the parent, its serve loop)
is ``narwhal.process.worker_process``.

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
from typing import Any

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.utils import repr_socket_addr
from prometheus_client.multiprocess import mark_process_dead

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.observe.logs import announce, log_event
from narwhal.process.config_files import load_config
from narwhal.process.kv_relay import start_relay
from narwhal.process.worker_channel import RELOAD_BOUND_S, SPEC_ENV, Channel, Message, WorkerSpec
from narwhal.router.serving import hypercorn_config

log = logging.getLogger("narwhal.workers")
_encode = msgspec.json.Encoder().encode

RESTARTS = 5  # unexpected exits restarted within RESTART_WINDOW_S; one more stops the router
RESTART_WINDOW_S = 60.0
STOP_MARGIN_S = 10.0  # past hypercorn's graceful bound: lifespan shutdown, journal flush
# A worker's first act is to ignore the signals meant for the parent, before any import,
# so that one sent to the whole process group while the worker starts cannot end it. The
# words after the program are for ps: "narwhal-worker 0/2".
WORKER_COMMAND = (
    "import signal; "
    "[signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]; "
    "from narwhal.process.commands import worker_main; "
    "raise SystemExit(worker_main())"
)


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
    failure's, ``narwhal.process.startup.EXIT_STATUS_HELP``), or 1 when it exited 0 unasked or a
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
        # does, and hands every batch to every worker (narwhal.process.kv_relay)
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
            # descriptor kept: both sockets are this function's, closed after the spawn
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
