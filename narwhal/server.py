"""Serving the router with hypercorn's trio worker, in-process or as N worker processes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from narwhal import client_connection, hypercorn_fixes, trio_accept
from narwhal.client_connection import ClientConnection
from narwhal.config import FleetConfig, load_config
from narwhal.logs import configure as configure_logs
from narwhal.router.app import RouterApp
from narwhal.router.journal import Journal
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


CONFIG_ENV = "NARWHAL_CONFIG_PATH"
JOURNAL_ENV = "NARWHAL_JOURNAL_PATH"
LOG_FORMAT_ENV = "NARWHAL_LOG_FORMAT"
LOG_LEVEL_ENV = "NARWHAL_LOG_LEVEL"


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
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns; report the base URL through ``nursery.start``.

    ``sockets``: already listening, from ``bind_sockets`` on the same host, port and TLS
    files (the command line binds before trio starts); bound here when None."""
    install_server_fixes()
    router = router or Router(fleet)
    hc = hypercorn_config(fleet, host, port, certfile=certfile, keyfile=keyfile)
    asgi: Any = RouterApp(router)  # hypercorn's ASGI types are structural
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
        task_status.started(binds[0])


def app_from_environment() -> RouterApp:
    """The app each worker process builds (``--workers N``): config path from the env."""
    install_server_fixes()  # hypercorn calls this before its worker serves
    configure_logs(
        os.environ.get(LOG_FORMAT_ENV, "text"),  # type: ignore[arg-type]
        os.environ.get(LOG_LEVEL_ENV, "info"),
    )
    journal = Journal(os.environ.get(JOURNAL_ENV) or None)
    path = os.environ[CONFIG_ENV]
    return RouterApp(Router(load_config(path), journal=journal, config_path=path))


def run_workers(
    config_path: str,
    fleet: FleetConfig,
    host: str,
    port: int,
    workers: int,
    journal_path: str | None = None,
    log_format: str = "text",
    log_level: str = "info",
    certfile: str | None = None,
    keyfile: str | None = None,
) -> int:
    """N worker processes sharing one listening socket (hypercorn's multiprocess runner,
    which binds it itself: the command line checks the address with ``bind_sockets`` first)."""
    from hypercorn.run import run

    os.environ[CONFIG_ENV] = os.path.abspath(config_path)
    os.environ[LOG_FORMAT_ENV], os.environ[LOG_LEVEL_ENV] = log_format, log_level
    if journal_path:
        os.environ[JOURNAL_ENV] = os.path.abspath(journal_path)
    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # every worker writes its metrics here; a scrape of any worker sums them all
        own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="narwhal-prom-")
    hc = hypercorn_config(fleet, host, port, certfile=certfile, keyfile=keyfile)
    hc.workers = workers
    hc.application_path = "narwhal.server:app_from_environment()"
    try:
        return int(run(hc))
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
