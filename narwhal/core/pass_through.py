"""``POST /tokenize`` and ``/detokenize``, pure (contract 3): the body an engine gets for a
tokenizer request, the served name whose engines answer it, and which engine takes it.

``narwhal.router.pass_through.PassThrough`` is the shell: it admits the request, sends
the body and journals the answer.
"""

from __future__ import annotations

import random

import msgspec

from narwhal.core.engine_state import LEGS, EngineState
from narwhal.core.faults import BadRequest, ModelNotServed, NoCapacity, Phase
from narwhal.core.fleet import Fleet
from narwhal.core.served_models import Catalog

_decode_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_model = msgspec.json.Decoder(str | None).decode


def pass_model(body: bytes, catalog: Catalog, model: str) -> tuple[bytes, str | None]:
    """A tokenizer request's body for its engine, and the served name whose engines
    answer it: the one it names (an alias rewritten to it), else the fleet's ``model``.
    A name nobody serves is a 404 and a ``model`` that is not a string a 400, as for a
    completion; a body that is not an object is the engine's to refuse."""
    try:
        fields = _decode_raw_fields(body)
    except (msgspec.DecodeError, RecursionError):
        return body, model
    raw = fields.get("model")
    if raw is None:
        return body, model
    try:
        named = _decode_model(raw)
    except msgspec.ValidationError:
        raise BadRequest("model: must be a string", "model") from None
    if named is None:
        return body, model
    served = catalog.resolve(named)
    if served is None:
        raise ModelNotServed.named(named)
    if served == named:
        return body, served
    fields["model"] = msgspec.Raw(msgspec.json.encode(served))  # the rest as it came
    return msgspec.json.encode(fields), served


def pass_engine(
    fleet: Fleet, now: float, rng: random.Random, model: str | None = None
) -> EngineState:
    """Any placeable engine (serving ``model``): every one tokenizes alike (producers
    first, they do the prompt-side work); none placeable is a 503."""
    for leg in LEGS:
        candidates = fleet.placeable(leg, now, model)[0]
        if candidates:
            return rng.choice(candidates)
    raise NoCapacity("no placeable engine", phase=Phase.ADMISSION)
