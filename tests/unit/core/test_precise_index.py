"""The precise prefix index: an engine's entries are what its events say, no more."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.kv_events import Message
from narwhal.core.precise_index import (
    EngineBlocks,
    EventStream,
    PreciseIndex,
    Replay,
    StreamState,
    TokenPrompt,
    chain_keys,
)
from tests.support.kv_wire import batch, cleared, removed, stored

BS = 4
PROMPT = list(range(1, 17))  # four blocks of four


def msg(seq: int, *events: object, ts: float = 1.0) -> Message:
    return Message(b"kv", seq, batch(*events, ts=ts))


def live_stream(*events: object, replay: bool = True) -> EventStream:
    stream = EventStream(replay=replay)
    stream.receive(msg(5, *events), 0.0)
    return stream


def held(stream: EventStream, ids: list[int], lora: str | None = None) -> int:
    return TokenPrompt(ids, lora).held(stream)


def test_a_stored_prompt_matches_its_full_blocks_in_tokens() -> None:
    stream = live_stream(stored([11, 12, 13, 14], None, PROMPT, BS))
    assert stream.state is StreamState.LIVE
    assert held(stream, PROMPT) == 16
    assert held(stream, [*PROMPT[:10], 99, 98]) == 8
    assert held(stream, [99, *PROMPT]) == 0


def test_blocks_stored_in_two_events_chain_through_the_parent_hash() -> None:
    stream = live_stream(
        stored([11, 12], None, PROMPT[:8], BS), stored([13, 14], 12, PROMPT[8:], BS)
    )
    assert held(stream, PROMPT) == 16


def test_a_removed_block_ends_the_match_where_it_was() -> None:
    stream = live_stream(stored([11, 12, 13, 14], None, PROMPT, BS), removed([13]))
    assert held(stream, PROMPT) == 8
    stream.receive(msg(6, cleared()), 0.0)
    assert held(stream, PROMPT) == 0
    assert len(stream.blocks) == 0


def test_adapters_never_share_blocks() -> None:
    stream = live_stream(stored([11, 12], None, PROMPT[:8], BS, "tinylora"))
    assert held(stream, PROMPT, "tinylora") == 8
    assert held(stream, PROMPT) == 0
    assert held(stream, PROMPT, "other") == 0


def test_a_block_whose_parent_is_unknown_is_refused() -> None:
    stream = live_stream(stored([13], 999, PROMPT[8:12], BS))
    assert stream.rejects["unknown_parent"] == 1
    assert len(stream.blocks) == 0


def test_the_first_batch_read_makes_the_stream_live_at_any_sequence() -> None:
    stream = EventStream()
    assert stream.receive(msg(41, stored([1], None, PROMPT[:4], BS)), 0.0) is None
    assert stream.live
    assert stream.gaps == 0


def test_a_gap_asks_for_a_replay_and_the_replay_repairs_it() -> None:
    stream = live_stream(stored([11], None, PROMPT[:4], BS))
    later = msg(8, stored([14], 13, PROMPT[12:], BS))
    assert stream.receive(later, 0.0) == Replay(6)
    assert stream.state is StreamState.REPAIRING
    assert not stream.live
    stream.replayed(msg(6, stored([12], 11, PROMPT[4:8], BS)), 0.0)
    stream.replayed(msg(7, stored([13], 12, PROMPT[8:12], BS)), 0.0)
    stream.replay_ended(0.0)
    assert stream.live
    assert stream.repaired == 1
    assert held(stream, PROMPT) == 16
    assert stream.last_seq == 8


def test_a_replay_that_also_brings_the_batch_that_waited_repairs_the_gap() -> None:
    stream = live_stream(stored([11], None, PROMPT[:4], BS))
    later = msg(7, stored([13], 12, PROMPT[8:12], BS))
    assert stream.receive(later, 0.0) == Replay(6)
    stream.replayed(msg(6, stored([12], 11, PROMPT[4:8], BS)), 0.0)
    stream.replayed(later, 0.0)
    stream.replay_ended(0.0)
    assert stream.repaired == 1
    assert held(stream, PROMPT) == 12


def test_a_gap_the_replay_cannot_close_drops_the_engine_entries() -> None:
    stream = live_stream(stored([11, 12], None, PROMPT[:8], BS))
    assert stream.receive(msg(9, removed([99])), 0.0) == Replay(6)
    stream.replayed(msg(6, removed([77])), 0.0)  # 7 and 8 are gone for good
    stream.replay_ended(0.0)
    assert stream.unrepaired == 1
    assert held(stream, PROMPT) == 0
    assert stream.live  # from the batch that waited on
    assert stream.last_seq == 9


def test_without_replay_a_gap_drops_the_entries_at_once() -> None:
    stream = live_stream(stored([11, 12], None, PROMPT[:8], BS), replay=False)
    assert stream.receive(msg(7, stored([21], None, [5, 5, 5, 5], BS)), 0.0) is None
    assert held(stream, PROMPT) == 0
    assert held(stream, [5, 5, 5, 5]) == 4


def test_a_batch_that_does_not_decode_is_a_gap_the_replay_repairs() -> None:
    stream = live_stream(stored([11], None, PROMPT[:4], BS))
    stream.receive(Message(b"kv", 6, b"\xc1 not msgpack"), 0.0)
    assert stream.rejects["batch"] == 1
    assert stream.receive(msg(7, stored([13], 12, PROMPT[8:12], BS)), 0.0) == Replay(6)
    stream.replayed(msg(6, stored([12], 11, PROMPT[4:8], BS)), 0.0)
    stream.replay_ended(0.0)
    assert stream.repaired == 1
    assert held(stream, PROMPT) == 12


def test_a_sequence_that_goes_back_is_a_restart() -> None:
    stream = live_stream(stored([11, 12], None, PROMPT[:8], BS))
    stream.receive(msg(0, stored([31], None, [9, 9, 9, 9], BS)), 0.0)
    assert stream.restarts == 1
    assert held(stream, PROMPT) == 0
    assert held(stream, [9, 9, 9, 9]) == 4


def test_the_last_sequence_again_with_another_batch_is_a_restart() -> None:
    stream = live_stream(stored([11], None, PROMPT[:4], BS))
    stream.receive(msg(5, cleared(), ts=2.0), 0.0)
    assert stream.restarts == 1


def test_a_batch_seen_twice_is_applied_once() -> None:
    stream = live_stream(stored([11], None, PROMPT[:4], BS))
    stream.receive(msg(6, removed([11])), 0.0)
    stream.receive(msg(6, removed([11])), 0.0)
    assert stream.rejects["duplicate"] == 1
    assert stream.last_seq == 6


def test_an_engine_past_its_capacity_is_capped_and_counted() -> None:
    stream = EventStream(capacity=1)
    stream.receive(msg(0, stored([11, 12, 13, 14], None, PROMPT, BS)), 0.0)
    assert len(stream.blocks) == 2  # twice the capacity at most
    assert stream.rejects["over_capacity"] == 3  # two blocks refused, one batch over
    assert held(stream, PROMPT) == 8


def test_a_batch_that_stores_before_it_evicts_stays_within_bounds() -> None:
    stream = EventStream(capacity=2)
    stream.receive(msg(0, stored([11, 12], None, PROMPT[:8], BS)), 0.0)
    stream.receive(msg(1, stored([13], 12, PROMPT[8:12], BS), removed([11])), 0.0)
    assert len(stream.blocks) == 2
    assert stream.rejects["over_capacity"] == 0


def test_dropping_an_engine_makes_it_unknown_until_a_batch_comes() -> None:
    index = PreciseIndex()
    index.stream("e").receive(msg(3, stored([11], None, PROMPT[:4], BS)), 0.0)
    assert index.live("e") is not None
    index.drop("e")
    assert index.live("e") is None
    assert len(index.stream("e").blocks) == 0
    index.stream("e").receive(msg(4, cleared()), 0.0)
    assert index.live("e") is not None


# A model of the engine: the blocks it holds, by its own hash. Whatever sequence of
# events arrives, with gaps, duplicates and restarts, the index never believes a block
# the engine does not hold once its stream is live (invariant: no more than events said).
ids = st.lists(st.integers(0, 3), min_size=BS, max_size=4 * BS)
ops = st.one_of(
    st.tuples(st.just("store"), ids),
    st.tuples(st.just("remove"), st.integers(0, 20)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("lose"), st.none()),  # the next batch never arrives
    # the engine restarted: its connection dropped, which the subscriber sees (a SUB
    # socket's monitor), and its sequence starts again at 0
    st.tuples(st.just("restart"), st.none()),
)


@given(st.lists(ops, max_size=40))
def test_the_index_never_holds_more_than_the_engine(plan: list[tuple[str, object]]) -> None:
    engine: dict[int, tuple[int, ...]] = {}  # hash -> the whole prefix up to the block
    by_prefix: dict[tuple[int, ...], int] = {}
    stream = EventStream(replay=False)
    seq, next_hash, lose = 0, 1, False
    seen: set[tuple[int, ...]] = set()  # every prefix the engine ever stored
    for op, arg in plan:
        events: list[object] = []
        if op == "store":
            assert isinstance(arg, list)
            full = arg[: len(arg) // BS * BS]
            parent = None
            for end in range(BS, len(full) + 1, BS):
                prefix = tuple(full[:end])
                if prefix in by_prefix:
                    parent = by_prefix[prefix]
                    continue
                h = next_hash
                next_hash += 1
                engine[h], by_prefix[prefix] = prefix, h
                seen.add(prefix)
                events.append(stored([h], parent, list(prefix[-BS:]), BS))
                parent = h
        elif op == "remove" and engine:
            assert isinstance(arg, int)
            h = sorted(engine)[arg % len(engine)]
            by_prefix.pop(engine.pop(h))
            events.append(removed([h]))
        elif op == "clear":
            engine.clear()
            by_prefix.clear()
            events.append(cleared())
        elif op == "lose":
            lose = True
            continue
        elif op == "restart":
            engine.clear()
            by_prefix.clear()
            stream.drop()
            seq = -1
        seq += 1
        if lose:
            lose = False
            continue
        stream.receive(msg(seq, *events, ts=float(len(seen) + next_hash + seq)), 0.0)
        if stream.live:
            for prefix in seen:
                got = TokenPrompt(list(prefix)).held(stream)
                truly = 0
                while truly < len(prefix) and prefix[: truly + BS] in by_prefix:
                    truly += BS
                assert got <= truly


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.integers(0, 3), max_size=60),
    st.sampled_from([1, 2, 4, 16]),
    st.sampled_from([None, "lora-a"]),
)
def test_keys_worked_out_as_a_match_goes_are_the_chained_keys_of_the_whole_prompt(
    stored_ids: list[int], asked: list[int], size: int, lora: str | None
) -> None:
    blocks = EngineBlocks()
    blocks.block_size = size
    blocks.held.update(dict.fromkeys(chain_keys(stored_ids, size, lora), 1))
    prompt = TokenPrompt(asked, lora)
    whole = chain_keys(asked, size, lora)
    expected = 0
    while expected < len(whole) and whole[expected] in blocks.held:
        expected += 1
    stream = EventStream()
    stream.blocks = blocks
    assert prompt.held(stream) == expected * size
    assert prompt._keys[size] == whole[: min(expected + 1, len(whole))]  # no further
    assert prompt.keys(size) == whole
