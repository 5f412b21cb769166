"""The router served: its ASGI app, with its hooks and its settings, handed to the front
door's serve loop (``narwhal.frontdoor.server``), which knows nothing of the router. The
command line, each worker of ``--workers N`` (``narwhal.process.worker_process``), the demo
and the tests serve the router through ``serve`` here.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from narwhal.core.config import FleetConfig
from narwhal.frontdoor import server
from narwhal.router.app import RouterApp, WorkerGroup
from narwhal.router.service import FAIL_SEND_BOUND_S, Router


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
    hc.errorlog = logging.getLogger("narwhal.frontdoor.server")
    # Hypercorn's idle timer runs from the connection's start (or its last response) until a
    # request's headers are complete: it bounds idle keep-alive connections and slowloris
    # headers alike. Longer than the idle expiry of common clients (httpx: 5 s).
    hc.keep_alive_timeout = fleet.serving.client_idle_timeout_s
    # hypercorn's default backlog (100) overflows when many clients connect at once, and
    # the kernel's SYN retries then add seconds to their first token (seen at 1,000 streams)
    hc.backlog = 4096
    # Our own limit applies to the body; this bounds headers and the h11 buffer.
    hc.h11_max_incomplete_size = 64 * 1024
    # HTTP/2 is not served (narwhal.frontdoor.connection): a TLS client is never offered h2
    hc.alpn_protocols = ["http/1.1"]
    return hc


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
    """Serve the router until ``shutdown_trigger`` returns; report the base URL through
    ``nursery.start``.

    ``sockets``: already listening, from ``narwhal.frontdoor.server.bind_sockets`` on the
    same host, port and TLS files (the command line binds before trio starts); bound by the
    serve loop when None. ``workers``: this process is one worker of ``--workers N``
    (``narwhal.process.worker_process.ParentLink``)."""
    router = router or Router(fleet)
    hc = hypercorn_config(fleet, host, port, certfile=certfile, keyfile=keyfile)
    app = RouterApp(router, workers)  # the connections' hooks too: AppHooks
    wait = shutdown_trigger or trio.sleep_forever

    async def trigger() -> None:
        await wait()
        router.begin_drain()  # then the serve loop stops accepting and waits for the handlers

    await server.serve(
        app, hc, hooks=app, sockets=sockets, shutdown_trigger=trigger, task_status=task_status
    )
