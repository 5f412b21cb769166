"""The fleet file's rules that no key's annotation can say: the shape of an engine's URL,
a ZMQ endpoint, a discover block's name and DNS name, the nameserver's address, and the
rules that span keys (contract 2). Each returns the problem an operator reads, or
None (a list, for the rules over a whole fleet); ``narwhal.core.config_parse`` calls them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from urllib.parse import urlsplit

from narwhal.core.config import FleetConfig

_DISCOVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def discover_name_problem(name: str) -> str | None:
    if not _DISCOVER_NAME.fullmatch(name):
        return f"must be letters, digits, '.', '_' or '-' (it starts engine ids), got {name!r}"
    return None


def dns_name_problem(name: str) -> str | None:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return f"must be a DNS name, got the address {name!r} (list it in [[engines]])"
    labels = name.removesuffix(".").split(".")
    if len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return f"must be a DNS name (dot-separated labels of letters, digits, '-'), got {name!r}"
    return None


def nameserver_address(nameserver: str) -> tuple[str, int]:
    """``discovery.nameserver`` as (IP, port): "10.0.0.2", "10.0.0.2:5353", "[fd00::2]:53";
    raises ValueError for anything else."""
    host, port = nameserver, 53
    if nameserver.startswith("["):
        host, sep, rest = nameserver[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(nameserver)
        if rest:
            port = int(rest[1:])
    elif nameserver.count(":") == 1:
        host, port_text = nameserver.split(":")
        port = int(port_text)
    ipaddress.ip_address(host)  # a name would need a resolver of its own
    if not 1 <= port <= 65535:
        raise ValueError(nameserver)
    return host, port


def nameserver_problem(nameserver: str) -> str | None:
    if not nameserver:
        return None
    try:
        nameserver_address(nameserver)
    except ValueError:
        return (
            'must be "" (the system resolver) or an IP address with an optional port '
            f'("10.0.0.2:53", "[fd00::2]:53"), got {nameserver!r}'
        )
    return None


def url_problem(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL, got {url!r}"
    if not parts.hostname:
        return f"must name a host, got {url!r}"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"must be a base URL without path or query, got {url!r}"
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return f"has an invalid port, got {url!r}"
    return None


def zmq_endpoint_problem(endpoint: str) -> str | None:
    """A ZMQ TCP endpoint as the KV-event keys take it: ``tcp://host:port``, the host a
    name, an address or ``*`` (any interface, where it is bound)."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp" or (not parts.hostname and "*" not in parts.netloc):
        return f"must be a tcp://host:port endpoint, got {endpoint!r}"
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None or parts.path or parts.query or parts.fragment:
        return f"must be a tcp://host:port endpoint, got {endpoint!r}"
    return None


def _kv_events_problems(fleet: FleetConfig) -> list[str]:
    problems = []
    if fleet.kv_events.mode == "listen":
        problem = zmq_endpoint_problem(fleet.kv_events.listen)
        if problem:
            problems.append(f"kv_events.listen: {problem}")
    tokenizer = fleet.kv_events.tokenizer
    if tokenizer != "engine" and not tokenizer.endswith(".json"):
        problems.append(
            "kv_events.tokenizer: must be 'engine' (the engine's own /tokenize) or the path "
            f"of a tokenizer.json, got {tokenizer!r}"
        )
    for i, spec in enumerate(fleet.engines):
        problem = spec.kv_events and zmq_endpoint_problem(spec.kv_events)
        if problem:
            problems.append(f"engines[{i}].kv_events: {problem}")
    return problems


def cross_field_problems(fleet: FleetConfig) -> list[str]:
    """Rules that span keys (contract section 2)."""
    problems = _kv_events_problems(fleet)
    if fleet.model and fleet.model in fleet.aliases:
        problems.append(f"aliases.{fleet.model}: the fleet's model is a served name, not an alias")
    limit = fleet.serving.request_timeout_s
    for path, value in (
        ("serving.prefill_timeout_s", fleet.serving.prefill_timeout_s),
        ("engine.first_token_timeout_s", fleet.engine.first_token_timeout_s),
        ("serving.handoff_timeout_s", fleet.serving.handoff_timeout_s),
    ):
        if value > limit:
            problems.append(
                f"{path}: must not exceed serving.request_timeout_s ({value} > {limit})"
            )
    seen: dict[str, int] = {}
    for i, spec in enumerate(fleet.engines):
        if spec.id in seen:
            problems.append(
                f"engines[{i}].id: duplicate id {spec.id!r} (also engines[{seen[spec.id]}])"
            )
        seen.setdefault(spec.id, i)
    names: dict[str, int] = {}
    for i, block in enumerate(fleet.discover):
        if block.name in names:
            also = names[block.name]
            problems.append(
                f"discover[{i}].name: duplicate name {block.name!r} (also discover[{also}])"
            )
        names.setdefault(block.name, i)
    for i, spec in enumerate(fleet.engines):
        name = spec.id.split("/", 1)[0] if spec.id and "/" in spec.id else None
        if name in names:
            problems.append(
                f"engines[{i}].id: {spec.id!r} is in the ids of [[discover]] {name!r} "
                f"(discovered engines are '{name}/<ip>:<port>')"
            )
    if fleet.discover:  # listed or discoverable (contract 2)
        for able, role in (("can_prefill", "prefill"), ("can_decode", "decode")):
            if not any(getattr(e, able) for e in (*fleet.engines, *fleet.discover)):
                problems.append(
                    f"discover: no engine listed or discoverable can {role} "
                    f"(need role '{role}' or 'both' in [[engines]] or [[discover]])"
                )
    else:
        if fleet.engines and not any(e.can_prefill for e in fleet.engines):
            problems.append("engines: no engine can prefill (need role 'prefill' or 'both')")
        if fleet.engines and not any(e.can_decode for e in fleet.engines):
            problems.append("engines: no engine can decode (need role 'decode' or 'both')")
    if fleet.recovery.restart_policy == "whole_wave" and fleet.engine_contract is None:
        problems.append(
            "recovery.restart_policy: 'whole_wave' requires an [engine_contract] section"
        )
    return problems
