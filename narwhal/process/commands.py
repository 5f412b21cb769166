"""The commands of the ``narwhal`` binary (``narwhal.process.cli`` parses the line and picks one):
``serve`` in one process or as the parent of ``--workers N``, one worker of it
(``worker_main``), ``check``, ``demo`` and ``fake-engine``. What each must hold before it
starts is ``narwhal.process.startup``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.limits import check_workers
from narwhal.observe.logs import LogFormat
from narwhal.process.config_files import sets_key
from narwhal.process.startup import (
    EXIT_CHECK_FAILED,
    EXIT_INVALID_FLEET,
    EXIT_PORT,
    StartupError,
    check_journal,
    check_tls,
    listen,
    listen_failure,
    load_fleet,
    serving_fleet,
    start_router,
)

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig


def serve_command(args: argparse.Namespace) -> int:
    from narwhal.frontdoor.server import close_sockets
    from narwhal.observe.logs import announce, configure
    from narwhal.router.serving import hypercorn_config

    configure(args.log_format, args.log_level)
    fleet = serving_fleet(args.config)
    if args.journal:
        check_journal(args.journal)
    hc = hypercorn_config(
        fleet, args.host, args.port, certfile=args.ssl_certfile, keyfile=args.ssl_keyfile
    )
    check_tls(args.ssl_certfile, args.ssl_keyfile, hc)
    if args.workers > 1:
        return _serve_workers(args, fleet, hc)
    sockets = listen(hc, args.host, args.port)
    from narwhal.router.serving import serve

    try:
        router = start_router(fleet, args.config, args.journal)
    except StartupError:
        close_sockets(sockets)
        raise

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reload_on_sighup, router, args.log_format)
            async with trio.open_nursery() as server:
                url = await server.start(
                    partial(
                        serve,
                        fleet,
                        host=args.host,
                        port=args.port,
                        router=router,
                        shutdown_trigger=_signalled,
                        certfile=args.ssl_certfile,
                        keyfile=args.ssl_keyfile,
                        sockets=sockets,
                    )
                )
                count = len(router.fleet.engines)  # discovered ones too
                announce(
                    f"narwhal: serving {fleet.model} on {url} with {count} engine(s)",
                    {"model": fleet.model, "url": url, "engines": count},
                    args.log_format,
                )
            nursery.cancel_scope.cancel()  # the server is done (drained): stop listening for SIGHUP

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
    return 0


def _serve_workers(args: argparse.Namespace, fleet: FleetConfig, hc: HypercornConfig) -> int:
    """``--workers N``: the parent (``narwhal.process.workers.Supervisor``) binds one listener per
    worker and supervises them; the workers are ``worker_main``."""
    from narwhal.process.worker_channel import WorkerSpec
    from narwhal.process.workers import Supervisor, bind_worker_sockets

    try:
        check_workers(fleet, args.workers, args.config)
    except ConfigError as exc:
        raise StartupError(EXIT_INVALID_FLEET, exc.render()) from None
    try:
        listeners = bind_worker_sockets(hc, args.workers)
    except (OSError, UnicodeError, ValueError) as exc:
        raise listen_failure(exc, args.host, args.port) from None
    spec = WorkerSpec(
        index=0,
        count=args.workers,
        config=os.path.abspath(args.config),
        host=args.host,
        port=int(listeners[0].getsockname()[1]),
        journal=os.path.abspath(args.journal) if args.journal else None,
        log_format=args.log_format,
        log_level=args.log_level,
        certfile=args.ssl_certfile,
        keyfile=args.ssl_keyfile,
    )
    supervisor = Supervisor(spec, fleet, hc, listeners)
    with contextlib.suppress(KeyboardInterrupt):
        return trio.run(supervisor.run)
    return 0


def worker_main() -> int:
    """One worker of ``serve --workers N``: started by ``narwhal.process.workers.Supervisor`` with
    its listener and control channel (``narwhal.process.workers.WORKER_COMMAND``), never by hand.
    What keeps it from starting is the same one line and status as for ``serve``, and the
    parent then exits with that status."""
    from narwhal.observe.logs import configure
    from narwhal.process.worker_channel import WorkerSpec
    from narwhal.process.worker_process import run_worker

    spec = WorkerSpec.from_environment()
    configure(spec.log_format, spec.log_level)
    try:
        fleet = serving_fleet(spec.config)
        router = start_router(fleet, spec.config, spec.journal)
        router.admission.worker_index = spec.index
        router.admission.worker_count = spec.count
    except StartupError as exc:
        print(exc.message, file=sys.stderr, flush=True)
        return exc.status
    return run_worker(spec, fleet, router)


def check_command(args: argparse.Namespace) -> int:
    from narwhal.process.check import check_fleet

    fleet = load_fleet(args.config)
    lease_from = args.config if sets_key(args.config, "engine", "kv_lease_s") else None
    lines, ok = trio.run(partial(check_fleet, fleet, lease_from=lease_from))
    print("\n".join(lines))
    return 0 if ok else EXIT_CHECK_FAILED


def demo_command(args: argparse.Namespace) -> int:
    from narwhal.process import demo

    try:
        sockets = demo.listen(args.port)
    except (OSError, UnicodeError, ValueError) as exc:
        raise listen_failure(exc, demo.HOST, args.port) from None
    return demo.run_demo(keep=args.keep, port=args.port, sockets=sockets)


async def _reload_on_sighup(router: Any, log_format: LogFormat = "text") -> None:
    """SIGHUP reopens the journal file (logrotate moved it) and re-reads the fleet file; an
    invalid fleet file is reported and the running fleet kept."""
    from narwhal.observe.logs import announce

    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            router.journal.reopen()
            try:
                router.reload_file()
            except ConfigError as exc:
                text = exc.render() + "\nkeeping the running fleet"
                announce(text, {"problems": exc.problems, "kept": True}, log_format)


async def _signalled() -> None:
    """Return on SIGINT or SIGTERM (a background job may have SIGINT ignored)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def fake_engine_command(args: argparse.Namespace) -> int:
    from narwhal.fake_engine import cost as fake_cost
    from narwhal.fake_engine import kv_events as fake_kv_events
    from narwhal.fake_engine import lora as fake_lora
    from narwhal.fake_engine.config import FakeEngineConfig
    from narwhal.fake_engine.engine import FakeEngine
    from narwhal.fake_engine.kv_publisher import BindError

    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        raise StartupError(
            EXIT_INVALID_FLEET, "narwhal: --kv-events-replay-endpoint needs --kv-events-endpoint"
        )
    engine = FakeEngine(
        FakeEngineConfig(
            model=args.model,
            role=args.role,
            engine_id=args.engine_id,
            host=args.host,
            port=args.port,
            kv_port=args.kv_port,
            itl_s=args.itl_s,
            chunk_tokens=args.chunk_tokens,
            prefill_delay_per_token_s=args.prefill_delay_per_token_s,
            kv_lease_s=args.kv_lease_s,
            max_model_len=args.max_model_len,
            **fake_cost.config_fields(args),
            **fake_kv_events.config_fields(args),
            **fake_lora.config_fields(args),
        )
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(engine.serve)
            print(
                f"fake-engine {engine.engine_id} ({args.role}) on {url}, "
                f"kv side channel :{engine.kv_port}",
                file=sys.stderr,
                flush=True,
            )
            if engine.kv_events is not None:
                sources = engine.kv_events.sources()
                print(
                    f"fake-engine KV events on {sources['endpoint']} ({sources['mode']}), "
                    f"replay {sources['replay_endpoint']}, topic {sources['topic']!r}",
                    file=sys.stderr,
                    flush=True,
                )
            await _signalled()
            nursery.cancel_scope.cancel()

    try:
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(main)
    except BaseExceptionGroup as group:  # its listeners bind inside a nursery
        kv_failed = group.subgroup(BindError)
        if kv_failed is not None:
            raise StartupError(EXIT_PORT, str(_first(kv_failed))) from None
        failed = group.subgroup(OSError)
        if failed is None:
            raise
        first: BaseException = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        assert isinstance(first, OSError)
        raise listen_failure(first, args.host, args.port) from None
    except OSError as exc:
        raise listen_failure(exc, args.host, args.port) from None
    return 0


def _first(group: BaseException) -> BaseException:
    """The first leaf exception of a (nested) exception group."""
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group
