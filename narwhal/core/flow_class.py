"""A request's service class and fairness key (contract 3, 4.5), pure.

The class comes from ``x-narwhal-priority`` (``admission.priority_from = "header"``) or
from the client key the request used (``"key"``: ``api_keys_env`` entries written
``class:key``); without either, ``admission.default_class``. The fairness key comes from
``x-narwhal-tenant``, else the client key's hash, else ``anonymous``. A header the router
cannot use is a 400 that names it: a request silently demoted or merged into another
tenant would be a scheduling bug nobody sees.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from msgspec import Struct

from narwhal.core.config import AdmissionConfig
from narwhal.core.faults import BadRequest
from narwhal.core.flow import Priority

PRIORITY_HEADER = b"x-narwhal-priority"
TENANT_HEADER = b"x-narwhal-tenant"
ANONYMOUS = "anonymous"
_TENANT = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
_CLASSES = {cls.value.encode(): cls for cls in Priority}
_NAMES = frozenset(cls.value for cls in Priority)


class Flow(Struct, frozen=True):
    """Where a request stands in the admission queue's order."""

    cls: Priority = Priority.DEFAULT
    tenant: str = ANONYMOUS


def classify(
    headers: Sequence[tuple[bytes, bytes]],
    config: AdmissionConfig,
    *,
    key_id: str | None = None,
    key_class: Priority | None = None,
) -> Flow:
    """The request's flow; raise ``BadRequest`` naming a header that is not usable.

    ``key_id``: the client key's short hash (None without keys); ``key_class``: the class
    its ``api_keys_env`` entry names, if it names one."""
    priority = tenant = None
    for name, value in headers:
        # a header sent twice means its values joined by a comma (RFC 9110 5.3): never a
        # valid class or tenant, so the request is refused, never silently promoted
        if name == PRIORITY_HEADER:
            priority = value.strip() if priority is None else priority + b", " + value.strip()
        elif name == TENANT_HEADER:
            tenant = value.strip() if tenant is None else tenant + b", " + value.strip()
    cls = Priority(config.default_class)
    if config.priority_from == "header" and priority is not None:
        found = _CLASSES.get(priority.lower())
        if found is None:
            raise BadRequest(
                "x-narwhal-priority: must be one of interactive, default, batch",
                param="x-narwhal-priority",
            )
        cls = found
    elif config.priority_from == "key" and key_class is not None:
        cls = key_class
    if tenant is None:
        return Flow(cls, key_id or ANONYMOUS)
    if _TENANT.fullmatch(tenant) is None:
        raise BadRequest(
            "x-narwhal-tenant: must be 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="x-narwhal-tenant",
        )
    return Flow(cls, tenant.decode())


def split_key(entry: str) -> tuple[Priority | None, str]:
    """An ``api_keys_env`` entry under ``priority_from = "key"``: ``class:key`` gives the
    class and the key; an entry without a known class prefix is a key of no class."""
    head, sep, rest = entry.partition(":")
    if sep and rest and head in _NAMES:
        return Priority(head), rest
    return None, entry
