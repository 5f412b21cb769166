"""Serving the router with hypercorn's trio worker (each process of ``--workers N`` runs
``serve`` too: ``narwhal.workers``)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from narwhal import client_connection, hypercorn_fixes, trio_accept
from narwhal.client_connection import ClientConnection
from narwhal.core.config import FleetConfig
from narwhal.router.app import RouterApp, WorkerGroup
from narwhal.router.service import FAIL_SEND_BOUND_S, Router
from narwhal.shapes import verify

_installed = False


def install_server_fixes() -> None:
    """Verify, then apply, every change narwhal makes to hypercorn, h11 and trio: the
    connection handler (``narwhal.client_connection``), the chunk framing
    (``narwhal.hypercorn_fixes``) and the accept burst (``narwhal.trio_accept``). Raises
    ``narwhal.shapes.ShapeMismatch``, changing nothing, when any replaced or copied
    function is not the one it was written against. Idempotent."""
    global _installed
    if _installed:
        return
    verify({**client_connection.SHAPES, **hypercorn_fixes.SHAPES, **trio_accept.SHAPES})
    import hypercorn.trio.run as worker

    setattr(worker, "TCPServer", ClientConnection)  # noqa: B010 - hypercorn does not export it
    hypercorn_fixes.frame_body_chunks_directly()
    trio_accept.accept_in_bursts()
    _installed = True


def hypercorn_config(
    fleet: FleetConfig,
    host: str,
    port: int,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> HypercornConfig:
    """Hypercorn's settings for the router; with ``certfile`` and ``keyfile`` it serves TLS."""
    hc = HypercornConfig()
    hc.bind = [f"{host}:{port}"]
    hc.certfile, hc.keyfile = certfile, keyfile  # TLS when both are set (hypercorn's rule)
    hc.keyfile_password = ""  # an encrypted key fails at start; OpenSSL never asks a terminal
    hc.worker_class = "trio"
    # the router ends stragglers itself at graceful_timeout_s (with a terminal event);
    # hypercorn's own limit only backs that up
    hc.graceful_timeout = fleet.serving.graceful_timeout_s + FAIL_SEND_BOUND_S + 1.0
    hc.accesslog = None
    # hypercorn's own lines ("Running on ...", its errors) go through our formatter: in
    # JSON mode every line on stderr is JSON
    hc.errorlog = logging.getLogger("narwhal.server")
    # Hypercorn's idle timer runs from the connection's start (or its last response) until a
    # request's headers are complete: it bounds idle keep-alive connections and slowloris
    # headers alike. Longer than the idle expiry of common clients (httpx: 5 s).
    hc.keep_alive_timeout = fleet.serving.client_idle_timeout_s
    # hypercorn's default backlog (100) overflows when many clients connect at once, and
    # the kernel's SYN retries then add seconds to their first token (seen at 1,000 streams)
    hc.backlog = 4096
    # Our own limit applies to the body; this bounds headers and the h11 buffer.
    hc.h11_max_incomplete_size = 64 * 1024
    # HTTP/2 is not served (narwhal.client_connection): a TLS client is never offered h2
    hc.alpn_protocols = ["http/1.1"]
    return hc


def bind_sockets(hc: HypercornConfig) -> Sockets:
    """Bind and listen on ``hc.bind`` now, as hypercorn's worker would (``create_sockets``,
    then ``listen(backlog)``), so that a taken port or a bad host is the ``OSError`` of this
    call (``socket.gaierror`` for a name that does not resolve), raised before any task
    starts, and not an exception group out of a nursery."""
    sockets = hc.create_sockets()
    every = (*sockets.secure_sockets, *sockets.insecure_sockets)
    try:
        for sock in every:
            sock.listen(hc.backlog)
    except OSError:
        close_sockets(sockets)
        raise
    return sockets


def close_sockets(sockets: Sockets) -> None:
    for sock in (*sockets.secure_sockets, *sockets.insecure_sockets, *sockets.quic_sockets):
        sock.close()


async def serve(
    fleet: FleetConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    router: Router | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    sockets: Sockets | None = None,
    workers: WorkerGroup | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns; report the base URL through ``nursery.start``.

    ``sockets``: already listening, from ``bind_sockets`` on the same host, port and TLS
    files (the command line binds before trio starts); bound here when None. ``workers``:
    this process is one worker of ``--workers N`` (``narwhal.workers.ParentLink``)."""
    install_server_fixes()
    router = router or Router(fleet)
    hc = hypercorn_config(fleet, host, port, certfile=certfile, keyfile=keyfile)
    asgi: Any = RouterApp(router, workers)  # hypercorn's ASGI types are structural
    app = wrap_app(asgi, hc.wsgi_max_body_size, "asgi")  # as hypercorn.trio.serve wraps it
    if sockets is None:
        sockets = bind_sockets(hc)
    wait = shutdown_trigger or trio.sleep_forever

    async def trigger() -> None:
        await wait()
        router.begin_drain()  # then hypercorn stops accepting and waits for the handlers

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: worker_serve(
                app, hc, sockets=sockets, shutdown_trigger=trigger, task_status=task_status
            )
        )
        # what startup made (modules, config, the app) lives as long as the process: out of
        # the collector's generations, a collection walks only what requests make
        gc.freeze()
        task_status.started(binds[0])
