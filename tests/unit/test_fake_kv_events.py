"""The fake engine's KV events without sockets: what one cache change publishes, the two
encodings on the wire, the fault knobs, the replay protocol and the endpoint rules."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from narwhal.fake_engine import cost, kv_events
from narwhal.fake_engine.kv_events import BlockRemoved, BlockStored, EventStream, Knobs


def _wire(frames: list[bytes]) -> tuple[int, Any]:
    topic, seq, payload = frames
    assert topic == b"kv"
    return int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)


def test_a_change_stores_each_run_of_new_blocks_under_its_parent_and_removes_evictions() -> None:
    cache = cost.PrefixCache(4)
    stream = EventStream()
    head = list(range(32))  # two blocks
    stream.inserted(head, cache.insert(head))
    longer = [*head, *range(100, 148)]  # the two held, then three new ones
    change = cache.insert(longer)
    assert change.new == [2, 3, 4]
    stored, removed = stream.inserted(longer, change)
    assert isinstance(stored, BlockStored)
    assert isinstance(removed, BlockRemoved)
    name = stream.names
    assert stored.parent_block_hash == name(change.hashes[1])
    assert stored.block_hashes == [name(h) for h in change.hashes[2:]]
    assert stored.token_ids == longer[32:80]
    # five blocks in a cache of four: the longest prompt's tail went first
    assert removed.block_hashes == [name(change.hashes[4])]
    assert stream.inserted(head, cache.insert(head)) == []  # nothing new: no event


def test_runs_split_where_a_block_was_held() -> None:
    assert kv_events._runs([0, 1, 3, 4, 6]) == [[0, 1], [3, 4], [6]]
    assert kv_events._runs([]) == []


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_both_encodings_on_the_wire(encoding: kv_events.Encoding) -> None:
    stream = EventStream(encoding=encoding, clock=lambda: 1.5)
    tokens = list(range(16))
    cache = cost.PrefixCache(8)
    [frames] = stream.emit([*stream.inserted(tokens, cache.insert(tokens)), *stream.cleared()])
    seq, (ts, events, rank) = _wire(frames)
    assert (seq, ts, rank) == (0, 1.5, 0)
    block = stream.names(cost.block_hashes(tokens)[0])
    if encoding == "map":
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": [block],
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "AllBlocksCleared"},
        ]
    else:
        assert events == [
            ["BlockStored", [block], None, tokens, 16, None, "GPU", None],
            ["AllBlocksCleared"],
        ]
    removed = stream.emit([stream._removed(block_hashes=[block], medium="GPU")])
    assert _wire(removed[0])[1][1] == (
        [{"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU"}]
        if encoding == "map"
        else [["BlockRemoved", [block], "GPU"]]
    )
    # and back through the typed decoder
    _, decoded, _ = kv_events.decode_batch(frames[2], encoding)
    assert isinstance(decoded[0], BlockStored)
    assert decoded[0].block_hashes == [block]


def test_block_names_are_uint64_and_depend_on_the_salt() -> None:
    keys = [0, -1, 2**63 - 1, -(2**63), 12345]
    one, other = kv_events.BlockNames(), kv_events.BlockNames()
    assert all(0 <= one(k) < 2**64 for k in keys)
    assert len({one(k) for k in keys}) == len(keys)
    assert {one(k) for k in keys}.isdisjoint(other(k) for k in keys)
    assert kv_events.BlockNames(b"s")(7) == kv_events.BlockNames(b"s")(7)


def test_knobs_and_the_replay_buffer() -> None:
    stream = EventStream(buffer_steps=3)
    cleared = stream.cleared()
    stream.set_knobs(Knobs(drop_next=1))
    assert stream.emit(cleared) == []  # seq 0: withheld, kept
    stream.set_knobs(Knobs(drop_next=1, forget=True))
    assert stream.emit(cleared) == []  # seq 1: gone
    stream.set_knobs(Knobs(garbage_next=1, duplicate_next=1))
    [garbage] = stream.emit(cleared)  # seq 2
    assert garbage[1:] == [(2).to_bytes(8, "big"), kv_events.GARBAGE]
    first, second = stream.emit(cleared)  # seq 3
    assert first == second
    assert _wire(first)[0] == 3
    assert [seq for seq, _ in stream.buffer] == [0, 2, 3]  # 1 forgotten
    stream.emit(cleared)
    assert [seq for seq, _ in stream.buffer] == [2, 3, 4]  # the last three batches
    answer = stream.replay([b"id", b"", (3).to_bytes(8, "big")])
    assert answer is not None
    assert [frames[:4] for frames in answer] == [
        [b"id", b"", b"kv", (3).to_bytes(8, "big")],
        [b"id", b"", b"kv", (4).to_bytes(8, "big")],
        [b"id", b"", b"", kv_events.END_SEQ],
    ]
    assert answer[-1][4] == b""
    assert _wire([b"kv", answer[0][3], answer[0][4]])[1][1] == [{"type": "AllBlocksCleared"}]
    stream.set_knobs(Knobs(restart=True))
    assert (stream.seq, len(stream.buffer)) == (0, 0)
    assert _wire(stream.emit(cleared)[0])[0] == 0


@pytest.mark.parametrize(
    "request_frames",
    [
        [b"id", b"", b"short"],
        [b"id", b"x", (0).to_bytes(8, "big")],
        [b"id", (0).to_bytes(8, "big")],
        [b"id", b"", (0).to_bytes(8, "big"), b"more"],
    ],
)
def test_a_malformed_replay_request_gets_no_answer(request_frames: list[bytes]) -> None:
    stream = EventStream()
    assert stream.replay(request_frames) is None
    assert stream.counters["replay_rejected"] == 1


def test_knobs_reject_what_they_do_not_know() -> None:
    for body in (b'{"drop_next": -1}', b'{"flood": 2000000}', b'{"x": 1}', b"[]"):
        with pytest.raises(msgspec.ValidationError):
            kv_events.KNOBS.decode(body)
    assert kv_events.KNOBS.decode(b"{}") == Knobs()


@pytest.mark.parametrize(
    ("endpoint", "binds", "address"),
    [
        ("tcp://*:5557", True, "tcp://127.0.0.1:5557"),
        ("tcp://127.0.0.1:0", True, "tcp://127.0.0.1:0"),
        ("tcp://10.0.0.5:5557", False, "tcp://10.0.0.5:5557"),
        ("ipc:///tmp/kv", True, "ipc:///tmp/kv"),
    ],
)
def test_which_endpoints_bind(endpoint: str, binds: bool, address: str) -> None:
    assert kv_events.binds(endpoint) is binds
    assert kv_events.bind_address(endpoint, "127.0.0.1") == address


def test_an_ephemeral_port_is_named_by_the_port_bound() -> None:
    assert kv_events.usable("tcp://*:0", "tcp://127.0.0.1:4242") == "tcp://*:4242"
    assert kv_events.usable("tcp://127.0.0.1:0", "tcp://127.0.0.1:4242") == "tcp://127.0.0.1:4242"
    assert kv_events.usable("tcp://*:5557", "tcp://127.0.0.1:5557") == "tcp://*:5557"


@pytest.mark.parametrize(
    ("body", "chat"),
    [
        ({"prompt": "the quick brown fox"}, False),
        ({"prompt": ""}, False),
        ({"prompt": [5, 6, 7]}, False),
        ({"messages": [{"role": "user", "content": "hi there"}]}, True),
        ({"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "x"}]}, True),
    ],
)
def test_tokenize_strings_line_up_with_the_ids(body: dict[str, Any], chat: bool) -> None:
    assert len(cost.token_strs(body, chat)) == len(cost.prompt_tokens(body, chat))


def test_a_text_prompts_ids_are_the_generators_prompt_ids() -> None:
    """The ids /tokenize (and the events) give a text prompt are the ones its generation is
    a function of: a prompt sent back as ids generates the same."""
    from narwhal.fake_engine import generation as gen

    text = "The quick brown fox, über alles"
    assert cost.prompt_tokens({"prompt": text}, False) == gen.prompt_ids(text)
