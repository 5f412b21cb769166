"""API keys: client keys (``serving.api_keys_env``) and admin keys
(``serving.admin_keys_env``), each sent as ``Authorization: Bearer <key>``.

Keys come from the named environment variable (comma-separated), never from the fleet
file, and are never logged. Every configured key is compared, in constant time, so the
answer's timing says nothing about how much of a key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from narwhal.core.config import ConfigError


class ApiKeys:
    def __init__(self, env_var: str, key: str = "serving.api_keys_env") -> None:
        self.env_var = env_var
        self.keys: tuple[bytes, ...] = ()
        if not env_var:
            return  # an open router
        raw = os.environ.get(env_var, "")
        keys = tuple(k.strip().encode() for k in raw.split(",") if k.strip())
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
        if not self.keys:
            return True
        offered = _offered(headers)
        matched = False
        for key in self.keys:  # no early exit: the same work whatever matches
            matched |= hmac.compare_digest(key, offered)
        return matched


def _offered(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The bearer key a request carries (the last ``authorization`` header), or b""."""
    offered = b""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            offered = value[7:].strip()
    return offered
