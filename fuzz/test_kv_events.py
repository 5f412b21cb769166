"""Properties of the KV-event stream under hostile input: any frames, any batches, any
sequence numbers, in any order, reach ``EventStream`` without an exception, and it never
holds more blocks than twice its capacity nor a block it was never told of."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import examples
from narwhal.core.kv_events import Rejected, parse_message
from narwhal.core.precise_index import EventStream, TokenPrompt

ints = st.integers(-(2**63), 2**64 - 1)
ids = st.lists(st.integers(-2, 2**32), max_size=12)
stored = st.fixed_dictionaries(
    {
        "type": st.just("BlockStored"),
        "block_hashes": st.lists(ints | st.binary(max_size=70), max_size=4),
        "parent_block_hash": st.none() | ints,
        "token_ids": ids,
        "block_size": st.integers(-1, 4),
    },
    optional={"lora_name": st.none() | st.text(max_size=4), "extra": ints},
)
removed = st.fixed_dictionaries(
    {"type": st.just("BlockRemoved"), "block_hashes": st.lists(ints, max_size=4)}
)
other = st.fixed_dictionaries({"type": st.sampled_from(["AllBlocksCleared", "Unknown", 7])})
events = st.lists(stored | removed | other | ints | st.text(max_size=5), max_size=5)
payloads = st.one_of(
    events.map(lambda e: msgspec.msgpack.encode([1.0, e, 0])),
    events.map(lambda e: msgspec.msgpack.encode({"ts": 1.0, "events": e})),
    st.binary(max_size=64),
)
frames = st.tuples(
    st.binary(max_size=3), st.integers(-3, 40).map(lambda s: s.to_bytes(8, "big", signed=True)),
    payloads,
).map(list) | st.lists(st.binary(max_size=9), max_size=4)  # fmt: skip


@settings(max_examples=examples(300))
@given(st.lists(frames, max_size=30), st.booleans())
def test_hostile_streams_never_raise_and_stay_bounded(
    messages: list[list[bytes]], replay: bool
) -> None:
    stream = EventStream(replay=replay, capacity=4)
    for raw in messages:
        message = parse_message(raw)
        if isinstance(message, Rejected):
            stream.reject(message.why)
            continue
        if stream.receive(message, 0.0) is not None:
            stream.replay_ended(0.0)  # the replay socket never answers
    assert len(stream.blocks) <= 8
    assert set(stream.blocks.held) == set(stream.blocks.by_hash.values())
    assert TokenPrompt(list(range(20))).held(stream) >= 0
