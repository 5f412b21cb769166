"""The fake engine's models and LoRA adapters without sockets: the served names, the adapter
slots (loads, swaps, the queue), ``vllm:lora_requests_info``, generation and the prefix
cache per adapter, KV events' adapter, and the side channel's refusal across models."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import trio
from prometheus_client.utils import floatToGoString

from narwhal.fake_engine import asks, cost, lora
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.kv_channel import KVStore, PullRequest
from narwhal.fake_engine.kv_events import BlockStored, EventStream
from narwhal.fake_engine.samples import samples
from narwhal.process.cli import build_parser

# ---- the served names --------------------------------------------------------------------


def test_the_first_name_alone_is_the_base_others_alone_its_aliases_and_adapters_count_from_1() -> (
    None
):
    catalog = lora.Catalog(["tiny", "sql:tiny", "also-tiny", "chat:also-tiny"])
    assert catalog.base == "tiny"
    assert catalog.aliases == ("tiny", "also-tiny")
    assert catalog.adapters == ("sql", "chat")
    assert [catalog.models[n].lora_id for n in ("tiny", "sql", "also-tiny", "chat")] == [0, 1, 0, 2]
    assert catalog.models["chat"].parent == "also-tiny"
    assert [catalog.adapter(n) for n in ("tiny", "also-tiny", "sql")] == [None, None, "sql"]
    # KV is valid across the names of one set of weights, never across adapters
    assert [catalog.weights(n) for n in ("tiny", "also-tiny", "sql")] == ["tiny", "tiny", "sql"]
    assert catalog.serves("sql")
    assert not catalog.serves("nope")
    assert not catalog.serves(None)
    assert catalog.not_found("nope") == (
        "The model `nope` does not exist. Valid aliases: tiny, also-tiny."
    )


@pytest.mark.parametrize(
    "entries",
    [["sql:tiny"], ["tiny", "tiny"], ["tiny", "sql:nope"], ["tiny", "sql:"], ["", "tiny"]],
)
def test_a_catalog_without_a_base_or_with_a_bad_entry_is_refused(entries: list[str]) -> None:
    with pytest.raises(ValueError, match=r"model|parent"):
        lora.Catalog(entries)


def test_the_flags_set_the_config_and_a_bad_models_list_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["fake-engine", "--port", "0", "--models", "tiny, sql:tiny,chat:tiny", "--max-loras", "2"]
    )
    assert lora.config_fields(args) == {
        "models": ("tiny", "sql:tiny", "chat:tiny"),
        "max_loras": 2,
        "lora_swap_ms": None,
    }
    args = parser.parse_args(["fake-engine", "--port", "0"])  # --model alone, as before
    assert lora.config_fields(args) == {"models": (), "max_loras": 1, "lora_swap_ms": None}
    for bad in (["--models", "sql:tiny"], ["--max-loras", "0"], ["--lora-swap-ms", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["fake-engine", "--port", "0", *bad])
    assert "base model" in capsys.readouterr().err


def test_a_swap_is_instant_by_default_and_costs_time_with_the_cost_model() -> None:
    assert FakeEngineConfig().lora_swap_s == 0.0
    assert FakeEngineConfig(slots=4).lora_swap_s == lora.DEFAULT_COST_SWAP_MS / 1000
    assert FakeEngineConfig(slots=4, lora_swap_ms=0).lora_swap_s == 0.0
    assert FakeEngineConfig(lora_swap_ms=250).lora_swap_s == 0.25


# ---- adapter slots -----------------------------------------------------------------------


def _run(slots: lora.AdapterSlots, adapter: str) -> lora.Grant:
    grant = slots.admit(slots.arrive(adapter))
    assert grant is not None
    return grant


def test_adapters_that_fit_the_slots_are_loaded_once_and_never_swapped() -> None:
    slots = lora.AdapterSlots(2)
    grants = []
    for adapter in "abab":
        grants.append(_run(slots, adapter))
        slots.release(adapter)
    assert [g.load for g in grants] == [True, True, False, False]
    assert (slots.swaps, slots.loads) == (0, Counter(a=1, b=1))


def test_one_adapter_too_many_swaps_out_the_least_recently_used_idle_one() -> None:
    slots = lora.AdapterSlots(2)
    for adapter in "aba":  # b is now the least recently used
        _run(slots, adapter)
        slots.release(adapter)
    assert _run(slots, "c") == lora.Grant(load=True, evicted="b")
    slots.release("c")
    assert _run(slots, "b") == lora.Grant(load=True, evicted="a")
    assert (slots.swaps, slots.loads) == (2, Counter(a=1, b=2, c=1))
    assert slots.stats() == {
        "max_loras": 2,
        "loaded": ["c", "b"],
        "lora_swaps": 2,
        "lora_loads": {"a": 1, "b": 2, "c": 1},
    }


def test_an_adapter_running_a_request_is_never_evicted_another_waits_in_fifo_order() -> None:
    slots = lora.AdapterSlots(1)
    _run(slots, "a")
    b, c = slots.arrive("b"), slots.arrive("c")
    assert slots.admit(c) is None
    assert slots.admit(b) is None
    assert _run(slots, "a") == lora.Grant(load=False, evicted=None)  # loaded: runs at once
    assert slots.labels() == ("a", "b,c")
    slots.release("a")
    slots.release("a")
    assert slots.admit(c) is None  # b came first
    assert slots.admit(b) == lora.Grant(load=True, evicted="a")
    assert slots.labels() == ("b", "c")
    slots.release("b")
    assert slots.admit(c) == lora.Grant(load=True, evicted="b")
    assert slots.swaps == 2


def test_a_waiter_that_leaves_lets_the_next_one_in() -> None:
    slots = lora.AdapterSlots(1)
    _run(slots, "a")
    slots.release("a")
    _run(slots, "a")
    b, c = slots.arrive("b"), slots.arrive("c")
    slots.release("a")
    slots.leave(b)
    assert slots.admit(c) == lora.Grant(load=True, evicted="a")
    assert slots.labels() == ("c", "")


def test_max_loras_is_one_or_more() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        lora.AdapterSlots(0)


# ---- vllm:lora_requests_info -------------------------------------------------------------


def _series(lines: list[str]) -> list[tuple[str, float]]:
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in lines[2:]]


def _name(running: str, waiting: str) -> str:
    labels = f'max_lora="2",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
    return "vllm:lora_requests_info{" + labels + "}"


def test_the_gauge_is_one_series_whose_newest_value_carries_the_current_labels() -> None:
    info = lora.InfoSeries(2, now=1000.0)
    lines = info.lines(1001.0)
    assert lines[:2] == [
        "# HELP vllm:lora_requests_info Running stats on lora requests.",
        "# TYPE vllm:lora_requests_info gauge",
    ]
    assert lines[2] == (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
        " 1001.0"
    )
    empty, busy, current = _name("", ""), _name("a,b", "c"), _name("b", "")
    info.note(("a,b", "c"), 1002.0)
    info.note(("a,b", "c"), 1003.0)  # unchanged: nothing to note
    info.note(("b", ""), 1004.0)
    series = _series(info.lines(1004.0))
    assert [name for name, _ in series] == [empty, busy, current]
    assert dict(series)[empty] == 1002.0  # the old label sets linger with their last time
    assert dict(series)[busy] == 1004.0
    assert max(series, key=lambda s: s[1])[0] == current  # newest, even at the same instant
    info.note(("", ""), 1005.0)  # a label set current again is one series, the newest
    series = _series(info.lines(1006.0))
    assert [name for name, _ in series] == [busy, current, empty]
    assert max(series, key=lambda s: s[1]) == (empty, 1006.0)


@pytest.mark.parametrize("value", [1.7964203675880184e09, 1712345678.0, 0.5, 0.0, 123.25])
def test_values_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert lora.go_float(value) == floatToGoString(value)


# ---- generation, prefix cache, KV events, side channel ---------------------------------------


def _ask(adapter: str | None, **body: Any) -> asks.Ask:
    return asks.ask_of({"prompt": "once upon a time", **body}, False, 16, adapter=adapter)


def test_an_adapter_says_something_else_than_the_base_deterministically() -> None:
    def text(ask: asks.Ask) -> str:
        return samples(ask)[0].text

    base = _ask(None)
    assert base.key(0) is None  # the base model's keys are as they always were
    assert _ask(None, seed=7).key(1) == 8
    assert text(_ask("sql")) == text(_ask("sql"))
    assert len({text(_ask(None)), text(_ask("sql")), text(_ask("chat"))}) == 3
    assert text(_ask("sql", seed=1)) != text(_ask("sql", seed=2))


def test_the_prefix_cache_keeps_adapters_apart_and_the_base_hashes_as_before() -> None:
    tokens = list(range(48))
    base_hashes = cost.block_hashes(tokens)
    assert cost.block_hashes(tokens, lora=None) == base_hashes
    assert set(cost.block_hashes(tokens, lora="sql")).isdisjoint(base_hashes)
    cache = cost.PrefixCache(64)
    cache.insert(tokens, "sql")
    assert cache.lookup(tokens, "sql") == 32  # every block but the one with the last token
    assert cache.lookup(tokens) == 0
    assert cache.lookup(tokens, "chat") == 0
    cache.insert(tokens)
    assert cache.lookup(tokens) == 32


def test_blocks_stored_under_an_adapter_carry_its_id_and_name() -> None:
    cache, stream = cost.PrefixCache(64), EventStream()
    tokens = list(range(32))
    [stored] = stream.inserted(tokens, cache.insert(tokens, "sql"), (1, "sql"))
    assert isinstance(stored, BlockStored)
    assert (stored.lora_id, stored.lora_name) == (1, "sql")
    [base] = stream.inserted(tokens, cache.insert(tokens))
    assert isinstance(base, BlockStored)
    assert (base.lora_id, base.lora_name) == (None, None)


def test_the_side_channel_refuses_kv_of_other_weights_and_keeps_the_lease() -> None:
    counters: Counter[str] = Counter()
    store = KVStore("e", 30.0, counters)

    async def scenario() -> None:
        lease = store.issue("r1", 32, model="sql")
        wrong = store.pull(PullRequest("e", "r1", lease.block_ids, "c", model="chat"))
        assert (wrong.ok, wrong.reason) == (False, "wrong_model")
        base = store.pull(PullRequest("e", "r1", lease.block_ids, "c", model="tiny"))
        assert base.reason == "wrong_model"
        right = store.pull(PullRequest("e", "r1", lease.block_ids, "c", model="sql"))
        assert (right.ok, right.blocks) == (True, 2)
        # a release moves no KV: whatever the consumer's model, the blocks are freed
        other = store.issue("r2", 16, model="sql")
        freed = store.pull(PullRequest("e", "r2", other.block_ids, "c", True, model="chat"))
        assert freed.ok

    trio.run(scenario)
    assert counters["kv_pull_refused_wrong_model"] == 2
