"""``narwhal serve | check | fake-engine | demo``: the standalone binary's command line.

The parser and ``main``, which runs the command asked for (``narwhal.process.commands``). Whatever
keeps a command from starting is one line on stderr naming its cause, never a traceback
(an invalid fleet file is its list of problems), with an exit status of its own
(``narwhal.process.startup.EXIT_STATUS_HELP``, shown by ``--help`` too).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from functools import partial

from narwhal.process import build, commands
from narwhal.process.startup import EXIT_STATUS_HELP, StartupError

DESCRIPTION = "Narwhal: a router for disaggregated (prefill/decode) LLM serving."


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
            return commands.serve_command(args)
        if args.command == "fake-engine":
            return commands.fake_engine_command(args)
        if args.command == "check":
            return commands.check_command(args)
        return commands.demo_command(args)
    except StartupError as exc:
        if getattr(args, "log_format", "text") == "json":  # the mode stays all JSON
            from narwhal.observe.logs import announce

            announce(exc.message, {"exit_status": exc.status}, "json", level="error")
        else:
            print(exc.message, file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    raise SystemExit(main())
