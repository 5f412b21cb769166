"""The names each engine serves, from its ``GET /v1/models``, and what a request's name
resolves to across the fleet, pure.

vLLM lists its served model names (``--served-model-name``: the base model and its
aliases) with ``parent`` null, and each LoRA adapter (``--lora-modules``, or loaded at run
time) with ``parent`` naming the base model. A list is engine input like any other: one
that is not JSON, enormous, or full of odd types is refused with a reason, and the caller
keeps the last good one (an engine's garbage never takes a name away from it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

MAX_LIST_BYTES = 1 << 20  # a list of thousands of adapters fits; more is not a list
MAX_NAMES = 1024  # names one engine may serve
MAX_NAME_CHARS = 256  # a served name is a path or a slug, not a document


class _Card(msgspec.Struct):
    id: str
    parent: str | None = None


class _List(msgspec.Struct):
    data: list[_Card]


_decode = msgspec.json.Decoder(_List).decode


@dataclass(frozen=True, slots=True)
class Served:
    """What one engine serves: each name, and the base model an adapter's name runs on
    (None for a base model)."""

    parents: Mapping[str, str | None]

    def __contains__(self, name: object) -> bool:
        return name in self.parents

    def adapter(self, name: str) -> bool:
        return self.parents.get(name) is not None

    def base(self) -> str | None:
        """Its first base model (the one a probe asks for), or None: adapters only."""
        return next((n for n, parent in self.parents.items() if parent is None), None)

    def view(self) -> list[dict[str, str | None]]:
        """The operator's view (``/narwhal/engines``)."""
        return [{"id": name, "parent": parent} for name, parent in self.parents.items()]


def default_served(model: str) -> Served:
    """An engine that never answered its model list serves the fleet file's ``model``."""
    return Served({model: None})


def parse_models(body: bytes) -> Served | str:
    """An engine's ``/v1/models`` answer, or why it is refused."""
    if len(body) > MAX_LIST_BYTES:
        return f"model list over {MAX_LIST_BYTES} bytes ({len(body)})"
    try:
        listed = _decode(body)
    except msgspec.ValidationError as exc:
        return f"not a model list: {exc}"
    except msgspec.DecodeError as exc:
        return f"not JSON: {exc}"
    except RecursionError:
        return "not a model list: nested too deeply"
    if len(listed.data) > MAX_NAMES:
        return f"over {MAX_NAMES} models ({len(listed.data)})"
    parents: dict[str, str | None] = {}
    for card in listed.data:
        if not card.id or len(card.id) > MAX_NAME_CHARS:
            return f"a model id of {len(card.id)} characters (1..{MAX_NAME_CHARS})"
        if card.parent is not None and not 0 < len(card.parent) <= MAX_NAME_CHARS:
            return f"model {card.id!r}: a parent of {len(card.parent)} characters"
        parents[card.id] = card.parent if card.parent != card.id else None
    if not parents:
        return "an empty model list"
    return Served(parents)


@dataclass(frozen=True, slots=True)
class Catalog:
    """Every name the fleet's engines serve (their last good lists), and the aliases of
    the fleet file: what a request's ``model`` resolves to, once per request.

    A name means one model: a base model, or an adapter of one base. Engines that list a
    name with another parent (an adapter ``sql`` on two bases, a base name another engine
    lists as an adapter) serve something else under it, and KV must never cross between
    them: the name's meaning is the one the fleet's ``model`` lineage gives (the base
    itself, or an adapter of it), else the first engine's, and ``conflicts`` names the
    names some engine lists otherwise (those engines do not take them)."""

    served: Mapping[str, str | None]  # name -> its parent (None: a base model)
    aliases: Mapping[str, str]
    conflicts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, lists: Iterable[Served], aliases: Mapping[str, str], model: str = "") -> Catalog:
        listed = list(lists)
        served: dict[str, str | None] = {}
        for one in listed:
            for name, parent in one.parents.items():
                if name not in served:
                    served[name] = parent
                elif not _ours(name, served[name], model) and _ours(name, parent, model):
                    served[name] = parent  # the fleet model's lineage wins
        conflicts = frozenset(
            name for one in listed for name, parent in one.parents.items() if served[name] != parent
        )
        return cls(served, aliases, conflicts)

    def resolve(self, name: str) -> str | None:
        """The served name a request's ``model`` stands for, or None: nobody serves it."""
        target = self.aliases.get(name, name)
        return target if target in self.served else None

    def adapter(self, name: str) -> bool:
        return self.served.get(name) is not None

    def means(self, served: Served, name: str) -> bool:
        """Whether an engine's list serves ``name`` as the fleet means it (same parent)."""
        return name in served.parents and served.parents[name] == self.served.get(name)


def _ours(name: str, parent: str | None, model: str) -> bool:
    """In the fleet model's lineage: the model itself as a base, or an adapter of it."""
    return (name == model and parent is None) or (parent is not None and parent == model)


def read_model_list(status: int, body: bytes | None) -> Served | str | None:
    """An engine's answer to ``GET /v1/models`` (``body`` None: it was over
    ``MAX_LIST_BYTES``): what it serves, why its list is refused, or None when it did not
    answer with a list (what it served stays)."""
    if status != 200:
        return None
    return parse_models(body) if body is not None else f"over {MAX_LIST_BYTES} bytes"


def probe_model(served: Served, model: str) -> str:
    """The name a probe of an engine serving ``served`` asks for: a base model it serves
    (the fleet's ``model`` when it serves that), so the peer it crosses with must serve it
    too."""
    return model if model in served else served.base() or model


MAX_WARNED = 16  # names (and engines per name) a warning lists: a list, not a flood


@dataclass(frozen=True, slots=True)
class Conflict:
    """A served name some engines list otherwise than the fleet means it (contract 4.7):
    those engines do not take it."""

    name: str
    parent: str | None  # the fleet's meaning: an adapter of this base, or (None) a base model
    engines: list[str]  # the engines that list it otherwise

    def meaning(self) -> str:
        return f"an adapter of {self.parent!r}" if self.parent else "a base model"


def conflicts(catalog: Catalog, lists: Iterable[tuple[str, Served]]) -> list[Conflict]:
    """The catalog's conflicting names, in order, each with the engines (id, list) that
    list it otherwise; at most ``MAX_WARNED`` of each."""
    listed = list(lists)
    found = []
    for name in sorted(catalog.conflicts)[:MAX_WARNED]:
        others = [
            engine
            for engine, served in listed
            if name in served and not catalog.means(served, name)
        ]
        found.append(Conflict(name, catalog.served[name], others[:MAX_WARNED]))
    return found


def hidden_names(catalog: Catalog) -> list[tuple[str, str]]:
    """Aliases that are also served names, in order, each with the name requests for it go
    to instead (the alias wins); at most ``MAX_WARNED``."""
    hiding = sorted(set(catalog.aliases) & set(catalog.served))[:MAX_WARNED]
    return [(alias, catalog.aliases[alias]) for alias in hiding]


def model_cards(
    catalog: Catalog,
    aliases: Mapping[str, str],
    placeable: Iterable[Served],
    model: str,
    created: int,
) -> dict[str, object]:
    """``GET /v1/models`` (contract 4.7): every name the ``placeable`` engines' lists serve
    as the fleet means it, adapters with their ``parent``, then each alias of one of them as
    its own entry (``root``: the name it stands for). A name an alias hides is listed as
    the alias. No name at all (no engine placeable): the fleet's ``model``, as before any
    engine answered."""
    names: dict[str, str | None] = {}
    for served in placeable:
        for name in served.parents:
            if name not in aliases and catalog.means(served, name):
                names[name] = catalog.served[name]
    if not names:
        names[model] = None

    def card(name: str, **more: str | None) -> dict[str, object]:
        fields = {"id": name, "object": "model", "created": created, "owned_by": "narwhal"}
        return {**fields, **more}

    data = [card(name, parent=parent) for name, parent in names.items()]
    data += [
        card(alias, root=target, parent=names[target])
        for alias, target in aliases.items()
        if target in names
    ]
    return {"object": "list", "data": data}
