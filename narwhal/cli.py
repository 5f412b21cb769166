"""``narwhal serve | fake-engine | demo``: the standalone binary."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from narwhal.config import ConfigError, load_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router on a fleet file")
    serve.add_argument("--config", required=True, help="fleet file (.toml or .json)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--journal", help="append one JSON line per finished request here")
    serve.add_argument("--log-format", choices=("text", "json"), default="text")
    serve.add_argument("--log-level", default="info")

    fake = sub.add_parser("fake-engine", help="run the built-in stand-in for a vLLM engine")
    fake.add_argument("--port", type=int, required=True)
    fake.add_argument("--host", default="127.0.0.1")
    fake.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    fake.add_argument("--model", default="fake-model")
    fake.add_argument("--engine-id", default="", help="NIXL engine id (default: a fresh uuid)")
    fake.add_argument("--kv-port", type=int, default=0, help="KV side-channel port (0: any)")
    fake.add_argument("--itl-s", type=float, default=0.0, help="delay between tokens")
    fake.add_argument("--prefill-delay-per-token-s", type=float, default=0.0)
    fake.add_argument("--kv-lease-s", type=float, default=30.0)
    fake.add_argument("--max-model-len", type=int, default=32768)

    check = sub.add_parser("check", help="preflight: reach every engine, move KV across pairs")
    check.add_argument("--config", required=True, help="fleet file (.toml or .json)")

    demo = sub.add_parser("demo", help="two fake engines + the router; stream one chat")
    demo.add_argument("--keep", action="store_true", help="keep the fleet up for curl")
    demo.add_argument("--port", type=int, default=8000, help="router port (0: any)")

    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "fake-engine":
        return _fake_engine(args)
    if args.command == "check":
        return _check(args)
    from narwhal.demo import run_demo

    return run_demo(keep=args.keep, port=args.port)


def _serve(args: argparse.Namespace) -> int:
    from narwhal.logs import configure

    configure(args.log_format, args.log_level)
    try:
        fleet = load_config(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    from narwhal.server import install_server_fixes
    from narwhal.shapes import ShapeMismatch

    try:
        install_server_fixes()
    except ShapeMismatch as exc:
        print(f"narwhal: cannot start: {exc}", file=sys.stderr)
        return 2
    if args.journal:
        from narwhal.router.journal import OPEN_FLAGS

        # every worker opens it again; a missing directory is one line here, not a traceback
        try:
            os.close(os.open(args.journal, OPEN_FLAGS, 0o644))
        except OSError as exc:
            print(
                f"narwhal: cannot open the journal {args.journal}: {exc.strerror}", file=sys.stderr
            )
            return 2
    if args.workers > 1:
        from narwhal.server import run_workers

        return run_workers(
            args.config,
            fleet,
            args.host,
            args.port,
            args.workers,
            args.journal,
            args.log_format,
            args.log_level,
        )
    from narwhal.router.journal import Journal
    from narwhal.router.service import Router
    from narwhal.server import serve

    try:
        router = Router(fleet, journal=Journal(args.journal), config_path=args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reload_on_sighup, router)
            async with trio.open_nursery() as server:
                url = await server.start(
                    partial(
                        serve,
                        fleet,
                        host=args.host,
                        port=args.port,
                        router=router,
                        shutdown_trigger=_signalled,
                    )
                )
                print(
                    f"narwhal: serving {fleet.model} on {url} with {len(fleet.engines)} engine(s)",
                    file=sys.stderr,
                )
            nursery.cancel_scope.cancel()  # the server is done (drained): stop listening for SIGHUP

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
    return 0


def _check(args: argparse.Namespace) -> int:
    from narwhal.check import check_fleet

    try:
        fleet = load_config(args.config)
    except ConfigError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    lines, ok = trio.run(check_fleet, fleet)
    print("\n".join(lines))
    return 0 if ok else 1


async def _reload_on_sighup(router: Any) -> None:
    """SIGHUP reopens the journal file (logrotate moved it) and re-reads the fleet file; an
    invalid fleet file is reported and the running fleet kept."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            router.journal.reopen()
            try:
                router.reload_file()
            except ConfigError as exc:
                print(exc.render() + "\nkeeping the running fleet", file=sys.stderr, flush=True)


async def _signalled() -> None:
    """Return on SIGINT or SIGTERM (a background job may have SIGINT ignored)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def _fake_engine(args: argparse.Namespace) -> int:
    from narwhal.fake_engine.engine import FakeEngine, FakeEngineConfig

    engine = FakeEngine(
        FakeEngineConfig(
            model=args.model,
            role=args.role,
            engine_id=args.engine_id,
            host=args.host,
            port=args.port,
            kv_port=args.kv_port,
            itl_s=args.itl_s,
            prefill_delay_per_token_s=args.prefill_delay_per_token_s,
            kv_lease_s=args.kv_lease_s,
            max_model_len=args.max_model_len,
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
            await _signalled()
            nursery.cancel_scope.cancel()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(main)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
