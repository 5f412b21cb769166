"""Models and LoRA adapters (contract 4.7), pure: each engine's model list, the fleet's names
and aliases, candidates by model, adapter affinity, and room per model."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from narwhal.core.config import ConfigError, EngineSpec, PlacementConfig, RecoveryConfig
from narwhal.core.config_parse import parse_config
from narwhal.core.engine_report import EngineReport, parse_report
from narwhal.core.engine_state import EngineState as Engine
from narwhal.core.faults import BreakerClass, ModelNotServed
from narwhal.core.fleet import Fleet
from narwhal.core.flow import Entry, FlowQueue, Priority
from narwhal.core.placement import choose
from narwhal.core.prefix_index import PrefixIndex, prompt_of
from narwhal.core.requests import parse_request
from narwhal.core.served_models import (
    MAX_LIST_BYTES,
    MAX_NAMES,
    MAX_WARNED,
    Catalog,
    Conflict,
    Served,
    conflicts,
    hidden_names,
    model_cards,
    parse_models,
    probe_model,
    read_model_list,
)
from narwhal.fake_engine.lora import AdapterSlots

# vLLM 0.32's /v1/models with --served-model-name tiny --enable-lora --lora-modules a=DIR
VLLM = {
    "object": "list",
    "data": [
        {
            "id": "tiny",
            "object": "model",
            "created": 1,
            "owned_by": "vllm",
            "root": "/models/tiny",
            "parent": None,
            "max_model_len": 512,
            "permission": [{"id": "modelperm-1", "allow_sampling": True}],
        },
        {"id": "a", "object": "model", "root": "/adapters/a", "parent": "tiny"},
    ],
}
LORA_METRICS = """\
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 10.0
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="b"} 20.0
"""


def _served(*names: str) -> Served:
    """``name`` is a base model, ``name:parent`` an adapter."""
    return Served({n.partition(":")[0]: n.partition(":")[2] or None for n in names})


def _fleet(*engines: tuple[str, Served | None]) -> Fleet:
    """Engines of role ``both`` named by their roles' letters: "p" prefill, "d" decode."""
    roles = {"p": "prefill", "d": "decode", "b": "both"}
    specs = tuple(
        EngineSpec(name, f"http://h:{i + 1}", roles[name[0]])  # type: ignore[arg-type]
        for i, (name, _) in enumerate(engines)
    )
    fleet = Fleet(specs, RecoveryConfig())
    fleet.configure_models("tiny", {"tiny-alias": "a"})
    for engine, (_, served) in zip(fleet.engines, engines, strict=True):
        if served is not None:
            fleet.note_models(engine, served)
    return fleet


def test_a_vllm_model_list_names_base_models_and_adapters() -> None:
    served = parse_models(json.dumps(VLLM).encode())
    assert isinstance(served, Served)
    assert served.parents == {"tiny": None, "a": "tiny"}
    assert "a" in served
    assert served.adapter("a")
    assert not served.adapter("tiny")
    assert served.base() == "tiny"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not JSON"),
        (b"[]", "not a model list"),
        (b'{"data": [{"id": 5}]}', "not a model list"),
        (b'{"data": [{"id": "x", "parent": ["tiny"]}]}', "not a model list"),
        (b'{"data": []}', "an empty model list"),
        (b'{"data": [{"id": ""}]}', "a model id of 0 characters"),
        (json.dumps({"data": [{"id": "x" * 300}]}).encode(), "a model id of 300"),
        (b'{"data": [{"id": "x", "parent": ""}]}', "a parent of 0 characters"),
        (b"[" * 100_000 + b"]" * 100_000, "not a model list"),
        (b" " * (2 << 20), "model list over"),
    ],
)
def test_a_malformed_model_list_is_refused_with_its_reason(body: bytes, reason: str) -> None:
    refused = parse_models(body)
    assert isinstance(refused, str)
    assert reason in refused


def test_too_many_names_are_refused() -> None:
    body = msgspec.json.encode({"data": [{"id": f"m{i}"} for i in range(MAX_NAMES + 1)]})
    assert parse_models(body) == f"over {MAX_NAMES} models ({MAX_NAMES + 1})"


@given(st.binary(max_size=512))
def test_any_bytes_give_a_list_or_a_reason(body: bytes) -> None:
    assert isinstance(parse_models(body), Served | str)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


@given(st.dictionaries(st.sampled_from(["data", "object", "x"]), JSON))
def test_any_json_gives_a_list_or_a_reason(doc: dict[str, object]) -> None:
    assert isinstance(parse_models(msgspec.json.encode(doc)), Served | str)


def test_a_refused_list_keeps_the_last_good_one_and_is_counted() -> None:
    fleet = _fleet(("p0", _served("tiny", "a:tiny")), ("d0", None))
    p0 = fleet.engines[0]
    assert not fleet.note_models(p0, "not JSON: ...")
    assert p0.models_refused == 1
    assert "a" in fleet.served_by(p0)
    assert fleet.catalog.resolve("a") == "a"


def test_an_engine_that_never_answered_serves_the_fleets_model() -> None:
    fleet = _fleet(("p0", None), ("d0", None))
    assert fleet.catalog.resolve("tiny") == "tiny"
    assert fleet.catalog.resolve("a") is None
    assert [e.id for e in fleet.placeable("decode", 0.0, "tiny")[0]] == ["d0"]


def test_aliases_resolve_to_the_served_name_and_take_precedence() -> None:
    catalog = Catalog.of([_served("tiny", "a:tiny")], {"tiny-alias": "a", "gone": "b"})
    assert catalog.resolve("tiny-alias") == "a"
    assert catalog.resolve("gone") is None  # an alias of a name nobody serves
    assert catalog.resolve("nope") is None
    assert catalog.adapter("a")
    assert not catalog.adapter("tiny")


def test_only_engines_that_serve_the_name_are_candidates_for_either_leg() -> None:
    fleet = _fleet(
        ("p0", _served("tiny", "a:tiny")),
        ("p1", _served("tiny")),
        ("d0", _served("tiny", "a:tiny")),
        ("d1", _served("tiny")),
    )
    ids = {leg: [e.id for e in fleet.placeable(leg, 0.0, "a")[0]] for leg in ("prefill", "decode")}
    assert ids == {"prefill": ["p0"], "decode": ["d0"]}
    everyone = [e.id for e in fleet.placeable("decode", 0.0, "tiny")[0]]
    assert everyone == ["d0", "d1"]
    assert fleet.placeable("decode", 0.0, "other")[0] == []
    # the list changes: candidates follow at once
    assert fleet.note_models(fleet.engines[3], _served("tiny", "a:tiny"))
    assert [e.id for e in fleet.placeable("decode", 0.0, "a")[0]] == ["d0", "d1"]


def test_the_last_engine_serving_a_name_is_held_in() -> None:
    fleet = _fleet(
        ("p0", _served("tiny", "a:tiny")),
        ("d0", _served("tiny", "a:tiny")),
        ("d1", _served("tiny")),
    )
    d0 = fleet.engines[1]
    for _ in range(RecoveryConfig().eject_after):
        d0.breaker.record_failure(BreakerClass.UNREACHABLE, "refused", 0.0)
    engines, held = fleet.placeable("decode", 1.0, "a")
    assert [e.id for e in engines] == ["d0"]  # the adapter's only consumer
    assert held
    engines, held = fleet.placeable("decode", 1.0, "tiny")
    assert [e.id for e in engines] == ["d1"]
    assert not held


def test_a_request_names_a_served_model_an_alias_or_gets_a_404() -> None:
    catalog = Catalog.of([_served("tiny", "a:tiny")], {"tiny-alias": "a"})

    def parse(model: str) -> object:
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
        return parse_request(
            body, endpoint="/v1/completions", model="tiny", resolve=catalog.resolve
        )

    req = parse("tiny-alias")
    assert req.model == "a"  # type: ignore[attr-defined]
    assert req.body["model"] == "a"  # type: ignore[attr-defined]
    assert b'"model":"a"' in msgspec.json.encode(req.body.raw)  # type: ignore[attr-defined]
    assert parse("tiny").model == "tiny"  # type: ignore[attr-defined]
    with pytest.raises(ModelNotServed, match="model 'b' is not served here"):
        parse("b")
    # its fan-out's sub-requests keep the name
    body = json.dumps({"model": "a", "prompt": ["x", "y"], "max_tokens": 2}).encode()
    fanned = parse_request(body, endpoint="/v1/completions", model="tiny", resolve=catalog.resolve)
    assert {sub.model for _, _, sub in fanned.split()} == {"a"}


def test_the_lora_series_newest_label_set_is_the_one_that_holds() -> None:
    report = parse_report(LORA_METRICS, at=0.0)
    assert report.lora is not None
    assert report.lora.running == {"a"}
    assert report.lora.waiting == {"b"}
    assert report.lora.max_lora == 1
    assert report.lora.loaded == {"a", "b"}
    assert parse_report(LORA_METRICS.replace('max_lora="1"', 'max_lora="x"'), at=0.0).lora is None
    plain = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
    assert parse_report(plain, at=0.0).lora is None


def _lora(
    engine_report_at: float, running: str, max_lora: int = 1, waiting: str = "", queue: int = 0
) -> EngineReport:
    text = (
        f"vllm:num_requests_running 0\nvllm:num_requests_waiting {queue}\n"
        f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
        f'waiting_lora_adapters="{waiting}"}} 1.0\n'
    )
    return parse_report(text, at=engine_report_at)


def test_adapter_affinity_prefers_loaded_then_a_free_slot_then_a_swap() -> None:
    both = _served("tiny", "a:tiny", "b:tiny")
    fleet = _fleet(("d0", both), ("d1", both), ("d2", both))
    d0, d1, d2 = fleet.engines
    d0.report, d1.report, d2.report = _lora(0.0, "b"), _lora(0.0, "a"), _lora(0.0, "", 2)
    config = PlacementConfig(prefix_affinity=False)

    def chosen(adapter: str | None, cfg: PlacementConfig = config) -> str:
        got = choose(fleet.consumers, "decode", cfg, rng=random.Random(0), now=0.0, adapter=adapter)
        assert got is not None
        return f"{got.engine.id}:{got.reason}"

    assert chosen("a") == "d1:adapter"  # loaded there
    assert chosen("b") == "d0:adapter"
    d1.report = _lora(0.0, "c")
    assert chosen("a") == "d2:adapter"  # a free slot beats a swap
    d2.inflight["decode"] = 5  # over the load bound: the others, both a swap
    assert chosen("a").split(":")[0] in {"d0", "d1"}
    off = PlacementConfig(prefix_affinity=False, adapter_affinity=False)
    d2.inflight["decode"] = 0
    d1.report = _lora(0.0, "a")
    assert chosen("a", off).endswith("least_loaded")
    # a stale report says nothing: every engine counts as a free slot
    stale = choose(fleet.consumers, "decode", config, rng=random.Random(0), now=10.0, adapter="a")
    assert stale is not None
    assert stale.reason == "least_loaded"


def test_an_adapters_saturated_engine_is_passed_over_while_another_has_room() -> None:
    both = _served("tiny", "a:tiny", "b:tiny")
    fleet = _fleet(("d0", both), ("d1", both), ("d2", both))
    d0, d1, d2 = fleet.engines
    # d0 runs the adapter, with two requests waiting (saturated at engine_waiting_limit 2)
    d0.report, d1.report, d2.report = _lora(0.0, "a", queue=2), _lora(0.0, "b"), _lora(0.0, "", 2)
    config = PlacementConfig(prefix_affinity=False)
    got = choose(fleet.consumers, "decode", config, rng=random.Random(0), now=0.0, adapter="a")
    assert got is not None
    assert (got.engine.id, got.reason) == ("d2", "adapter")  # a free slot, with room
    d2.report = _lora(0.0, "", 2, queue=2)
    got = choose(fleet.consumers, "decode", config, rng=random.Random(0), now=0.0, adapter="a")
    assert got is not None
    assert (got.engine.id, got.reason) == ("d1", "room")  # a swap, but the one with room
    d1.report = _lora(0.0, "b", queue=3)
    got = choose(fleet.consumers, "decode", config, rng=random.Random(0), now=0.0, adapter="a")
    assert got is not None
    assert (got.engine.id, got.reason) == ("d0", "adapter")  # all saturated: as before


HOT_COLD = _served("tiny", "hot:tiny", "cold:tiny", "z:tiny")
AFFINITY = PlacementConfig(prefix_affinity=False)


def _to(engines: list[Engine], adapter: str) -> str:
    """Where a request for ``adapter`` goes among ``engines``, and why; the engine then
    notes it as placed there, as the request's run does."""
    got = choose(engines, "decode", AFFINITY, rng=random.Random(0), now=0.0, adapter=adapter)
    assert got is not None
    got.engine.adapters.placed(adapter)
    return f"{got.engine.id}:{got.reason}"


def test_an_idle_engine_is_believed_to_hold_the_adapter_it_ran_last() -> None:
    """vllm:lora_requests_info lists nothing on an idle engine, though its one slot still
    holds what ran there: the adapter the router placed there or saw running last."""
    fleet = _fleet(("d0", HOT_COLD), ("d1", HOT_COLD), ("d2", HOT_COLD))
    d0, d1, d2 = fleet.engines
    for engine in fleet.engines:
        engine.note_report(_lora(0.0, ""), engine.scrape_mark())
    assert _to([d0], "hot") == "d0:only"  # the router sends hot to d0; it ends unseen
    d0.note_report(_lora(0.0, ""), d0.scrape_mark())
    assert _to([d0, d1, d2], "hot") == "d0:adapter"  # no load
    assert _to([d0, d1], "cold") == "d1:adapter"  # a free slot, not hot's
    # d1 ran cold, then d1 and d2 ran z: a swap of an idle adapter beats a wait
    d1.note_report(_lora(0.0, "z"), d1.scrape_mark())
    d2.note_report(_lora(0.0, "z"), d2.scrape_mark())
    d1.note_report(_lora(0.0, ""), d1.scrape_mark())
    assert _to([d1, d2], "cold") == "d1:adapter"
    assert _to([d1], "hot") == "d1:only"
    # another router's requests, seen running only: the one seen last holds the slot
    for running in ("cold", "z", ""):
        d0.note_report(_lora(0.0, running), d0.scrape_mark())
    assert _to([d0, d1], "z") == "d0:adapter"
    # a scrape under way while the router sent cold there: its z is older than cold
    mark = d2.scrape_mark()
    assert _to([d2], "cold") == "d2:only"
    d2.note_report(_lora(0.0, "z"), mark)
    d2.note_report(_lora(0.0, ""), d2.scrape_mark())
    assert _to([d0, d2], "cold") == "d2:adapter"
    # an engine that left placement may come back restarted: its slot reads as free
    fleet.forget_cached("d2")
    assert _to([d0, d2], "hot") == "d2:adapter"  # d0 holds z: a swap


RUNS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from(["none", "seen", "late"])),
    max_size=10,
)


def _ran(max_loras: int, runs: list[tuple[str, str]]) -> tuple[Fleet, AdapterSlots]:
    """d0 (``max_loras`` slots) after serving ``runs`` one by one, as the router placed
    them, beside what the fake engine's slots (vLLM's LRU) hold then. Each run's scrape
    saw it running ("seen"), was answered only after the next placement ("late"), or
    missed it; d0 is idle at the end, and its last scrape says so. ``free`` has a slot
    free; every slot of ``busy`` runs z."""
    names = _served("tiny", *(f"{a}:tiny" for a in "abcdz"))
    fleet = _fleet(("d0", names), ("dfree", names), ("dbusy", names))
    d0, free, busy = fleet.engines
    free.note_report(_lora(0.0, ""), free.scrape_mark())
    busy.note_report(_lora(0.0, "z"), busy.scrape_mark())
    slots = AdapterSlots(max_loras)
    late: tuple[tuple[int, int, int], str] | None = None
    for adapter, scrape in runs:
        assert _to([d0], adapter) == "d0:only"
        if late is not None:
            d0.note_report(_lora(0.0, late[1], max_loras), late[0])
            late = None
        ticket = slots.arrive(adapter)
        assert slots.admit(ticket) is not None
        if scrape == "seen":
            d0.note_report(_lora(0.0, slots.labels()[0], max_loras), d0.scrape_mark())
        elif scrape == "late":
            late = (d0.scrape_mark(), slots.labels()[0])
        slots.release(adapter)
    if late is not None:
        d0.note_report(_lora(0.0, late[1], max_loras), late[0])
    d0.note_report(_lora(0.0, "", max_loras), d0.scrape_mark())
    return fleet, slots


@given(st.integers(1, 3), RUNS)
def test_an_idle_engines_slots_hold_what_vllm_kept_there(
    max_loras: int, runs: list[tuple[str, str]]
) -> None:
    """Over any order of requests an engine served one by one, and whichever scrapes saw
    them: a request for an adapter its slots still hold (by vLLM's LRU, the fake engine's
    AdapterSlots) goes back there before an engine with a free slot; one they do not hold
    goes to the free slot when this engine would swap; and an idle engine is never ranked
    behind one whose every slot runs another adapter."""
    for adapter in "abcd":
        fleet, slots = _ran(max_loras, runs)
        d0, free, _ = fleet.engines
        held, room = adapter in slots.loaded, len(slots.loaded) < max_loras
        if held or not room:
            assert _to([d0, free], adapter) == ("d0:adapter" if held else "dfree:adapter")
        fleet, _ = _ran(max_loras, runs)
        d0, _, busy = fleet.engines
        assert _to([d0, busy], adapter) == "d0:adapter"


def test_an_engine_that_owes_a_swap_gets_no_more_of_the_running_adapter() -> None:
    """d0 runs hot and cold waits for its one slot: more hot there would run past cold and
    keep it waiting. Hot goes to any engine that has it, a free slot or an idle adapter to
    swap out, and to d0 only before an engine where it would wait for a slot itself; cold
    joins the load due on d0."""
    fleet = _fleet(("d0", HOT_COLD), ("d1", HOT_COLD))
    d0, d1 = fleet.engines
    d0.note_report(_lora(0.0, "hot", waiting="cold"), d0.scrape_mark())
    for running in ("hot", "", "z"):
        d1.note_report(_lora(0.0, running), d1.scrape_mark())
        d1.note_report(_lora(0.0, ""), d1.scrape_mark())  # idle: holds what ran last
        assert _to([d0, d1], "hot") == "d1:adapter"
    d1.note_report(_lora(0.0, "hot"), d1.scrape_mark())
    assert _to([d0, d1], "hot") == "d1:adapter"  # running there with nothing owed
    d1.note_report(_lora(0.0, "z"), d1.scrape_mark())  # its slot runs z: hot would wait
    assert _to([d0, d1], "hot") == "d0:adapter"
    assert _to([d0, d1], "cold") == "d0:adapter"
    # with a slot to spare, a waiting adapter waits for the batch, not a slot: none owed
    d0.note_report(_lora(0.0, "hot", max_lora=2, waiting="cold"), d0.scrape_mark())
    d1.note_report(_lora(0.0, ""), d1.scrape_mark())
    assert _to([d0, d1], "hot") == "d0:adapter"


ADAPTERS = st.sets(st.sampled_from(["hot", "cold", "z"]))


@given(st.integers(1, 3), ADAPTERS, ADAPTERS, st.lists(st.sampled_from(["hot", "cold", "z"])))
def test_the_running_adapter_leaves_an_engine_that_owes_a_swap_unless_all_others_would(
    max_lora: int, running: set[str], waiting: set[str], ran: list[str]
) -> None:
    """d0 runs hot and cold waits for its one slot. Against any d1 that owes no swap, hot
    goes to d1 exactly when d1 runs or waits on it, or has a slot that no adapter it runs
    or waits on takes (one free or idle): anywhere else it would wait for a slot too."""
    owes = bool(waiting - running) and len(running) >= max_lora
    assume(not owes)
    fleet = _fleet(("d0", HOT_COLD), ("d1", HOT_COLD))
    d0, d1 = fleet.engines
    d0.note_report(_lora(0.0, "hot", waiting="cold"), d0.scrape_mark())
    for adapter in ran:  # what d1 ran before: its idle slots' adapters
        d1.note_report(_lora(0.0, adapter, max_lora), d1.scrape_mark())
    listed = running | waiting
    d1.note_report(_lora(0.0, ",".join(running), max_lora, ",".join(waiting)), d1.scrape_mark())
    to_d1 = "hot" in listed or len(listed) < max_lora
    assert _to([d0, d1], "hot") == ("d1:adapter" if to_d1 else "d0:adapter")


def test_the_prefix_index_keeps_adapters_apart() -> None:
    body = {"prompt": "the same long prompt " * 20}
    base = prompt_of(body, chat=False)
    under_a = prompt_of(body, chat=False, adapter="a")
    under_b = prompt_of(body, chat=False, adapter="b")
    index = PrefixIndex(ttl_s=60.0)
    index.record("e0", under_a.blocks, 0.0)
    assert index.match("e0", under_a.blocks, 1.0) == len(under_a.blocks) > 0
    assert index.match("e0", under_b.blocks, 1.0) == 0
    assert index.match("e0", base.blocks, 1.0) == 0
    ids = {"prompt": list(range(64))}
    assert prompt_of(ids, chat=False, adapter="a").blocks != prompt_of(ids, chat=False).blocks
    # a reply after it goes on on the adapter's chain
    short = prompt_of({"prompt": "hi"}, chat=False, adapter="a")
    assert short.followed_by("x" * 200).blocks != prompt_of({"prompt": "hi"}, chat=False)
    assert (
        short.followed_by("x" * 200).blocks
        == prompt_of({"prompt": "hi" + "x" * 200}, chat=False, adapter="a").blocks
    )


def test_a_saturated_adapters_engines_leave_room_for_another_model() -> None:
    fleet = _fleet(
        ("p0", _served("tiny", "a:tiny")),
        ("p1", _served("tiny")),
        ("d0", _served("tiny", "a:tiny")),
        ("d1", _served("tiny")),
    )
    p0, _, d0, _ = fleet.engines
    for engine in (p0, d0):
        engine.report = EngineReport(at=0.0, running=1, waiting=4, kv_usage=0.5)
    limits = (1.0, 2, 0.95)
    assert fleet.headroom(0.0, *limits, model="a") == 0
    assert fleet.headroom(0.0, *limits, model="tiny") == 2  # p1 and d1 have room
    # a request of "a" between prefill and decode holds room on its consumers: d0 is
    # "tiny"'s too
    with fleet.claim_decode("a"):
        assert fleet.headroom(0.0, *limits, model="tiny") == 1
        assert fleet.headroom(0.0, *limits) == 1


def test_a_model_on_engines_of_its_own_is_not_held_by_anothers_claims() -> None:
    fleet = _fleet(
        ("p0", _served("big")),
        ("p1", _served("tiny")),
        ("d0", _served("big")),
        ("d1", _served("tiny")),
    )
    limits = (1.0, 2, 0.95)
    with fleet.claim_decode("big"), fleet.claim_decode("big"):
        assert fleet.headroom(0.0, *limits, model="big") == 0
        assert fleet.headroom(0.0, *limits, model="tiny") == 2
        assert fleet.headroom(0.0, *limits) == 2  # the fleet's: 4 of room, 2 claimed
    assert fleet.decodes_coming == 0
    assert fleet.headroom(0.0, *limits, model="big") == 2


def test_aliases_in_the_fleet_file_are_checked() -> None:
    base = 'model = "m"\n[[engines]]\nid = "e"\nurl = "http://127.0.0.1:1"\n'
    fleet = parse_config((base + '[aliases]\n"gpt" = "a"\n').encode(), fmt="toml")
    assert fleet.aliases == {"gpt": "a"}
    with pytest.raises(ConfigError) as bad:
        parse_config((base + '[aliases]\nx = "x"\ny = "x"\nz = 3\n').encode(), fmt="toml")
    assert bad.value.problems == [
        "aliases.x: names itself",
        "aliases.y: 'x' is an alias too (an alias names a served model)",
        "aliases.z: must be a served model's name, got int",
    ]
    with pytest.raises(ConfigError) as shadow:
        parse_config((base + '[aliases]\nm = "a"\n').encode(), fmt="toml")
    assert shadow.value.problems == ["aliases.m: the fleet's model is a served name, not an alias"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(Priority)), st.sampled_from(["t0", "t1"]), st.sampled_from("ab")
        ),
        max_size=12,
    ),
    st.sets(st.sampled_from("ab")),
)
def test_the_queue_lets_go_the_first_request_whose_model_has_room(
    offers: list[tuple[Priority, str, str]], roomy: set[str]
) -> None:
    """``next_where`` takes, in the queue's order (class, then tenants in rotation, then
    arrival), the first request whose room there is; the others keep their places."""

    def queue() -> FlowQueue:
        q = FlowQueue(max_queued=64, max_queue_wait_s=10.0)
        for i, (cls, tenant, model) in enumerate(offers):
            q.offer(Entry(i, cls, tenant, 0.0, 10.0, pool=model), 0.0)
        return q

    rank = list(Priority)  # interactive, default, batch

    def place(i: int) -> tuple[int, int]:
        """Its class's rank, then its tenant's place in the class's fresh rotation (the
        order tenants first came in); the sort is stable: arrival within a tenant."""
        cls, tenant, _ = offers[i]
        rotation = list(dict.fromkeys(t for c, t, _ in offers if c == cls))
        return rank.index(cls), rotation.index(tenant)

    scan = sorted(range(len(offers)), key=place)
    first = next((i for i in scan if offers[i][2] in roomy), None)
    picked = queue()
    taken = picked.next_where(0.0, lambda e: e.pool in roomy)
    assert (taken.id if taken else None) == first
    rest = []
    while (entry := picked.next(0.0)) is not None:
        rest.append(entry.id)
    assert sorted(rest) == sorted(i for i in range(len(offers)) if i != first)


def test_a_long_unknown_name_is_shown_cut_in_its_404() -> None:
    body = json.dumps({"model": "x" * 100_000, "prompt": "hi"}).encode()
    with pytest.raises(ModelNotServed) as refused:
        parse_request(body, endpoint="/v1/completions", model="tiny")
    assert str(refused.value) == f"model '{'x' * 256}...' is not served here"


def test_a_name_on_two_bases_means_one_model_and_kv_never_crosses() -> None:
    """An adapter ``a`` of the fleet's model on p0/d0, and another ``a`` (of ``other``) on
    p1/d1: the fleet means the first; p1 and d1 do not take ``a`` and are named."""
    fleet = _fleet(
        ("p0", _served("tiny", "a:tiny")),
        ("p1", _served("other", "a:other")),
        ("d0", _served("tiny", "a:tiny")),
        ("d1", _served("other", "a:other")),
    )
    ids = {leg: [e.id for e in fleet.placeable(leg, 0.0, "a")[0]] for leg in ("prefill", "decode")}
    assert ids == {"prefill": ["p0"], "decode": ["d0"]}
    assert fleet.catalog.conflicts == {"a"}
    assert [e.id for e in fleet.placeable("decode", 0.0, "other")[0]] == ["d1"]
    # the first engine's meaning when none is of the fleet model's lineage
    catalog = Catalog.of([_served("x", "b:x"), _served("y", "b:y")], {}, "tiny")
    assert catalog.served["b"] == "x"
    assert catalog.conflicts == {"b"}
    # a base name another engine lists as an adapter
    mixed = Catalog.of([_served("tiny:other"), _served("tiny")], {}, "tiny")
    assert mixed.served["tiny"] is None
    assert mixed.conflicts == {"tiny"}


# ---- what an engine's list changes, and what the fleet's names show ---------------------


def test_only_a_200_with_a_list_changes_what_an_engine_serves() -> None:
    body = json.dumps(VLLM).encode()
    assert read_model_list(503, body) is None  # no answer: what it served stays
    listed = read_model_list(200, body)
    assert isinstance(listed, Served)
    assert listed.parents == {"tiny": None, "a": "tiny"}
    assert read_model_list(200, b"not json") == parse_models(b"not json")
    assert read_model_list(200, None) == f"over {MAX_LIST_BYTES} bytes"  # cut off: refused


def test_a_probe_asks_for_the_fleets_model_else_a_base_the_engine_serves() -> None:
    assert probe_model(_served("other", "tiny", "a:tiny"), "tiny") == "tiny"
    assert probe_model(_served("a:other", "other"), "tiny") == "other"
    assert probe_model(_served("a:other"), "tiny") == "tiny"  # adapters only


def test_names_listed_otherwise_are_named_with_the_engines_that_do_not_take_them() -> None:
    lists = [
        ("p0", _served("tiny", "a:tiny")),
        ("p1", _served("other", "a:other", "tiny:other")),
        ("d0", _served("tiny", "a:tiny")),
    ]
    catalog = Catalog.of((served for _, served in lists), {}, "tiny")
    found = conflicts(catalog, lists)
    assert found == [Conflict("a", "tiny", ["p1"]), Conflict("tiny", None, ["p1"])]
    assert [c.meaning() for c in found] == ["an adapter of 'tiny'", "a base model"]


def test_a_flood_of_conflicts_is_named_in_part() -> None:
    names = [f"n{i:02}" for i in range(40)]
    lists = [(f"e{i:02}", _served(*(f"{n}:x{i}" for n in names))) for i in range(40)]
    found = conflicts(Catalog.of((s for _, s in lists), {}, "tiny"), lists)
    assert [c.name for c in found] == names[:MAX_WARNED]
    assert all(c.engines == [f"e{i:02}" for i in range(1, MAX_WARNED + 1)] for c in found)


def test_an_alias_that_is_a_served_name_hides_it() -> None:
    catalog = Catalog.of([_served("tiny", "a:tiny", "b:tiny")], {"b": "a", "z": "tiny"})
    assert hidden_names(catalog) == [("b", "a")]


def _ids(view: dict[str, object]) -> list[tuple[object, ...]]:
    data = view["data"]
    assert isinstance(data, list)
    return [(m["id"], m.get("parent"), m.get("root", "-")) for m in data]


def test_the_models_list_names_what_placeable_engines_serve_then_aliases() -> None:
    catalog = Catalog.of([_served("tiny", "a:tiny"), _served("tiny")], {}, "tiny")
    aliases = {"fast": "a", "gone": "b"}
    view = model_cards(catalog, aliases, [_served("tiny", "a:tiny")], "tiny", created=7)
    assert view["object"] == "list"
    assert _ids(view) == [("tiny", None, "-"), ("a", "tiny", "-"), ("fast", "tiny", "a")]
    assert view["data"][0] == {  # type: ignore[index]
        "id": "tiny",
        "object": "model",
        "created": 7,
        "owned_by": "narwhal",
        "parent": None,
    }


def test_the_models_list_leaves_out_names_listed_otherwise_and_hidden_by_an_alias() -> None:
    lists = [_served("tiny", "a:tiny", "b:tiny"), _served("other", "a:other")]
    catalog = Catalog.of(lists, {}, "tiny")
    view = model_cards(catalog, {"b": "a"}, lists, "tiny", created=0)
    assert _ids(view) == [
        ("tiny", None, "-"),
        ("a", "tiny", "-"),
        ("other", None, "-"),
        ("b", "tiny", "a"),  # what requests for it get
    ]


def test_with_no_engine_placeable_the_models_list_is_the_fleets_model() -> None:
    view = model_cards(Catalog({}, {}), {"fast": "tiny"}, [], "tiny", created=0)
    assert _ids(view) == [("tiny", None, "-"), ("fast", None, "tiny")]
