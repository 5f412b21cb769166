"""The fleet file: frozen msgspec structs, and a loader that reports every problem at once.

msgspec stops at the first error, and an operator fixing a fleet file wants the whole list,
so the loader walks the decoded document section by section, converts each key on its own
(the struct annotations carry the rules), collects ``path: rule`` lines, and only builds
the structs once nothing is wrong.
"""

from __future__ import annotations

import contextlib
import json
import re
import ssl
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct

Role: TypeAlias = Literal["prefill", "decode", "both"]
RestartPolicy: TypeAlias = Literal["individual", "whole_wave"]

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonEmptyStr = Annotated[str, Meta(min_length=1)]


class EngineSpec(Struct, frozen=True, forbid_unknown_fields=True):
    id: NonEmptyStr
    url: NonEmptyStr
    role: Role = "both"

    @property
    def can_prefill(self) -> bool:
        return self.role != "decode"

    @property
    def can_decode(self) -> bool:
        return self.role != "prefill"


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


class EngineConfig(Struct, frozen=True, forbid_unknown_fields=True):
    first_token_timeout_s: PositiveFloat = 2.5
    decode_read_timeout_s: NonNegativeFloat = 10.0
    connect_timeout_s: PositiveFloat = 5.0
    health_timeout_s: PositiveFloat = 5.0
    api_key_env: str = ""
    max_connections: PositiveInt = 512
    ca_file: str = ""  # CA bundle for https:// engines; "" = the system trust store
    health_interval_s: PositiveFloat = 5.0  # active /health of every engine, idle or not
    # the producers' lease: vLLM 0.32's kv_lease_duration, VLLM_NIXL_ABORT_REQUEST_TIMEOUT before
    kv_lease_s: PositiveFloat = 480.0
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


class EngineContract(Struct, frozen=True, forbid_unknown_fields=True):
    engine_version: NonEmptyStr
    connector: Literal["NixlConnector"] = "NixlConnector"
    kv_lease_s: PositiveFloat | None = None  # the engines' lease, when the operator pins it


class FleetConfig(Struct, frozen=True, forbid_unknown_fields=True):
    model: NonEmptyStr
    engines: tuple[EngineSpec, ...]
    serving: ServingConfig = ServingConfig()
    engine: EngineConfig = EngineConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    engine_contract: EngineContract | None = None


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
    "serving": ServingConfig,
    "engine": EngineConfig,
    "recovery": RecoveryConfig,
    "engine_contract": EngineContract,
}


def load_config(path: str | Path) -> FleetConfig:
    """Read a TOML or JSON fleet file (by extension); raise ConfigError listing every fault."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read file: {exc.strerror or exc}"]) from None
    return parse_config(raw, fmt=path.suffix.lstrip(".").lower(), source=str(path))


def parse_config(raw: bytes, *, fmt: str, source: str = "<fleet>") -> FleetConfig:
    doc = _decode_document(raw, fmt, source)
    problems: list[str] = []
    fleet = _check_fleet(doc, problems)
    if problems or fleet is None:
        raise ConfigError(source, problems)
    return fleet


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
    values["engines"] = _check_engines(doc.get("engines"), problems)
    for name, cls in _SECTIONS.items():
        if name in doc:
            values[name] = _check_struct(cls, doc[name], name, problems)
    if problems:
        problems.extend(_cross_field_over_valid_keys(doc, problems))  # the same pass (SPEC 2)
        return None
    fleet = msgspec.convert(values, FleetConfig)
    problems.extend(cross_field_problems(fleet))
    problems.extend(_ca_file_problems(fleet.engine.ca_file))
    return fleet


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

    engines = doc.get("engines")
    fleet = FleetConfig(
        model="",
        engines=tuple(valid(EngineSpec, e) for e in (engines if isinstance(engines, list) else ())),
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


def _check_engines(value: object, problems: list[str]) -> tuple[EngineSpec, ...]:
    if value is None:
        problems.append("engines: required, at least one [[engines]] entry")
        return ()
    if not isinstance(value, list):
        problems.append(f"engines: must be an array of tables, got {type(value).__name__}")
        return ()
    if not value:
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


def cross_field_problems(fleet: FleetConfig) -> list[str]:
    """Rules that span keys (SPEC section 2)."""
    problems = []
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
    if fleet.engines and not any(e.can_prefill for e in fleet.engines):
        problems.append("engines: no engine can prefill (need role 'prefill' or 'both')")
    if fleet.engines and not any(e.can_decode for e in fleet.engines):
        problems.append("engines: no engine can decode (need role 'decode' or 'both')")
    if fleet.recovery.restart_policy == "whole_wave" and fleet.engine_contract is None:
        problems.append(
            "recovery.restart_policy: 'whole_wave' requires an [engine_contract] section"
        )
    return problems


def _ca_file_problems(ca_file: str) -> list[str]:
    """``engine.ca_file`` must load as the engine client will load it."""
    if not ca_file:
        return []
    try:
        ssl.create_default_context(cafile=ca_file)
    except OSError as exc:  # ssl.SSLError too: not a PEM bundle, no certificate in it
        reason = exc.strerror if isinstance(exc.strerror, str) else str(exc)
        return [f"engine.ca_file: cannot load CA bundle {ca_file!r}: {reason}"]
    return []
