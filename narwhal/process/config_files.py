"""The fleet file on disk: read it, and check what only the file system can tell.

``load_config_bytes`` is the one loader: everything that loads a fleet file (``serve``,
``check``, a worker's start, every reload) comes through it, so a file is judged by the
same rules everywhere. The rules themselves are ``narwhal.core.config``'s (pure); the ones
here need the disk: the file can be read, and ``engine.ca_file`` loads as the engine client
will load it (docs/operator-guide.md, section 2).
"""

from __future__ import annotations

import os
from pathlib import Path

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.config_parse import document_sets_key, parse_config
from narwhal.engines.transport import tls_context


class FleetFileUnreadable(ConfigError):
    """The fleet file cannot be read (missing, a directory, no permission); ``error`` is
    why, for the command line's own wording of it."""

    def __init__(self, source: str, error: OSError) -> None:
        self.error = error
        super().__init__(source, [f"cannot read file: {error.strerror or error}"])


def load_config(path: str | os.PathLike[str]) -> FleetConfig:
    """Read and load the fleet file at ``path`` (TOML or JSON, by its extension); a
    ConfigError listing every fault, the file named as pathlib spells it (as a reload's
    answer always has; the command line names it as typed:
    ``narwhal.process.startup.load_fleet``)."""
    path = Path(path)
    return load_config_bytes(read_fleet_file(path), fmt=fleet_format(path), source=str(path))


def load_config_bytes(raw: bytes, *, fmt: str, source: str = "<fleet>") -> FleetConfig:
    """A fleet file's bytes as a validated FleetConfig, or the ConfigError that lists every
    ``path: rule``: the pure rules and the file system's."""
    return parse_config(raw, fmt=fmt, source=source, file_rules=_file_problems)


def read_fleet_file(path: str | os.PathLike[str]) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FleetFileUnreadable(os.fspath(path), exc) from None


def fleet_format(path: str | os.PathLike[str]) -> str:
    """The format the file's extension names: "toml", "json" (the loader refuses others)."""
    return Path(path).suffix.lstrip(".").lower()


def sets_key(path: str | os.PathLike[str], section: str, key: str) -> bool:
    """Whether the fleet file at ``path`` sets ``[section] key`` itself (False: the value in
    force is the default); one that cannot be read sets nothing."""
    try:
        raw = read_fleet_file(path)
    except FleetFileUnreadable:
        return False
    return document_sets_key(raw, fleet_format(path), section, key)


def _file_problems(fleet: FleetConfig) -> list[str]:
    """``engine.ca_file`` must load as the engine client will load it."""
    ca_file = fleet.engine.ca_file
    if not ca_file:
        return []
    try:
        tls_context(ca_file)
    except OSError as exc:  # ssl.SSLError too: not a PEM bundle, no certificate in it
        reason = exc.strerror if isinstance(exc.strerror, str) else str(exc)
        return [f"engine.ca_file: cannot load CA bundle {ca_file!r}: {reason}"]
    return []
