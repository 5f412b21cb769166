"""A fleet file's bytes into the structs of ``narwhal.core.config``, every problem at once.

msgspec stops at the first error, and an operator fixing a fleet file wants the whole list,
so ``parse_config`` walks the decoded document section by section, converts each key on its
own (the struct annotations carry the rules), collects ``path: rule`` lines, and only builds
the structs once nothing is wrong. The rules an annotation cannot say live in
``narwhal.core.config_rules``.

Pure: the file's bytes come in, and the rules that need the file system (a CA bundle that
loads) come in as a function; ``narwhal.process.config_files`` reads the file and supplies them.
"""

from __future__ import annotations

import contextlib
import json
import re
import tomllib
from collections.abc import Callable
from typing import Any, TypeAlias

import msgspec
from msgspec import Struct

from narwhal.core import config_rules
from narwhal.core.config import (
    AdmissionConfig,
    ClassTargets,
    ConfigError,
    DiscoverBlock,
    DiscoveryConfig,
    EngineConfig,
    EngineContract,
    EngineSpec,
    FleetConfig,
    KvEventsConfig,
    PlacementConfig,
    PredictionConfig,
    RecoveryConfig,
    ServingConfig,
)

_SECTIONS: dict[str, type[Struct]] = {
    "discovery": DiscoveryConfig,
    "serving": ServingConfig,
    "engine": EngineConfig,
    "recovery": RecoveryConfig,
    "placement": PlacementConfig,
    "admission": AdmissionConfig,
    "kv_events": KvEventsConfig,
    "prediction": PredictionConfig,
    "engine_contract": EngineContract,
}


# the rules over a valid fleet that need the file system (``narwhal.process.config_files``: the
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
    nameserver_problem = (
        config_rules.nameserver_problem(nameserver) if isinstance(nameserver, str) else None
    )
    if nameserver_problem:
        problems.append(f"discovery.nameserver: {nameserver_problem}")
    if problems:
        problems.extend(_cross_field_over_valid_keys(doc, problems))  # the same pass (contract 2)
        return None
    fleet = msgspec.convert(values, FleetConfig)
    problems.extend(config_rules.cross_field_problems(fleet))
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
        for problem in config_rules.cross_field_problems(fleet)
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
            url_problem = config_rules.url_problem(spec.url)
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
        for key, rule in (
            ("name", config_rules.discover_name_problem),
            ("dns", config_rules.dns_name_problem),
        ):
            text = item.get(key) if isinstance(item, dict) else None
            problem = rule(text) if isinstance(text, str) and text else None
            if problem:  # told even when another key of the block is wrong
                problems.append(f"discover[{i}].{key}: {problem}")
    return tuple(blocks)


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
        if name in value and name in _TABLES_OF.get(cls, {}):
            names, item = _TABLES_OF[cls][name]
            converted[name] = _check_tables(names, item, value[name], f"{path}.{name}", problems)
        elif name in value:
            converted[name] = _convert_field(cls, name, value[name], f"{path}.{name}", problems)
        elif field.required:
            problems.append(f"{path}.{name}: required key is missing")
    if len(problems) > before:
        return None
    return msgspec.convert(converted, cls)


# fields that are tables of tables, each checked on its own so a problem names its key:
# (the struct, the field) -> (the names a key may take, each table's struct)
_TABLES_OF: dict[type[Struct], dict[str, tuple[tuple[str, ...], type[Struct]]]] = {
    AdmissionConfig: {"classes": (("interactive", "default", "batch"), ClassTargets)},
}


def _check_tables(
    names: tuple[str, ...], item: type[Struct], value: object, path: str, problems: list[str]
) -> dict[str, Any]:
    """A table whose keys are ``names`` and whose values are ``item`` tables."""
    if not isinstance(value, dict):
        problems.append(f"{path}: must be a table/object, got {type(value).__name__}")
        return {}
    kept = {}
    for key, table in value.items():
        if key not in names:
            problems.append(f"{path}.{key}: unknown name (known: {', '.join(names)})")
            continue
        kept[key] = _check_struct(item, table, f"{path}.{key}", problems)
    return kept


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
    if isinstance(info, msgspec.inspect.UnionType):  # an optional key: its value's rule
        kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(kinds) == 1:
            return describe_rule(kinds[0])
    if isinstance(info, msgspec.inspect.StrType):
        return "must be a non-empty string" if info.min_length else "must be a string"
    return f"must be of type {type(info).__name__.removesuffix('Type').lower()}"
