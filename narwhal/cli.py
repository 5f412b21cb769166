"""``narwhal serve | check | fake-engine | demo``: the standalone binary.

Whatever keeps a command from starting is one line on stderr naming its cause, never a
traceback (an invalid fleet file is its list of problems), with an exit status of its own
(``EXIT_STATUS_HELP``, shown by ``--help`` too).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib.metadata
import os
import signal
import socket
import ssl
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from narwhal import build
from narwhal.config_files import (
    FleetFileUnreadable,
    fleet_format,
    load_config_bytes,
    read_fleet_file,
    sets_key,
)
from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.limits import check_workers
from narwhal.logs import LogFormat

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.config import Sockets

    from narwhal.router.service import Router

DESCRIPTION = "Narwhal: a router for disaggregated (prefill/decode) LLM serving."
EXIT_CHECK_FAILED = 1
EXIT_INVALID_FLEET = 2  # argparse's status for a bad command line too
EXIT_NO_FLEET_FILE = 3
EXIT_JOURNAL = 4
EXIT_PORT = 5
EXIT_HOST = 6
EXIT_TLS = 7
EXIT_VERSIONS = 8
EXIT_STATUS_HELP = """\
exit status:
  0  done (serve: drained after SIGTERM or SIGINT; check: everything passed)
  1  check: an engine or a KV transfer failed; serve --workers N: workers kept dying,
     or one did not drain in time
  2  the fleet file is invalid (one "path: rule" line per problem), or the command line
  3  the fleet file cannot be read (missing, a directory, no permission)
  4  the journal cannot be opened (its directory missing, not writable, a FIFO nobody reads)
  5  the port cannot be had (another process listens on it, or it needs privilege)
  6  the host cannot be listened on (a name that does not resolve, not this machine's address)
  7  TLS: --ssl-certfile or --ssl-keyfile alone, a file that cannot be read, no PEM
     certificate, or a key that is encrypted or does not match the certificate
  8  the installed hypercorn, h11 or trio are not the versions narwhal was written against"""


class StartupError(Exception):
    """Why a command cannot start: the text for stderr (it names the cause) and the exit
    status of its kind (the table above)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def version() -> str:
    """The installed distribution's version; the package's own when not installed."""
    try:
        return importlib.metadata.version("narwhal")
    except importlib.metadata.PackageNotFoundError:
        from narwhal import __version__

        return __version__


class _Version(argparse.Action):
    """``--version``: the version and the build that runs, found only when asked (the
    build's lookup reads the package's files: not work for every start)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"narwhal {version()}, {build.describe()}")
        parser.exit()


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help shows its default (none for a flag, a required option or an
    option whose absence means "off"); descriptions and epilogs keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        shown = action.help is not None and "(default" in action.help
        if action.required or action.default is None or action.default is False or shown:
            return action.help
        return super()._get_help_string(action)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535 (0: any free port), got {port}")
    return port


def _chunk_tokens(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of counts like 1,3,0,2: {text!r}") from None
    if any(k < 0 for k in counts) or not any(counts):
        raise argparse.ArgumentTypeError(f"counts are >= 0, one at least > 0: {text!r}")
    return counts


MAX_WORKERS = 256  # far past any core count; each worker holds sockets and a process


def _workers(text: str) -> int:
    value = _positive(text)
    if value > MAX_WORKERS:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_WORKERS} (one per core is the rule), got {value}"
        )
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="narwhal",
        description=DESCRIPTION,
        epilog=EXIT_STATUS_HELP,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="show the version and the build, and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = partial(sub.add_parser, formatter_class=_HelpFormatter)

    serve = add("serve", help="run the router on a fleet file", epilog=EXIT_STATUS_HELP)
    serve.add_argument("--config", required=True, help="fleet file (.toml or .json)")
    serve.add_argument("--host", default="127.0.0.1", help="address or name to listen on")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any)")
    serve.add_argument(
        "--workers",
        type=_workers,
        default=1,
        help="processes that act as one router (each with its own listener on the port)",
    )
    serve.add_argument("--journal", help="append one JSON line per finished request here")
    serve.add_argument(
        "--ssl-certfile", help="serve TLS (HTTP/1.1 only) with this PEM certificate chain"
    )
    serve.add_argument("--ssl-keyfile", help="the PEM private key of --ssl-certfile (unencrypted)")
    serve.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="log line format"
    )
    serve.add_argument(
        "--log-level",
        type=str.lower,
        choices=("debug", "info", "warning", "error", "critical"),
        default="info",
        help="lowest level logged",
    )

    fake = add("fake-engine", help="run the built-in stand-in for a vLLM engine")
    fake.add_argument("--port", type=_port, required=True, help="port to listen on (0: any)")
    fake.add_argument("--host", default="127.0.0.1", help="address to listen on")
    fake.add_argument(
        "--role", choices=("prefill", "decode", "both"), default="both", help="what it serves"
    )
    fake.add_argument("--model", default="fake-model", help="the model name it serves")
    fake.add_argument("--engine-id", default="", help="NIXL engine id (default: a fresh uuid)")
    fake.add_argument("--kv-port", type=_port, default=0, help="KV side-channel port (0: any)")
    fake.add_argument("--itl-s", type=float, default=0.0, help="delay between tokens")
    fake.add_argument(
        "--chunk-tokens",
        type=_chunk_tokens,
        default=(),
        help="tokens per streamed chunk, in turn, e.g. 1,3,0,2 (0: text held for the next); "
        "default one per chunk",
    )
    fake.add_argument(
        "--prefill-delay-per-token-s",
        type=float,
        default=0.0,
        help="prefill time per prompt token",
    )
    fake.add_argument(
        "--kv-lease-s", type=float, default=30.0, help="how long unread KV blocks are kept"
    )
    fake.add_argument(
        "--max-model-len", type=int, default=32768, help="longest prompt plus output, in tokens"
    )
    from narwhal.fake_engine import cost as fake_cost

    fake_cost.add_arguments(fake)  # the cost model: --slots, --prefix-cache-blocks, ...
    from narwhal.fake_engine import kv_events as fake_kv_events

    fake_kv_events.add_arguments(fake)  # --kv-events-endpoint, ...
    from narwhal.fake_engine import lora as fake_lora

    fake_lora.add_arguments(fake)  # --models, --max-loras, --lora-swap-ms

    check = add(
        "check", help="preflight: reach every engine, move KV across pairs", epilog=EXIT_STATUS_HELP
    )
    check.add_argument("--config", required=True, help="fleet file (.toml or .json)")

    demo = add("demo", help="two fake engines + the router; stream one chat")
    demo.add_argument("--keep", action="store_true", help="keep the fleet up for curl")
    demo.add_argument("--port", type=_port, default=8000, help="router port (0: any)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "fake-engine":
            return _fake_engine(args)
        if args.command == "check":
            return _check(args)
        return _demo(args)
    except StartupError as exc:
        if getattr(args, "log_format", "text") == "json":  # the mode stays all JSON
            from narwhal.logs import announce

            announce(exc.message, {"exit_status": exc.status}, "json", level="error")
        else:
            print(exc.message, file=sys.stderr)
        return exc.status


# what must hold before anything starts, each a StartupError of its own kind


def load_fleet(path: str) -> FleetConfig:
    """The fleet file at ``path`` (named as typed), by the one loader."""
    try:
        return load_config_bytes(read_fleet_file(path), fmt=fleet_format(path), source=path)
    except FleetFileUnreadable as exc:
        raise StartupError(
            EXIT_NO_FLEET_FILE, f"narwhal: cannot read the fleet file {path}: {_why(exc.error)}"
        ) from None
    except ConfigError as exc:
        raise StartupError(EXIT_INVALID_FLEET, exc.render()) from None


def serving_fleet(path: str) -> FleetConfig:
    """What ``serve`` checks first, in one process or in each worker of ``--workers N``:
    the fleet file loads, and the internals the front door builds on are the ones it was
    written against."""
    fleet = load_fleet(path)
    _verify_internals()
    return fleet


def start_router(fleet: FleetConfig, config_path: str, journal_path: str | None) -> Router:
    """The router that serves ``fleet``, in one process or in a worker of ``--workers N``:
    tracing as the ``OTEL_*`` environment asks, its journal open, its keys and engines set
    up. A journal that cannot be opened, or a key variable that is unset, is a
    StartupError."""
    from narwhal import tracing
    from narwhal.router.journal import Journal
    from narwhal.router.service import Router

    tracing.setup()  # each process exports its own spans
    try:
        journal = Journal(journal_path)
    except OSError as exc:
        raise StartupError(
            EXIT_JOURNAL, f"narwhal: cannot open the journal {journal_path}: {_why(exc)}"
        ) from None
    try:
        return Router(fleet, journal=journal, config_path=config_path)
    except ConfigError as exc:
        raise StartupError(EXIT_INVALID_FLEET, exc.render()) from None


def _verify_internals() -> None:
    from narwhal.frontdoor.internals_check import InternalsMismatch
    from narwhal.frontdoor.server import verify_internals

    try:
        verify_internals()
    except InternalsMismatch as exc:
        raise StartupError(EXIT_VERSIONS, f"narwhal: cannot start: {exc}") from None


def check_journal(path: str) -> None:
    """Open (and create) the journal once: every worker opens it again, and a path that
    cannot be opened is one line here."""
    from narwhal.router.journal import OPEN_FLAGS

    try:
        os.close(os.open(path, OPEN_FLAGS, 0o644))
    except OSError as exc:
        why = _why(exc)
        parent = Path(path).parent
        if exc.errno == errno.ENOENT and not parent.is_dir():
            why = f"its directory {parent} does not exist"
        elif exc.errno == errno.ENXIO:
            why = f"a FIFO nobody reads ({why})"
        raise StartupError(
            EXIT_JOURNAL, f"narwhal: cannot open the journal {path}: {why}"
        ) from None


def check_tls(certfile: str | None, keyfile: str | None, hc: HypercornConfig) -> None:
    """Both files or neither; each readable; a PEM certificate and its unencrypted key."""
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        given, missing = "--ssl-certfile", "--ssl-keyfile"
        if certfile is None:
            given, missing = missing, given
        raise StartupError(
            EXIT_TLS, f"narwhal: {given} needs {missing} too (TLS takes both; plain HTTP neither)"
        )
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise StartupError(
                EXIT_TLS, f"narwhal: cannot read {flag} {path}: {_why(exc)}"
            ) from None
    try:
        ssl.create_default_context().load_verify_locations(cafile=certfile)
    except (ssl.SSLError, ValueError):
        raise StartupError(
            EXIT_TLS, f"narwhal: --ssl-certfile {certfile} holds no PEM certificate"
        ) from None
    try:
        hc.create_ssl_context()
    except (ssl.SSLError, ValueError) as exc:
        if getattr(exc, "reason", None) == "KEY_VALUES_MISMATCH":
            why = f"the key does not match the certificate in {certfile}"
        else:
            why = "not an unencrypted PEM private key"
        raise StartupError(EXIT_TLS, f"narwhal: --ssl-keyfile {keyfile}: {why}") from None


def listen(hc: HypercornConfig, host: str, port: int) -> Sockets:
    """Bind and listen now (``narwhal.frontdoor.server.bind_sockets``), naming what went wrong."""
    from narwhal.frontdoor.server import bind_sockets

    try:
        return bind_sockets(hc)
    except (OSError, UnicodeError, ValueError) as exc:
        raise listen_failure(exc, host, port) from None


def _first(group: BaseException) -> BaseException:
    """The first leaf exception of a (nested) exception group."""
    while isinstance(group, BaseExceptionGroup):
        group = group.exceptions[0]
    return group


def listen_failure(exc: Exception, host: str, port: int) -> StartupError:
    """What a failed bind means to the operator: the port (taken, privileged) or the host."""
    where = f"narwhal: cannot listen on {host}:{port}:"
    if isinstance(exc, socket.gaierror | UnicodeError):
        return StartupError(EXIT_HOST, f"{where} the host {host!r} does not resolve ({_why(exc)})")
    code = exc.errno if isinstance(exc, OSError) else None
    if code == errno.EADDRINUSE:
        return StartupError(EXIT_PORT, f"{where} port {port} is taken by another process")
    if code == errno.EACCES:
        return StartupError(EXIT_PORT, f"{where} permission denied (a port below 1024?)")
    if code == errno.EADDRNOTAVAIL:
        return StartupError(EXIT_HOST, f"{where} {host} is not an address of this machine")
    return StartupError(EXIT_HOST, f"{where} {_why(exc)}")


def _why(exc: Exception) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__


# the commands


def _serve(args: argparse.Namespace) -> int:
    from narwhal.frontdoor.server import close_sockets
    from narwhal.logs import announce, configure
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
    """``--workers N``: the parent (``narwhal.workers.Supervisor``) binds one listener per
    worker and supervises them; the workers are ``worker_main``."""
    from narwhal.workers import Supervisor, WorkerSpec, bind_worker_sockets

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
    """One worker of ``serve --workers N``: started by ``narwhal.workers.Supervisor`` with
    its listener and control channel (``narwhal.workers.WORKER_COMMAND``), never by hand.
    What keeps it from starting is the same one line and status as for ``serve``, and the
    parent then exits with that status."""
    from narwhal.logs import configure
    from narwhal.workers import WorkerSpec, run_worker

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


def _check(args: argparse.Namespace) -> int:
    from narwhal.check import check_fleet

    fleet = load_fleet(args.config)
    lease_from = args.config if sets_key(args.config, "engine", "kv_lease_s") else None
    lines, ok = trio.run(partial(check_fleet, fleet, lease_from=lease_from))
    print("\n".join(lines))
    return 0 if ok else EXIT_CHECK_FAILED


def _demo(args: argparse.Namespace) -> int:
    from narwhal import demo

    try:
        sockets = demo.listen(args.port)
    except (OSError, UnicodeError, ValueError) as exc:
        raise listen_failure(exc, demo.HOST, args.port) from None
    return demo.run_demo(keep=args.keep, port=args.port, sockets=sockets)


async def _reload_on_sighup(router: Any, log_format: LogFormat = "text") -> None:
    """SIGHUP reopens the journal file (logrotate moved it) and re-reads the fleet file; an
    invalid fleet file is reported and the running fleet kept."""
    from narwhal.logs import announce

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


def _fake_engine(args: argparse.Namespace) -> int:
    from narwhal.fake_engine import cost as fake_cost
    from narwhal.fake_engine import kv_events as fake_kv_events
    from narwhal.fake_engine import lora as fake_lora
    from narwhal.fake_engine.engine import FakeEngine, FakeEngineConfig
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


if __name__ == "__main__":
    raise SystemExit(main())
