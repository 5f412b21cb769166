"""The fleet file: frozen msgspec structs, and the checks that report every problem at once.

msgspec stops at the first error, and an operator fixing a fleet file wants the whole list,
so ``parse_config`` walks the decoded document section by section, converts each key on its
own (the struct annotations carry the rules), collects ``path: rule`` lines, and only builds
the structs once nothing is wrong.

Pure: the file's bytes come in, and the rules that need the file system (a CA bundle that
loads) come in as a function; ``narwhal.config_files`` reads the file and supplies them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import tomllib
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeAlias
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct

Role: TypeAlias = Literal["prefill", "decode", "both"]
RestartPolicy: TypeAlias = Literal["individual", "whole_wave"]

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonEmptyStr = Annotated[str, Meta(min_length=1)]


class _Roles:
    """What an engine of ``role`` may serve (a mixin of the structs with a ``role``)."""

    __slots__ = ()
    role: Role

    @property
    def can_prefill(self) -> bool:
        return self.role != "decode"

    @property
    def can_decode(self) -> bool:
        return self.role != "prefill"


class EngineSpec(Struct, _Roles, frozen=True, forbid_unknown_fields=True):
    id: NonEmptyStr
    url: NonEmptyStr
    role: Role = "both"
    # its KV-event publisher ("tcp://host:port"); "" = from the engine or [kv_events]
    kv_events: str = ""


class ServingConfig(Struct, frozen=True, forbid_unknown_fields=True):
    request_timeout_s: PositiveFloat = 600.0
    prefill_timeout_s: PositiveFloat = 120.0
    handoff_timeout_s: NonNegativeFloat = 0.0
    max_attempts: Annotated[int, Meta(ge=1, le=5)] = 1
    retry_budget: NonNegativeFloat = 10.0
    retry_replenish: NonNegativeFloat = 0.1
    retry_backoff_s: NonNegativeFloat = 0.05
    max_inflight: PositiveInt = 1024
    max_request_bytes: PositiveInt = 4 * 1024 * 1024
    api_keys_env: str = ""
    admin_keys_env: str = ""  # admin keys for /narwhal/*; "" = loopback peers only
    graceful_timeout_s: NonNegativeFloat = 30.0
    max_fanout: PositiveInt = 16  # most engine requests one client request fans out to
    client_idle_timeout_s: PositiveFloat = 20.0  # above aiohttp's 15 s and httpx's 5 s idle expiry
    client_body_timeout_s: PositiveFloat = 30.0


LEASE_SLACK = 0.05  # of the KV lease, kept unused at its end
DEFAULT_KV_LEASE_S = 30.0  # vLLM 0.32's kv_lease_duration default (SPEC 2)


class EngineConfig(Struct, frozen=True, forbid_unknown_fields=True):
    first_token_timeout_s: PositiveFloat = 2.5
    decode_read_timeout_s: NonNegativeFloat = 10.0
    connect_timeout_s: PositiveFloat = 5.0
    health_timeout_s: PositiveFloat = 5.0
    api_key_env: str = ""
    max_connections: PositiveInt = 512
    ca_file: str = ""  # CA bundle for https:// engines; "" = the system trust store
    health_interval_s: PositiveFloat = 5.0  # active /health of every engine, idle or not
    # the producers' lease: vLLM 0.32's kv_lease_duration (30 s unless the engines set it;
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, before). A default above the engines' would
    # send descriptors whose blocks are already freed: a wrong answer with no error
    kv_lease_s: PositiveFloat = DEFAULT_KV_LEASE_S
    reclaim_orphans: bool = True

    @property
    def lease_limit_s(self) -> float:
        """The oldest a KV descriptor may be when it is sent to a consumer (SPEC 5).

        What counts is the age at the send: once a vLLM 0.32 consumer holds the request,
        its heartbeats extend the producer's lease until it reads the blocks. The slack
        covers the producer's clock starting after ours and the way to the consumer."""
        return self.kv_lease_s * (1 - LEASE_SLACK)


class RecoveryConfig(Struct, frozen=True, forbid_unknown_fields=True):
    eject_after: PositiveInt = 3
    failure_quarantine_s: NonNegativeFloat = 0.0
    readmit_interval_s: PositiveFloat = 10.0
    restart_policy: RestartPolicy = "individual"
    # > 0: a stream that fails after output continues on another consumer (SPEC 6.4), at
    # most this many times per request
    resume_streams: NonNegativeInt = 0


class EngineContract(Struct, frozen=True, forbid_unknown_fields=True):
    engine_version: NonEmptyStr
    connector: Literal["NixlConnector"] = "NixlConnector"
    kv_lease_s: PositiveFloat | None = None  # the engines' lease, when the operator pins it


class DiscoverBlock(Struct, _Roles, frozen=True, forbid_unknown_fields=True):
    """Engines from DNS: every A/AAAA record of ``dns`` is one engine at ``port``."""

    name: NonEmptyStr  # discovered engine ids are "<name>/<ip>:<port>"
    dns: NonEmptyStr
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    role: Role = "both"
    scheme: Literal["http", "https"] = "http"


class PlacementConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Which engine takes a leg (SPEC 4.4)."""

    policy: Literal["least_loaded", "round_robin"] = "least_loaded"
    metrics_interval_s: NonNegativeFloat = 1.0  # scrape of each engine's /metrics; 0 = off
    prefix_affinity: bool = True  # producers chosen by prompt prefix, bounded by load
    # a producer may carry this times the mean load before its keys spill to the next
    affinity_load_factor: Annotated[float, Meta(ge=1.0)] = 1.25
    # > 0: conditional disaggregation (decode first): a prompt whose part not cached on its
    # consumer is estimated below this many tokens is prefilled by the consumer itself
    local_prefill_tokens: NonNegativeInt = 0
    # also prefill on the consumer when every producer is saturated and the consumer is not
    local_prefill_when_busy: bool = False
    # how long the router trusts that an engine still caches a prefix it sent there
    prefix_index_ttl_s: PositiveFloat = 120.0
    # a request for a LoRA adapter prefers engines that have it loaded, then engines with a
    # free adapter slot (their vllm:lora_requests_info), before the load and prefix rules
    adapter_affinity: bool = True


Priority: TypeAlias = Literal["interactive", "default", "batch"]


class AdmissionConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Flow control (SPEC 4.5): what the router holds while the fleet is saturated."""

    queue: bool = True  # false: dispatch at once, the engines' queues take the burst
    max_queued: PositiveInt = 4096
    max_queue_wait_s: NonNegativeFloat = 30.0  # never past the request's deadline
    # an engine is saturated when its scraped waiting queue, plus this router's legs sent to
    # it since that scrape and not yet started, reaches this ...
    engine_waiting_limit: PositiveInt = 2
    kv_usage_limit: Annotated[float, Meta(gt=0, le=1)] = 0.95  # ... or, for a consumer, this
    priority_from: Literal["header", "key"] = "header"
    default_class: Priority = "default"


class KvEventsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The precise prefix index: what each engine caches, from its own KV events."""

    # "subscribe": connect to each engine's publisher; "listen": bind ``listen``, engines'
    # publishers connect to it; "off": the approximate index only
    mode: Literal["off", "subscribe", "listen"] = "off"
    port: Annotated[int, Meta(ge=1, le=65535)] = 5557  # an engine's publisher, by default
    listen: str = "tcp://127.0.0.1:5557"
    replay: bool = True  # ask an engine's replay endpoint for the batches a gap lost
    # "engine": a request's token ids from the engine's own POST /tokenize
    tokenizer: NonEmptyStr = "engine"


class DiscoveryConfig(Struct, frozen=True, forbid_unknown_fields=True):
    interval_s: PositiveFloat = 5.0  # re-resolve period
    nameserver: str = ""  # "ip" or "ip:port" ("[v6]:port"); "" = the system resolver


class FleetConfig(Struct, frozen=True, forbid_unknown_fields=True):
    model: NonEmptyStr
    engines: tuple[EngineSpec, ...] = ()  # may be empty when [[discover]] finds engines
    discover: tuple[DiscoverBlock, ...] = ()
    discovery: DiscoveryConfig = DiscoveryConfig()
    serving: ServingConfig = ServingConfig()
    engine: EngineConfig = EngineConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    placement: PlacementConfig = PlacementConfig()
    admission: AdmissionConfig = AdmissionConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    engine_contract: EngineContract | None = None
    # a client's model name -> the served name it stands for (a base model or an adapter)
    aliases: dict[str, str] = {}


class ConfigError(Exception):
    """A fleet file that cannot be used; ``problems`` holds one ``path: rule`` per fault."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"invalid fleet file {self.source}: {len(self.problems)} problem(s)"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


_SECTIONS: dict[str, type[Struct]] = {
    "discovery": DiscoveryConfig,
    "serving": ServingConfig,
    "engine": EngineConfig,
    "recovery": RecoveryConfig,
    "placement": PlacementConfig,
    "admission": AdmissionConfig,
    "kv_events": KvEventsConfig,
    "engine_contract": EngineContract,
}


# the rules over a valid fleet that need the file system (``narwhal.config_files``: the
# CA bundle loads); their problems come last, after the cross-field ones
FileRules: TypeAlias = Callable[[FleetConfig], list[str]]


def _no_file_rules(_: FleetConfig) -> list[str]:
    return []


def parse_config(
    raw: bytes, *, fmt: str, source: str = "<fleet>", file_rules: FileRules = _no_file_rules
) -> FleetConfig:
    """A fleet file's bytes (``fmt``: "toml" or "json") as a FleetConfig; ConfigError
    listing every fault. ``file_rules`` runs only over a file whose keys are all valid."""
    doc = _decode_document(raw, fmt, source)
    problems: list[str] = []
    fleet = _check_fleet(doc, problems)
    if fleet is not None:  # every key valid; cross-field problems or not
        problems.extend(file_rules(fleet))
    if problems or fleet is None:
        raise ConfigError(source, problems)
    return fleet


def document_sets_key(raw: bytes, fmt: str, section: str, key: str) -> bool:
    """Whether a fleet file's bytes set ``[section] key`` themselves (False: the value in
    force is the default). For reports such as ``narwhal check``; the file is not validated
    here (``parse_config`` does that), and one that does not decode sets nothing."""
    try:
        doc = _decode_document(raw, fmt, "<fleet>")
    except ConfigError:
        return False
    table = doc.get(section)
    return isinstance(table, dict) and key in table


def _decode_document(raw: bytes, fmt: str, source: str) -> dict[str, Any]:
    try:
        if fmt == "toml":
            doc: object = tomllib.loads(raw.decode("utf-8"))
        elif fmt == "json":
            doc = json.loads(raw)
        else:
            raise ConfigError(source, [f"file extension: must be .toml or .json, got {fmt!r}"])
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(source, [f"syntax: {exc}"]) from None
    if not isinstance(doc, dict):
        raise ConfigError(source, ["(top level): must be a table/object"])
    return doc


def _check_fleet(doc: dict[str, Any], problems: list[str]) -> FleetConfig | None:
    known = {f.name for f in msgspec.structs.fields(FleetConfig)}
    for key in doc:
        if key not in known:
            problems.append(f"{key}: unknown key (known: {', '.join(sorted(known))})")
    values: dict[str, Any] = {}
    if "model" not in doc:
        problems.append("model: required key is missing")
    else:
        values["model"] = _convert_field(FleetConfig, "model", doc["model"], "model", problems)
    discovers = doc.get("discover") not in (None, [])  # a wrong one is its own problem
    if "aliases" in doc:
        values["aliases"] = _check_aliases(doc["aliases"], problems)
    values["engines"] = _check_engines(doc.get("engines"), problems, discovers=discovers)
    values["discover"] = _check_discover(doc.get("discover"), problems)
    for name, cls in _SECTIONS.items():
        if name in doc:
            values[name] = _check_struct(cls, doc[name], name, problems)
    nameserver = (
        doc["discovery"].get("nameserver") if isinstance(doc.get("discovery"), dict) else ""
    )
    nameserver_problem = _nameserver_problem(nameserver) if isinstance(nameserver, str) else None
    if nameserver_problem:
        problems.append(f"discovery.nameserver: {nameserver_problem}")
    if problems:
        problems.extend(_cross_field_over_valid_keys(doc, problems))  # the same pass (SPEC 2)
        return None
    fleet = msgspec.convert(values, FleetConfig)
    problems.extend(cross_field_problems(fleet))
    return fleet


MAX_ALIASES = 1024  # a table of names, not a database: it is copied into every answer


def _check_aliases(value: object, problems: list[str]) -> dict[str, str]:
    """``[aliases]``: non-empty names to non-empty names, none an alias of an alias (one
    lookup resolves a name), none naming itself."""
    if not isinstance(value, dict):
        problems.append(f"aliases: must be a table of names, got {type(value).__name__}")
        return {}
    if len(value) > MAX_ALIASES:
        problems.append(f"aliases: at most {MAX_ALIASES} names, got {len(value)}")
        return {}
    kept: dict[str, str] = {}
    for name, target in value.items():
        if not isinstance(target, str) or not target:
            got = type(target).__name__ if not isinstance(target, str) else "an empty string"
            problems.append(f"aliases.{name}: must be a served model's name, got {got}")
        elif not name:
            problems.append("aliases: an alias must not be empty")
        elif target == name:
            problems.append(f"aliases.{name}: names itself")
        elif target in value:
            problems.append(
                f"aliases.{name}: {target!r} is an alias too (an alias names a served model)"
            )
        else:
            kept[name] = target
    return kept


def _cross_field_over_valid_keys(doc: dict[str, Any], found: list[str]) -> list[str]:
    """The cross-field problems of a file that has field problems too: the rules run over
    its valid keys, each invalid or missing one standing at its default (a required one at
    None, an engine that is not a table as an empty one, so engine indices stay), and a
    problem that names a key or section with a problem of its own is left out: it may not
    be one once that key is fixed."""

    def valid(cls: type[Struct], value: object) -> Any:
        fields = msgspec.structs.fields(cls)
        kept = {f.name: None for f in fields if f.required}
        types = {f.name: f.type for f in fields}
        for key, item in value.items() if isinstance(value, dict) else ():
            with contextlib.suppress(msgspec.ValidationError, KeyError):
                kept[key] = msgspec.convert(item, types[key])
        return cls(**kept)  # a Struct's __init__ checks no constraint: None may stand

    engines, discover = doc.get("engines"), doc.get("discover")
    fleet = FleetConfig(
        model="",
        engines=tuple(valid(EngineSpec, e) for e in (engines if isinstance(engines, list) else ())),
        discover=tuple(
            valid(DiscoverBlock, d) for d in (discover if isinstance(discover, list) else ())
        ),
        **{name: valid(cls, doc[name]) for name, cls in _SECTIONS.items() if name in doc},
    )
    bad = [problem.split(": ", 1)[0] for problem in found]
    return [
        problem
        for problem in cross_field_problems(fleet)
        if not any(re.search(_names(path), problem) for path in bad)
    ]


def _names(path: str) -> str:
    """A pattern for ``path`` named in a problem: a key anywhere (``engines[1].id``), a
    section as the head of a path or of a problem (``engine.x``, ``engines:``)."""
    after = r"(?!\w)" if "." in path or "[" in path else r"(?=[.\[:])"
    return r"(?<![\w.\[])" + re.escape(path) + after


def _check_engines(
    value: object, problems: list[str], *, discovers: bool = False
) -> tuple[EngineSpec, ...]:
    """``[[engines]]``: at least one, unless ``[[discover]]`` blocks find them."""
    if value is None:
        if not discovers:
            problems.append("engines: required, at least one [[engines]] entry")
        return ()
    if not isinstance(value, list):
        problems.append(f"engines: must be an array of tables, got {type(value).__name__}")
        return ()
    if not value and not discovers:
        problems.append("engines: must list at least one engine")
    engines: list[EngineSpec] = []
    for i, item in enumerate(value):
        spec = _check_struct(EngineSpec, item, f"engines[{i}]", problems)
        if isinstance(spec, EngineSpec):
            url_problem = _url_problem(spec.url)
            if url_problem:
                problems.append(f"engines[{i}].url: {url_problem}")
            engines.append(spec)
    return tuple(engines)


def _check_discover(value: object, problems: list[str]) -> tuple[DiscoverBlock, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        problems.append(f"discover: must be an array of tables, got {type(value).__name__}")
        return ()
    blocks: list[DiscoverBlock] = []
    for i, item in enumerate(value):
        block = _check_struct(DiscoverBlock, item, f"discover[{i}]", problems)
        if isinstance(block, DiscoverBlock):
            blocks.append(block)
        for key, rule in (("name", _discover_name_problem), ("dns", _dns_name_problem)):
            text = item.get(key) if isinstance(item, dict) else None
            problem = rule(text) if isinstance(text, str) and text else None
            if problem:  # told even when another key of the block is wrong
                problems.append(f"discover[{i}].{key}: {problem}")
    return tuple(blocks)


_DISCOVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def _discover_name_problem(name: str) -> str | None:
    if not _DISCOVER_NAME.fullmatch(name):
        return f"must be letters, digits, '.', '_' or '-' (it starts engine ids), got {name!r}"
    return None


def _dns_name_problem(name: str) -> str | None:
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


def _nameserver_problem(nameserver: str) -> str | None:
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


def _check_struct(cls: type[Struct], value: object, path: str, problems: list[str]) -> Any:
    if not isinstance(value, dict):
        problems.append(f"{path}: must be a table/object, got {type(value).__name__}")
        return None
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    before = len(problems)
    for key in value:
        if key not in fields:
            problems.append(
                f"{path}.{key}: unknown key in [{path}] (known: {', '.join(sorted(fields))})"
            )
    converted = {}
    for name, field in fields.items():
        if name in value:
            converted[name] = _convert_field(cls, name, value[name], f"{path}.{name}", problems)
        elif field.required:
            problems.append(f"{path}.{name}: required key is missing")
    if len(problems) > before:
        return None
    return msgspec.convert(converted, cls)


def _convert_field(
    cls: type[Struct], name: str, value: object, path: str, problems: list[str]
) -> Any:
    field_type = next(f.type for f in msgspec.structs.fields(cls) if f.name == name)
    try:
        return msgspec.convert(value, field_type)
    except msgspec.ValidationError:
        struct_info = msgspec.inspect.type_info(cls)
        assert isinstance(struct_info, msgspec.inspect.StructType)
        info = next(f.type for f in struct_info.fields if f.name == name)
        problems.append(f"{path}: {describe_rule(info)} (got {value!r})")
        return None


def describe_rule(info: msgspec.inspect.Type) -> str:
    """Turn a msgspec type description into the rule an operator reads."""
    if isinstance(info, msgspec.inspect.LiteralType):
        return "must be one of " + ", ".join(repr(v) for v in info.values)
    if isinstance(info, msgspec.inspect.FloatType | msgspec.inspect.IntType):
        kind = "an integer" if isinstance(info, msgspec.inspect.IntType) else "a number"
        bounds = [
            f"{op} {bound}"
            for op, bound in ((">", info.gt), (">=", info.ge), ("<", info.lt), ("<=", info.le))
            if bound is not None
        ]
        return f"must be {kind}" + (f" {' and '.join(bounds)}" if bounds else "")
    if isinstance(info, msgspec.inspect.StrType):
        return "must be a non-empty string" if info.min_length else "must be a string"
    return f"must be of type {type(info).__name__.removesuffix('Type').lower()}"


def _url_problem(url: str) -> str | None:
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
    """Rules that span keys (SPEC section 2)."""
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
    if fleet.discover:  # listed or discoverable (SPEC 2)
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
