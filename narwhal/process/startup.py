"""What must hold before a command of the ``narwhal`` binary starts, each failure a
``StartupError`` with an exit status of its own (``EXIT_STATUS_HELP``): the fleet file
loads, the front door's internals are the ones it was written against, the journal opens,
the TLS files are a certificate and its key, the host and port can be listened on.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.process.config_files import (
    FleetFileUnreadable,
    fleet_format,
    load_config_bytes,
    read_fleet_file,
)

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.config import Sockets

    from narwhal.router.service import Router

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
    from narwhal.observe import tracing
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
