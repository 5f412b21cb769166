"""The precise prefix index (docs/operator-guide.md, "KV events"), pure: what each engine
says it caches, from its own KV events, and nothing more.

**Keys.** vLLM's block hashes cannot be recomputed outside the engine (its default hash
pickles), so a block is keyed here by a chained hash of what the event says it holds: the
parent block's key, the LoRA adapter's name, and the block's token ids. A request's token
ids chained the same way give the keys to look up: a block matches only under the same
whole prefix and the same adapter, as in the engine. The engine's hash -> our key map is
what lets ``BlockRemoved`` evict. Keys are Python's ``hash`` of tuples: per process, which
is all a worker needs (each worker and each replica keeps its own view of the same truth).

**Streams.** Per engine an ``EventStream``: ``unknown`` until the first batch read from it
(events published before anyone subscribed are lost, so a first sequence above 0 is no
gap), then ``live``. A sequence that skips is a gap: the stream is ``repairing`` while the
shell asks the engine's replay socket for the missing batches (``Replay``); batches that
arrive meanwhile wait, bounded. A gap the replay does not close, a sequence that goes back
(a restarted engine; so does the last sequence seen again with another batch), or the
shell's word (failed health checks, an ejection) drops every
entry of the engine: until its stream is live again it is ``unknown``, and placement falls
back to the approximate index. A batch seen again (the same sequence) is ignored.

**Bounds.** Memory per engine is bounded by the blocks it reports, capped at its capacity
(``vllm:cache_config_info``'s ``num_gpu_blocks`` when scraped, else ``DEFAULT_CAPACITY``):
a batch that leaves more is counted (``over_capacity``), and past twice it (an engine may
store before it says what it evicted) blocks are refused, and so is a stored block whose
parent the index does not hold (``unknown_parent``: it cannot be keyed). Cost: one event
batch is a dict update per block (``bench/results/kv-events/``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

from narwhal.core.kv_events import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Message,
    Rejected,
    decode_batch,
)

DEFAULT_CAPACITY = 1 << 18  # blocks per engine before its cache size is known
MAX_WAITING_BATCHES = 4096  # batches held while a gap is repaired; past it, give up
_ROOT = 0x2545F4914F6CDD1D  # the parent key of a prompt's first block


# why a message, batch or event is refused (the rejected metric's ``why``)
REJECTS = (
    "frame",
    "too_large",
    "batch",
    "event",
    "unknown_parent",
    "over_capacity",
    "duplicate",
    "topic",
)


class StreamState(StrEnum):
    UNKNOWN = "unknown"
    LIVE = "live"
    REPAIRING = "repairing"


def chain_keys(
    token_ids: Sequence[int], block_size: int, lora: str | None, limit: int = 1 << 16
) -> list[int]:
    """The keys of the full blocks of ``token_ids`` (at most ``limit``), chained as the
    index keys an engine's stored blocks."""
    out: list[int] = []
    parent = _ROOT
    full = min(len(token_ids) // block_size, limit)
    for start in range(0, full * block_size, block_size):
        parent = hash((parent, lora, *token_ids[start : start + block_size]))
        out.append(parent)
    return out


class EngineBlocks:
    """One engine's blocks: the engine's hash -> our key, and each key's holders."""

    __slots__ = ("block_size", "by_hash", "capacity", "held")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.block_size = 0  # from the engine's events; 0 until one says
        self.by_hash: dict[EngineHash, int] = {}
        # key -> how many engine hashes name it (one block kept in two media, say)
        self.held: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.by_hash)

    def store(self, event: BlockStored, rejects: Counter[str]) -> None:
        parent = event.parent_block_hash
        key = _ROOT if parent is None else self.by_hash.get(parent)
        if key is None:
            rejects["unknown_parent"] += 1
            return
        if self.block_size != event.block_size:
            if self.by_hash:  # keys of two block sizes never chain: start over
                self.clear()
            self.block_size = event.block_size
        size, lora = event.block_size, _adapter(event)
        ids = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            key = hash((key, lora, *ids[i * size : (i + 1) * size]))
            old = self.by_hash.get(engine_hash)
            if old == key:
                continue
            # within a batch an engine may store before it says what it evicted: up to
            # twice its capacity is held, past that a block is refused (memory's bound)
            if old is None and len(self.by_hash) >= 2 * self.capacity:
                rejects["over_capacity"] += len(event.block_hashes) - i
                return
            if old is not None:
                self._unhold(old)
            self.by_hash[engine_hash] = key
            self.held[key] = self.held.get(key, 0) + 1

    def remove(self, hashes: Iterable[EngineHash]) -> None:
        for engine_hash in hashes:
            key = self.by_hash.pop(engine_hash, None)
            if key is not None:  # a block stored before we listened is not ours to drop
                self._unhold(key)

    def clear(self) -> None:
        self.by_hash.clear()
        self.held.clear()

    def match(self, keys: Iterable[int]) -> int:
        """How many leading blocks of ``keys`` the engine holds (``keys`` are taken only up
        to the first it does not hold)."""
        held = self.held
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def _unhold(self, key: int) -> None:
        left = self.held[key] - 1
        if left:
            self.held[key] = left
        else:
            del self.held[key]


@dataclass(frozen=True, slots=True)
class Replay:
    """Ask the engine's replay socket for every batch from ``start``."""

    start: int


class EventStream:
    """One engine's event stream and what it says the engine holds."""

    __slots__ = (
        "batches",
        "blocks",
        "events",
        "gaps",
        "last_event_at",
        "last_payload",
        "last_seq",
        "rejects",
        "repaired",
        "replay",
        "replays",
        "restarts",
        "skipped",
        "state",
        "unrepaired",
        "waiting",
    )

    def __init__(self, *, replay: bool = True, capacity: int = DEFAULT_CAPACITY) -> None:
        self.replay = replay  # whether a gap is worth asking the engine about
        self.state = StreamState.UNKNOWN
        self.last_seq: int | None = None
        self.last_payload = 0  # the last batch's hash: a batch seen twice is the same one
        self.blocks = EngineBlocks(capacity)
        self.waiting: list[Message] = []  # batches after a gap, while it is repaired
        self.rejects: Counter[str] = Counter()
        self.batches = self.events = self.skipped = 0
        self.gaps = self.replays = self.repaired = self.unrepaired = self.restarts = 0
        self.last_event_at: float | None = None

    @property
    def live(self) -> bool:
        return self.state is StreamState.LIVE

    def set_capacity(self, blocks: int) -> None:
        """The engine's KV cache size, from its report: what it can hold at most."""
        if blocks > 0:
            self.blocks.capacity = blocks

    def receive(self, message: Message, now: float) -> Replay | None:
        """A batch from the publisher; a ``Replay`` to run when it opens a gap."""
        seq = message.seq
        if self.state is StreamState.REPAIRING:
            if len(self.waiting) >= MAX_WAITING_BATCHES:
                self._give_up()
                return self.receive(message, now)
            self.waiting.append(message)
            return None
        last = self.last_seq
        if last is None or self.state is StreamState.UNKNOWN:
            self._apply(message, now)
            if self.last_seq is not None:  # live from the first batch that decodes
                self.state = StreamState.LIVE
            return None
        if seq == last and hash(message.payload) == self.last_payload:
            self.rejects["duplicate"] += 1  # published twice, or seen through a replay
            return None
        if seq <= last:  # the engine started again: what it held is gone
            self.restarts += 1
            self.blocks.clear()
            self._apply(message, now)
            return None
        if seq == last + 1:
            self._apply(message, now)
            return None
        self.gaps += 1
        if not self.replay:
            self._lost()
            self._apply(message, now)
            return None
        self.state = StreamState.REPAIRING
        self.waiting.append(message)
        self.replays += 1
        return Replay(last + 1)

    def replayed(self, message: Message, now: float) -> None:
        """A batch the replay socket sent back: applied when it is the next one."""
        if self.state is StreamState.REPAIRING and message.seq == (self.last_seq or 0) + 1:
            self._apply(message, now)

    def replay_ended(self, now: float) -> None:
        """The replay is over (its end marker, or its time ran out): the gap is closed when
        the batches it brought reach the first one that waited; else it is lost (the
        engine's entries dropped), and so is any hole left among the waiting batches."""
        if self.state is not StreamState.REPAIRING:
            return
        waiting, self.waiting = self.waiting, []
        self.state = StreamState.LIVE
        if waiting and self.last_seq is not None and self.last_seq + 1 >= waiting[0].seq:
            self.repaired += 1  # the replay reached the first batch that waited, or past it
        else:
            self._lost()
            self.last_seq = None  # on from the first batch that waited
        for message in waiting:
            last = self.last_seq
            if last is not None and message.seq <= last:
                continue  # the replay brought it already
            if last is not None and message.seq != last + 1:
                self._lost()
            self._apply(message, now)

    def drop(self) -> None:
        """The engine's entries go (failed health checks, an ejection, a reload): it is
        unknown until its stream is live again."""
        self.blocks.clear()
        self.waiting = []
        self.state = StreamState.UNKNOWN
        self.last_seq = None

    def reject(self, why: str) -> None:
        self.rejects[why] += 1

    def view(self) -> dict[str, object]:
        """The operator's view (``/narwhal/engines``)."""
        return {
            "state": self.state.value,
            "last_seq": self.last_seq,
            "blocks": len(self.blocks),
            "block_size": self.blocks.block_size or None,
            "capacity": self.blocks.capacity,
            "batches": self.batches,
            "gaps": self.gaps,
            "replays": self.replays,
            "repaired": self.repaired,
            "unrepaired": self.unrepaired,
            "restarts": self.restarts,
            "rejected": dict(self.rejects),
            "skipped": self.skipped,
        }

    def _apply(self, message: Message, now: float) -> None:
        """Apply a batch. One that cannot be decoded is counted and not taken as read: its
        events are lost to us, so the next batch shows the gap, and the replay asks for it
        again (a batch that is garbage there too leaves the gap unrepaired)."""
        batch = decode_batch(message.payload)
        if isinstance(batch, Rejected):
            self.rejects[batch.why] += 1
            return
        self.last_seq = message.seq
        self.last_payload = hash(message.payload)
        self.batches += 1
        self.last_event_at = now
        self._events(batch)

    def _events(self, batch: Batch) -> None:
        if batch.rejected:
            self.rejects["event"] += batch.rejected
        self.skipped += batch.skipped
        blocks = self.blocks
        for event in batch.events:
            self.events += 1
            if isinstance(event, BlockStored):
                blocks.store(event, self.rejects)
            elif isinstance(event, BlockRemoved):
                blocks.remove(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
        if len(blocks) > blocks.capacity:  # the engine says it holds more than it can
            self.rejects["over_capacity"] += 1

    def _lost(self) -> None:
        self.unrepaired += 1
        self.blocks.clear()

    def _give_up(self) -> None:
        """Too much waited on a repair: the gap is lost, and the stream goes on from the
        batches that waited."""
        self.waiting, waiting = [], self.waiting
        self._lost()
        self.state = StreamState.LIVE
        self.last_seq = None
        for message in waiting:
            self._apply(message, 0.0 if self.last_event_at is None else self.last_event_at)


def _adapter(event: BlockStored) -> str | None:
    """The adapter a block was computed under, as a request names it: its LoRA name; a
    LoRA id alone never matches a name (a block is never believed held under another)."""
    if event.lora_name is not None:
        return event.lora_name
    return None if event.lora_id is None else f"\x00lora-id:{event.lora_id}"


class PreciseIndex:
    """Every engine's ``EventStream``, by engine id."""

    __slots__ = ("replay", "streams")

    def __init__(self, *, replay: bool = True) -> None:
        self.replay = replay
        self.streams: dict[str, EventStream] = {}

    def stream(self, engine_id: str) -> EventStream:
        found = self.streams.get(engine_id)
        if found is None:
            found = self.streams[engine_id] = EventStream(replay=self.replay)
        return found

    def live(self, engine_id: str) -> EventStream | None:
        """The engine's stream when it is live (its entries are the truth), else None."""
        found = self.streams.get(engine_id)
        return found if found is not None and found.live else None

    def any_live(self) -> bool:
        return any(s.live for s in self.streams.values())

    def drop(self, engine_id: str) -> None:
        found = self.streams.get(engine_id)
        if found is not None:
            found.drop()

    def keep_only(self, engine_ids: Iterable[str]) -> None:
        keep = set(engine_ids)
        for gone in [e for e in self.streams if e not in keep]:
            del self.streams[gone]


class TokenPrompt:
    """A request's prompt as the engines' tokenizer gives it: its token ids and the adapter
    it runs under, with its block keys worked out once per block size, and only as far as
    some engine asked holds the blocks before: a block no engine holds ends every match,
    so the keys after it are never needed (a 12k-token prompt is 750 blocks)."""

    __slots__ = ("_keys", "ids", "lora")

    def __init__(self, ids: Sequence[int], lora: str | None = None) -> None:
        self.ids = ids
        self.lora = lora
        self._keys: dict[int, list[int]] = {}  # per block size, the leading keys so far

    @property
    def tokens(self) -> int:
        return len(self.ids)

    def keys(self, block_size: int) -> list[int]:
        """Every full block's key (``chain_keys``)."""
        return list(self._keys_from(block_size))

    def held(self, stream: EventStream) -> int:
        """How many of its leading tokens the stream's engine holds (whole blocks)."""
        size = stream.blocks.block_size
        if not size:
            return 0
        return stream.blocks.match(self._keys_from(size)) * size

    def _keys_from(self, block_size: int) -> Iterator[int]:
        """Its full blocks' keys in order, as ``chain_keys`` chains them, each worked out
        when first asked for and kept."""
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = []
        ids, lora = self.ids, self.lora
        for i in range(min(len(ids) // block_size, 1 << 16)):  # bounded: the prompt's blocks
            if i == len(keys):
                start = i * block_size
                parent = keys[-1] if keys else _ROOT
                keys.append(hash((parent, lora, *ids[start : start + block_size])))
            yield keys[i]
