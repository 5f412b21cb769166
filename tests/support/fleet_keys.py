"""Every key of the fleet file, read from its structs, for the tests that check the docs
describe each one (``tests/unit/test_docs_keys.py``, ``tests/unit/test_doc_references.py``)."""

from __future__ import annotations

import msgspec

from narwhal.core.config import FleetConfig


def fleet_fields(
    info: msgspec.inspect.Type | None = None, prefix: str = ""
) -> list[tuple[str, msgspec.inspect.Field | None]]:
    """Every leaf key of the fleet file as ``section.key`` (``engines.id`` for a list of
    tables), with its struct field (None for the top level), from the structs themselves,
    so a key added later is checked too."""
    if info is None:
        info = msgspec.inspect.type_info(FleetConfig)
    if isinstance(info, msgspec.inspect.UnionType):  # an optional section
        (info,) = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
    if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        info = info.item_type
    if not isinstance(info, msgspec.inspect.StructType):
        return [(prefix, None)]
    found: list[tuple[str, msgspec.inspect.Field | None]] = []
    for field in info.fields:
        key = f"{prefix}.{field.name}" if prefix else field.name
        below = fleet_fields(field.type, key)
        found += [(k, field if f is None else f) for k, f in below]
    return found


def fleet_keys() -> list[str]:
    return [key for key, _ in fleet_fields()]
