"""``/tokenize`` and ``/detokenize`` (contract 3), sans IO: the body an engine gets, the
served name whose engines answer, and which engine takes the request."""

from __future__ import annotations

import random

import pytest

from narwhal.core.faults import BadRequest, ModelNotServed, NoCapacity, Phase
from narwhal.core.pass_through import pass_engine, pass_model
from narwhal.core.served_models import Catalog
from tests.support.pure_fleet import MODEL, eject, pure_fleet, serving

CATALOG = Catalog.of([serving("tiny", "sql:tiny")], {"chat": "sql"}, MODEL)


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "hi"}',
        b'{"model": null, "prompt": "hi"}',
        b"not json",  # the engine's to refuse
        b'["a list"]',
    ],
)
def test_a_body_naming_no_model_goes_as_it_came_to_the_fleets_model(body: bytes) -> None:
    assert pass_model(body, CATALOG, MODEL) == (body, MODEL)


def test_a_served_name_goes_as_it_came() -> None:
    body = b'{"model": "sql", "prompt": "hi"}'
    assert pass_model(body, CATALOG, MODEL) == (body, "sql")


def test_an_alias_is_rewritten_to_its_served_name_and_the_rest_comes_as_it_came() -> None:
    body = b'{"prompt":"h\\u00e9",  "model":"chat","add_special_tokens":false}'
    assert pass_model(body, CATALOG, MODEL) == (
        b'{"prompt":"h\\u00e9","model":"sql","add_special_tokens":false}',
        "sql",
    )


def test_a_name_nobody_serves_is_a_404_and_a_model_not_a_string_a_400() -> None:
    with pytest.raises(ModelNotServed) as unknown:
        pass_model(b'{"model": "nope"}', CATALOG, MODEL)
    assert unknown.value.status == 404
    assert unknown.value.message == "model 'nope' is not served here"
    with pytest.raises(BadRequest) as not_a_string:
        pass_model(b'{"model": 5}', CATALOG, MODEL)
    assert (not_a_string.value.status, not_a_string.value.param) == (400, "model")
    assert not_a_string.value.message == "model: must be a string"


def test_a_producer_answers_first_then_a_consumer() -> None:
    fleet = pure_fleet({"d0": "decode", "p0": "prefill", "p1": "prefill"})
    rng = random.Random(7)
    taken = {pass_engine(fleet, 0.0, rng).id for _ in range(40)}
    assert taken == {"p0", "p1"}  # every one tokenizes alike: any producer
    for producer in fleet.producers:
        eject(producer)
    assert pass_engine(fleet, 0.0, rng).id in {"p0", "p1"}  # held in: the last producers
    fleet = pure_fleet({"d0": "decode"})
    assert pass_engine(fleet, 0.0, rng).id == "d0"


def test_only_an_engine_serving_the_name_answers_and_none_is_a_503() -> None:
    fleet = pure_fleet(
        {"p0": ("prefill", serving("tiny")), "d0": ("decode", serving("tiny", "sql:tiny"))}
    )
    rng = random.Random(7)
    assert pass_engine(fleet, 0.0, rng, "sql").id == "d0"
    with pytest.raises(NoCapacity) as none:
        pass_engine(fleet, 0.0, rng, "other")
    assert (none.value.status, none.value.message) == (503, "no placeable engine")
    assert none.value.phase is Phase.ADMISSION
