"""API keys: client keys (``serving.api_keys_env``) and admin keys
(``serving.admin_keys_env``), each sent as ``Authorization: Bearer <key>``.

Keys come from the named environment variable (comma-separated), never from the fleet
file, and are never logged. Every configured key is compared, in constant time, so the
answer's timing says nothing about how much of a key matched.
"""

from __future__ import annotations

import hmac
import os

from narwhal.config import ConfigError


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

    def allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """True when the request carries one of the keys (or none are configured)."""
        if not self.keys:
            return True
        offered = b""
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                offered = value[7:].strip()
        matched = False
        for key in self.keys:  # no early exit: the same work whatever matches
            matched |= hmac.compare_digest(key, offered)
        return matched
