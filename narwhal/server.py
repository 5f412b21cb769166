"""Serving the router with hypercorn's trio worker, in-process or as N worker processes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

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


def hypercorn_config(fleet: FleetConfig, host: str, port: int) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [f"{host}:{port}"]
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
    hc.alpn_protocols = ["http/1.1"]  # HTTP/2 is not served (narwhal.client_connection)
    return hc


async def serve(
    fleet: FleetConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    router: Router | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns; report the base URL through ``nursery.start``."""
    install_server_fixes()
    router = router or Router(fleet)
    app: Any = RouterApp(router)  # hypercorn's ASGI types are structural
    hc = hypercorn_config(fleet, host, port)
    wait = shutdown_trigger or trio.sleep_forever

    async def trigger() -> None:
        await wait()
        router.begin_drain()  # then hypercorn stops accepting and waits for the handlers

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: hypercorn_serve(
                app, hc, shutdown_trigger=trigger, task_status=task_status
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
) -> int:
    """N worker processes sharing one listening socket (hypercorn's multiprocess runner)."""
    from hypercorn.run import run

    os.environ[CONFIG_ENV] = os.path.abspath(config_path)
    os.environ[LOG_FORMAT_ENV], os.environ[LOG_LEVEL_ENV] = log_format, log_level
    if journal_path:
        os.environ[JOURNAL_ENV] = os.path.abspath(journal_path)
    own_dir = None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # every worker writes its metrics here; a scrape of any worker sums them all
        own_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="narwhal-prom-")
    hc = hypercorn_config(fleet, host, port)
    hc.workers = workers
    hc.application_path = "narwhal.server:app_from_environment()"
    try:
        return int(run(hc))
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
