"""vLLM's KV-event stream, decoded (docs/operator-guide.md, "KV events"), pure.

An engine started with ``--kv-events-config`` publishes, on a ZMQ PUB socket, multipart
messages ``[topic, 8-byte big-endian sequence, msgpack batch]``; a batch is the array
``[timestamp, events, dp_rank]`` (newer vLLM: the map ``{ts, events, data_parallel_rank}``,
read too). vLLM has written an event two ways: as a tagged array
(older: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name]``) and as a map tagged ``"type"`` (newer). Both are read here, as the
same classes; fields either does not know are ignored, and so are event types (counted apart
by the caller), so a newer vLLM does not stop the index.

What is refused, with the reason a metric carries (``Rejected.why``): a message that is not
three frames or whose sequence is not 8 bytes (``frame``), a batch over ``MAX_BATCH_BYTES``
(``too_large``), bytes that are not msgpack or not a batch (``batch``), and an event whose
fields have the wrong types or do not add up (``event``: token ids that are not
non-negative ints, a block size that is not positive, ``token_ids`` not ``block_size`` per
block hash). Nothing here raises past ``decode_batch``: an engine's garbage is data.

A module of msgspec structs: it stays pure Python in the compiled build (docs/build.md).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

MAX_BATCH_BYTES = 16 * 1024 * 1024  # larger batches are refused before they are decoded
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker
MAX_HASH_BYTES = 64  # a hash given as bytes (a newer vLLM's sha256 digest) is at most this

# an engine's block hash: a 64-bit int in vLLM 0.32; bytes in engines that publish the digest
EngineHash = int | bytes
TokenId = Annotated[int, Meta(ge=0, lt=2**32)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 16)]


class BlockStored(Struct, frozen=True, gc=False, tag_field="type", tag="BlockStored"):
    """Blocks the engine computed and keeps: one hash per block, their ``token_ids`` in
    order (``block_size`` per block), the first one's parent (None: the prompt's first)."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[TokenId]
    block_size: BlockSize
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(Struct, frozen=True, gc=False, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(Struct, frozen=True, gc=False, tag_field="type", tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


# the older encoding: the same events as tagged arrays (the tag first, then the fields in
# order); subclasses, so an event decoded either way is a ``BlockStored`` and so on
class _ArrayStored(BlockStored, frozen=True, array_like=True):
    pass


class _ArrayRemoved(BlockRemoved, frozen=True, array_like=True):
    pass


class _ArrayCleared(AllBlocksCleared, frozen=True, array_like=True):
    pass


class _Batch(Struct, frozen=True, gc=False, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    dp_rank: int | None = None


class _MapBatch(Struct, frozen=True, gc=False):
    """A batch as a map (newer vLLM's ``EventBatch`` without ``array_like``)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(Struct, frozen=True, gc=False):
    type: Any = None  # the tag of a map event this module does not know


_batch = msgspec.msgpack.Decoder(_Batch)
_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_maps = msgspec.msgpack.Decoder(Event)
_arrays = msgspec.msgpack.Decoder(_ArrayStored | _ArrayRemoved | _ArrayCleared)
_map_tag = msgspec.msgpack.Decoder(_Tagged)
_array_tag = msgspec.msgpack.Decoder(tuple[Any, ...])
KNOWN = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class Rejected(Struct, frozen=True):
    why: str  # frame, too_large, batch
    detail: str = ""


class Message(Struct, frozen=True):
    """One message of the stream: who published it (its topic) and its sequence number;
    its batch is decoded by ``decode_batch`` once the sequence says it is wanted."""

    topic: bytes
    seq: int
    payload: bytes


class Batch(Struct, frozen=True):
    events: list[Event]
    rejected: int = 0  # events refused (``event``)
    skipped: int = 0  # events of types this module does not know
    dp_rank: int | None = None


def parse_message(frames: list[bytes]) -> Message | Rejected:
    """The topic, sequence and payload of a PUB message (three frames)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return Rejected("frame", f"{len(frames)} frames")
    if len(frames[2]) > MAX_BATCH_BYTES:
        return Rejected("too_large", f"{len(frames[2])} bytes")
    return Message(frames[0], int.from_bytes(frames[1], "big", signed=True), frames[2])


def parse_replayed(frames: list[bytes]) -> Message | Rejected | None:
    """One answer of the replay socket, seen by a DEALER (its empty delimiter first):
    a batch, or None for the end marker. vLLM has answered ``[seq, payload]`` and
    ``[topic, seq, payload]`` after the delimiter; both are read."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    topic = frames[0] if len(frames) == 3 else b""
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2 or len(frames[0]) != 8:
        return Rejected("frame", f"{len(frames)} replay frames")
    if frames[0] == END_OF_REPLAY:
        return None
    if len(frames[1]) > MAX_BATCH_BYTES:
        return Rejected("too_large", f"{len(frames[1])} bytes")
    return Message(topic, int.from_bytes(frames[0], "big", signed=True), frames[1])


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends the replay socket to ask for every batch from ``start_seq``
    (the empty delimiter a REQ socket would add, then the sequence)."""
    return [b"", start_seq.to_bytes(8, "big", signed=True)]


def decode_batch(payload: bytes) -> Batch | Rejected:
    """A batch's events, each in the map shape; bad events are counted, not fatal."""
    batch: _Batch | _MapBatch
    try:
        array = _batch.decode(payload)
        batch, rank = array, array.dp_rank
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            batch = _map_batch.decode(payload)
            rank = batch.data_parallel_rank
        except (msgspec.DecodeError, msgspec.ValidationError):
            return Rejected("batch", str(exc)[:200])
    events: list[Event] = []
    rejected = skipped = 0
    for raw in batch.events:
        event = _event(bytes(raw))
        if event is None:
            skipped += 1
        elif isinstance(event, Rejected):
            rejected += 1
        else:
            events.append(event)
    return Batch(events, rejected, skipped, rank)


def _event(data: bytes) -> Event | Rejected | None:
    """One event, or Rejected, or None for a type this module does not know."""
    if not data:
        return Rejected("event")
    first = data[0]
    is_map = 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)
    try:
        event: Event = _maps.decode(data) if is_map else _arrays.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None if _tag_of(data, is_map) not in KNOWN | {None} else Rejected("event")
    if isinstance(event, BlockStored) and not _adds_up(event):
        return Rejected("event")
    if isinstance(event, BlockStored | BlockRemoved) and not _hashes_ok(event.block_hashes):
        return Rejected("event")
    return event


def _tag_of(data: bytes, is_map: bool) -> object:
    """An undecodable event's tag: a string other than the known ones is a newer event
    type (skipped), anything else (no tag, not a string) a malformed event."""
    try:
        tag = _map_tag.decode(data).type if is_map else (_array_tag.decode(data) or (None,))[0]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return tag if isinstance(tag, str) else None


def _adds_up(event: BlockStored) -> bool:
    ok_parent = not isinstance(event.parent_block_hash, bytes) or (
        len(event.parent_block_hash) <= MAX_HASH_BYTES
    )
    return ok_parent and len(event.token_ids) == len(event.block_hashes) * event.block_size


def _hashes_ok(hashes: list[EngineHash]) -> bool:
    return all(not isinstance(h, bytes) or len(h) <= MAX_HASH_BYTES for h in hashes)


class Source(Struct, frozen=True):
    """Where an engine's events are read: its publisher, its replay socket (None: it has
    none) and the topic it publishes under."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


class _SourceShape(Struct, frozen=True):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str | None = None
    data_parallel_rank: int | None = None


_any = msgspec.json.Decoder()


def event_sources(body: bytes, host: str) -> Source | None:
    """The engine's ``GET /kv_event_sources`` answer, each address's ``*`` read as
    ``host``; None when it says nothing usable. vLLM 0.32 answers its ``KVEventsConfig``
    per data-parallel rank (``{"0": {...}}``); others a list of sources, or one: rank 0
    (the first) is read."""
    try:
        found = _any.decode(body)
    except msgspec.DecodeError:
        return None
    if isinstance(found, dict) and "endpoint" not in found:
        ranked = sorted(found.items(), key=lambda kv: _rank(kv[0]))
        listed: list[Any] = [value for _, value in ranked]
    else:
        listed = found if isinstance(found, list) else [found]
        listed = sorted(listed, key=_listed_rank)
    for item in listed[:1]:
        try:
            first = msgspec.convert(item, _SourceShape)
        except msgspec.ValidationError:
            return None
        if not first.endpoint.startswith("tcp://"):
            return None
        replay = first.replay_endpoint
        return Source(
            _at(first.endpoint, host),
            _at(replay, host) if replay and replay.startswith("tcp://") else None,
            first.topic or "",
        )
    return None


def _listed_rank(item: Any) -> int:
    rank = item.get("data_parallel_rank") if isinstance(item, dict) else None
    return rank if type(rank) is int else 0


def _rank(key: str) -> int:
    return int(key) if key.isdigit() and len(key) < 6 else 1 << 20


def _at(endpoint: str, host: str) -> str:
    """``endpoint`` with a bound-everywhere host (``*``, ``0.0.0.0``) read as ``host``."""
    rest = endpoint.removeprefix("tcp://")
    bound_host, sep, port = rest.rpartition(":")
    if sep and bound_host in ("*", "0.0.0.0", "[::]", "::"):
        name = f"[{host}]" if ":" in host else host
        return f"tcp://{name}:{port}"
    return endpoint
