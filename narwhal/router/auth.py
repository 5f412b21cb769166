"""API keys: client keys (``serving.api_keys_env``) and admin keys
(``serving.admin_keys_env``), each sent as ``Authorization: Bearer <key>``; and the warning
when the engines' own key (``engine.api_key_env``) would travel over plain HTTP.

Keys come from the named environment variable (comma-separated), never from the fleet
file, and are never logged. Every configured key is compared, in constant time, so the
answer's timing says nothing about how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from urllib.parse import urlsplit

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.flow import Priority
from narwhal.core.flow_class import split_key
from narwhal.observe.logs import log_event

log = logging.getLogger("narwhal.router")  # the warning is the router's, as it starts
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class ApiKeys:
    """``classes``: entries may be written ``class:key`` (``admission.priority_from =
    "key"``), and a request sent with such a key is of that class."""

    def __init__(
        self, env_var: str, key: str = "serving.api_keys_env", *, classes: bool = False
    ) -> None:
        self.env_var = env_var
        self.keys: tuple[bytes, ...] = ()
        self.classes: tuple[Priority | None, ...] = ()
        if not env_var:
            return  # an open router
        raw = os.environ.get(env_var, "")
        entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
        split = [split_key(entry) if classes else (None, entry) for entry in entries]
        keys = tuple(k.encode() for _, k in split)
        self.classes = tuple(cls for cls, _ in split)
        if not keys:
            # fail closed and loudly: an operator who asked for keys must not run open
            raise ConfigError(
                "<environment>",
                [f"{key}: environment variable {env_var} is unset or empty"],
            )
        self.keys = keys

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def key_id(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """Which key a request used, for the journal: the first 12 hex digits of its
        SHA-256, never the key (None on an open router or without a key)."""
        if not self.keys:
            return None
        offered = _offered(headers)
        return hashlib.sha256(offered).hexdigest()[:12] if offered else None

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """True when the request carries one of the keys (or none are configured)."""
        return not self.keys or self._match(headers) is not None

    def key_class(self, headers: list[tuple[bytes, bytes]]) -> Priority | None:
        """The class of the key the request carries, when its entry names one."""
        index = self._match(headers)
        return None if index is None or not self.classes else self.classes[index]

    def _match(self, headers: list[tuple[bytes, bytes]]) -> int | None:
        """Which key the request carries (its index), or None."""
        offered = _offered(headers)
        matched = None
        for index, key in enumerate(self.keys):  # no early exit: the same work whatever matches
            if hmac.compare_digest(key, offered):
                matched = index
        return matched


def _offered(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The bearer key a request carries (the last ``authorization`` header), or b""."""
    offered = b""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            offered = value[7:].strip()
    return offered


def warn_plain_http_keys(config: FleetConfig) -> None:
    """The engines' bearer token goes over plain HTTP to an ``http://`` engine off this
    machine: the operator asked for it (the URL says so), but should know."""
    exposed = [
        e.id
        for e in config.engines
        if e.url.startswith("http://") and urlsplit(e.url).hostname not in LOCAL_HOSTS
    ]
    exposed += [d.name for d in config.discover if d.scheme == "http"]
    if exposed:
        log_event(
            log,
            logging.WARNING,
            "engine.api_key_env is set and these engines are reached over plain http://: "
            "the token travels unencrypted (use https:// and engine.ca_file)",
            {"engines": exposed},
        )
