"""vLLM's KV-event stream decoded: both encodings, and garbage that never raises."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.kv_events import (
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    Message,
    Rejected,
    decode_batch,
    event_sources,
    parse_message,
    parse_replayed,
    replay_request,
)
from tests.support.kv_wire import batch, cleared, frames, removed, stored


def test_map_and_array_events_decode_alike() -> None:
    for array in (False, True):
        decoded = decode_batch(
            batch(
                stored([7, 8], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, "ad", array=array),
                removed([7], array=array),
                cleared(array=array),
            )
        )
        assert isinstance(decoded, Batch)
        first, second, third = decoded.events
        assert isinstance(first, BlockStored)
        assert first.block_hashes == [7, 8]
        assert first.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
        assert first.lora_name == "ad"
        assert isinstance(second, BlockRemoved)
        assert (second.block_hashes, second.medium) == ([7], "GPU")
        assert isinstance(third, AllBlocksCleared)


def test_unknown_event_types_and_fields_are_skipped_not_refused() -> None:
    newer = {"type": "BlockMoved", "block_hashes": [1]}
    extra = {**stored([1], None, [1, 2, 3, 4]), "new_field": {"x": 1}}
    decoded = decode_batch(batch(newer, ["SomethingElse", 1], extra))
    assert isinstance(decoded, Batch)
    assert decoded.skipped == 2
    assert decoded.rejected == 0
    assert len(decoded.events) == 1


def test_events_of_wrong_types_are_refused_one_by_one() -> None:
    bad = [
        stored([1], None, ["a", "b", "c", "d"]),  # ids that are not ints
        stored([1], None, [1, 2, 3, -4]),  # a negative id
        stored([1], None, [1, 2, 3]),  # not block_size ids per hash
        stored([1], None, [1, 2, 3, 4], 0),  # block size 0
        {"block_hashes": [1]},  # no tag
        {"type": 5},
        removed(["x"]),  # a hash that is neither int nor bytes
    ]
    decoded = decode_batch(batch(*bad, stored([2], None, [1, 2, 3, 4])))
    assert isinstance(decoded, Batch)
    assert decoded.rejected == len(bad)
    assert len(decoded.events) == 1


def test_a_message_is_three_frames_with_an_eight_byte_sequence() -> None:
    assert parse_message(frames(5, b"x")) == Message(b"kv", 5, b"x")
    assert parse_message([b"kv", b"\x00" * 7, b"x"]) == Rejected("frame", "3 frames")
    assert isinstance(parse_message([b"kv"]), Rejected)


def test_a_batch_over_the_limit_is_refused_before_it_is_decoded() -> None:
    refused = parse_message(frames(1, b"\x00" * (MAX_BATCH_BYTES + 1)))
    assert isinstance(refused, Rejected)
    assert refused.why == "too_large"


def test_replay_answers_and_the_end_marker() -> None:
    assert replay_request(3) == [b"", (3).to_bytes(8, "big")]
    assert parse_replayed([b"", (3).to_bytes(8, "big"), b"p"]) == Message(b"", 3, b"p")
    assert parse_replayed([b"", (-1).to_bytes(8, "big", signed=True), b""]) is None
    assert isinstance(parse_replayed([b"", b"x"]), Rejected)


def test_the_replay_answer_with_a_topic_frame_is_read_too() -> None:
    answer = parse_replayed([b"", b"kv", (4).to_bytes(8, "big"), b"p"])
    assert answer == Message(b"kv", 4, b"p")
    end = parse_replayed([b"", b"kv", (-1).to_bytes(8, "big", signed=True), b""])
    assert end is None


def test_a_batch_written_as_a_map_is_read() -> None:
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [cleared()], "data_parallel_rank": 2})
    decoded = decode_batch(payload)
    assert isinstance(decoded, Batch)
    assert decoded.events == [AllBlocksCleared()]
    assert decoded.dp_rank == 2


def test_event_sources_as_vllm_032_answers_them_per_rank() -> None:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:30533",
        "replay_endpoint": "tcp://127.0.0.1:20093",
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": "kv-e1",
    }
    body = msgspec.json.encode({"1": {**config, "topic": "r1"}, "0": config})
    found = event_sources(body, "127.0.0.1")
    assert found is not None
    assert found.endpoint == "tcp://127.0.0.1:30533"
    assert found.replay == "tcp://127.0.0.1:20093"
    assert found.topic == "kv-e1"


def test_event_sources_read_star_as_the_engine_host() -> None:
    body = msgspec.json.encode(
        [
            {"data_parallel_rank": 1, "endpoint": "tcp://*:6000", "topic": "r1"},
            {
                "data_parallel_rank": 0,
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://0.0.0.0:5558",
                "topic": "kv",
            },
        ]
    )
    found = event_sources(body, "10.1.2.3")
    assert found is not None
    assert found.endpoint == "tcp://10.1.2.3:5557"
    assert found.replay == "tcp://10.1.2.3:5558"
    assert found.topic == "kv"
    assert event_sources(b"[]", "h") is None
    assert event_sources(b"{}", "h") is None
    assert event_sources(b"{not json", "h") is None
    assert event_sources(b'{"endpoint": "ipc:///x"}', "h") is None


@given(st.binary(max_size=512))
def test_garbage_payloads_never_raise(data: bytes) -> None:
    assert isinstance(decode_batch(data), Batch | Rejected)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])


@given(st.lists(st.tuples(tags, st.lists(json_like, max_size=8)), max_size=6))
def test_malformed_events_of_known_tags_are_refused_never_raised(
    events: list[tuple[str, list[object]]],
) -> None:
    payload = msgspec.msgpack.encode([1.0, [[tag, *fields] for tag, fields in events], 0])
    decoded = decode_batch(payload)
    assert isinstance(decoded, Batch)
    assert decoded.rejected + decoded.skipped + len(decoded.events) == len(events)
