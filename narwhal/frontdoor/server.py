"""The serve loop: hypercorn's connection handling for an ASGI app over our own loop (each
process of ``--workers N`` runs ``serve`` too: ``narwhal.process.worker_process``). The app, its
hooks and the settings come from the caller: the front door knows nothing of the router.

``serve_connections`` is hypercorn's ``worker_serve`` (its lifespan, its ``Config``, its
worker context) with two pieces of ours where that function names its own: every
connection is a ``ClientConnection`` (``narwhal.frontdoor.connection``) and every listener
a ``BurstListener`` (``narwhal.frontdoor.listener``). Both are built here, for this
server's sockets only: no module global of hypercorn and no class of trio is replaced, so
anything else in the process (a fake engine in a test, another trio server) runs stock.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable
from functools import cache, partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr, wrap_app

from narwhal.frontdoor import seams
from narwhal.frontdoor.connection import ClientConnection
from narwhal.frontdoor.http11 import AppHooks
from narwhal.frontdoor.internals_check import verify
from narwhal.frontdoor.listener import BurstListener
from narwhal.frontdoor.server_end import ServerEnd


@cache  # the installed libraries do not change under a running process
def verify_internals() -> None:
    """Raise ``narwhal.frontdoor.internals_check.InternalsMismatch`` when the hypercorn or
    h11 internals that the front door runs against (``narwhal.frontdoor.seams``) are not
    the ones it was written against."""
    verify(seams.DIGESTS, seams.PRESENT)


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
    app: Any,
    hc: HypercornConfig,
    *,
    hooks: AppHooks | None = None,
    sockets: Sockets | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` with the settings ``hc`` until ``shutdown_trigger`` returns;
    report the base URL through ``nursery.start``. ``hooks``: what the connections ask of
    the app (``AppHooks``). ``sockets``: already listening, from ``bind_sockets`` on
    ``hc``'s host, port and TLS files (the command line binds before trio starts); bound
    here when None."""
    verify_internals()
    if sockets is None:
        sockets = bind_sockets(hc)
    trigger = shutdown_trigger or trio.sleep_forever
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve_connections, app, hc, sockets, trigger, hooks))
        # what startup made (modules, config, the app) lives as long as the process: out of
        # the collector's generations, a collection walks only what requests make
        gc.freeze()
        task_status.started(binds[0])


async def serve_connections(
    app: Any,
    hc: HypercornConfig,
    sockets: Sockets,
    shutdown_trigger: Callable[[], Awaitable[None]],
    hooks: AppHooks | None = None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Hypercorn's ``worker_serve`` for listening TCP sockets (no QUIC): the app's
    lifespan, one ``ClientConnection`` per accepted connection in the server's nursery,
    and on ``shutdown_trigger`` the listeners close, every connection is told
    (``ServerEnd``) and gets ``hc.graceful_timeout`` to finish."""
    lifespan_state: LifespanState = {}
    # hypercorn's lifespan calls the app as its wrapper does (five arguments); a request
    # calls the app itself (``Http11Protocol.call_app``): a held stream's task keeps no
    # frame of the wrapper's
    wrapped = wrap_app(app, hc.wsgi_max_body_size, "asgi")  # as hypercorn.trio.serve wraps it
    lifespan = Lifespan(wrapped, hc, lifespan_state)
    context = WorkerContext(None)
    end = context.terminated = ServerEnd(context.terminated)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            listeners, binds = await _listeners(hc, sockets)
            task_status.started(binds)

            async def connection(stream: trio.abc.Stream) -> None:
                state = ConnectionState(lifespan_state.copy())
                await ClientConnection(app, hc, context, state, stream, hooks=hooks).run()

            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        partial(
                            trio.serve_listeners,
                            connection,
                            listeners,
                            handler_nursery=server_nursery,
                        )
                    )
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()  # the listeners close
            finally:
                await end.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _listeners(
    hc: HypercornConfig, sockets: Sockets
) -> tuple[list[trio.abc.Listener[Any]], list[str]]:
    listeners: list[trio.abc.Listener[Any]] = []
    binds = []
    ssl_context = hc.create_ssl_context() if sockets.secure_sockets else None
    for sock in sockets.secure_sockets:
        assert ssl_context is not None
        listeners.append(trio.SSLListener(BurstListener(sock), ssl_context, https_compatible=True))
        binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
    for sock in sockets.insecure_sockets:
        listeners.append(BurstListener(sock))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    for bind in binds:
        await hc.log.info(f"Running on {bind} (CTRL + C to quit)")
    return listeners, binds
