"""The fake engine's KV events as vLLM 0.32 publishes them, sans I/O.

Off unless ``--kv-events-endpoint`` is given (``FakeEngineConfig.kv_events_endpoint``); then
every change of the prefix cache (``cost.PrefixCache``) is published, and the cache is on
even without ``--prefix-cache-blocks``: it then holds ``kv_blocks`` blocks (4096 by
default), the engine's whole KV cache, as vLLM's prefix cache is its KV cache.

Wire format (vLLM's ``ZmqEventPublisher``): a PUB socket sends multipart messages
``[topic, seq, payload]``: the topic's UTF-8 bytes (``--kv-events-topic``, default ``kv``),
the batch's sequence number as 8 big-endian bytes (0 at each engine start, one more per
batch), and the batch in msgpack (msgspec), an array ``[ts, events, dp_rank]`` (a float
time, the events, the data-parallel rank: 0). Events in the ``map`` encoding (newer vLLM)::

    {"type": "BlockStored", "block_hashes": [h...], "parent_block_hash": h | None,
     "token_ids": [id...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [h...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

and in the ``array`` encoding (older vLLM: tagged arrays, the tag first)::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
     medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

One ``BlockStored`` carries a run of consecutive blocks the cache did not hold: their hashes,
the concatenation of their 16 token ids each (exactly the ids ``/tokenize`` gives for the
prompt), and the parent's hash (the block before the run; None for a prompt's first block).
Only full blocks are stored. Blocks computed under a LoRA adapter carry its ``lora_id`` (1 for
the first adapter of ``--models``, as vLLM numbers them) and ``lora_name``; the base model's
carry None for both. A block's published hash is a salted 64-bit hash of the cache's
own chained key (``BlockNames``), non-negative (it fits in uint64), with a salt drawn at each
engine start: as vLLM's default sha256 of pickled data, nobody outside can reproduce it, so
a router must key blocks by their token ids. One insertion (a computed prompt, a finished
reply) is one batch: its ``BlockStored`` events, then a ``BlockRemoved`` for what the LRU
evicted; ``POST /reset_prefix_cache`` is a batch of one ``AllBlocksCleared``.

Replay (vLLM's ROUTER socket, ``--kv-events-replay-endpoint``): a request
``[identity, b"", start]`` (what a REQ socket sends; a DEALER sends the empty frame itself;
``start`` 8 big-endian bytes) is answered as vLLM 0.32 answers it: for each buffered batch
whose seq >= start, ``[identity, b"", topic, seq, payload]``, then the end marker
``[identity, b"", b"", -1 as 8 signed big-endian bytes, b""]``. ``GET /kv_event_sources``
is vLLM 0.32's too: its ``KVEventsConfig`` per data-parallel rank (``{"0": {...}}``). The
last ``--kv-events-buffer-steps`` batches (10000) are kept. A malformed request is ignored
(no answer), logged at debug.

Fault knobs (``POST /fake/kv_events``, a JSON object; every key optional, counts add up):

* ``{"drop_next": N}``: the next N batches take their sequence numbers but are not sent;
  they are kept for replay, so a subscriber's gap repair recovers them.
* ``{"drop_next": N, "forget": true}``: the same, and not kept either: a gap replay
  cannot repair (the replay answers the batches around it, and only the end marker for
  the gap itself).
* ``{"duplicate_next": N}``: the next N batches are sent twice (the same seq twice).
* ``{"garbage_next": N}``: each of the next N batches is sent with its seq and a payload
  that is not msgpack (``GARBAGE``); the replay buffer keeps the real batch.
* ``{"flood": N}``: N extra batches at once, each a synthetic block stored and removed
  again (the net state is unchanged), as fast as the socket takes them (a PUB drops at its
  high-water mark; counted in ``dropped``).
* ``{"restart": true}``: what a restarted engine looks like: seq back to 0, the prefix
  cache cleared without an event, the replay buffer emptied, a new hash salt. Applied
  before the other keys of the same request.

Knobs apply in this order of precedence when several are pending: forget, drop, garbage,
duplicate.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import msgspec

from narwhal.fake_engine.cost import BLOCK_TOKENS, Inserted

log = logging.getLogger(__name__)

Encoding = Literal["map", "array"]
Frames = list[bytes]
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker
GARBAGE = b"\xc1 not msgpack"  # 0xc1 is a byte msgpack never uses
DEFAULT_BUFFER_STEPS = 10_000
MAX_BUFFER_STEPS = 1_000_000


class BlockStored(msgspec.Struct, frozen=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, frozen=True, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag=True):
    pass


# the older encoding: the same events as tagged arrays
class BlockStoredArray(BlockStored, frozen=True, tag="BlockStored", array_like=True):
    pass


class BlockRemovedArray(BlockRemoved, frozen=True, tag="BlockRemoved", array_like=True):
    pass


class AllBlocksClearedArray(AllBlocksCleared, frozen=True, tag="AllBlocksCleared", array_like=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None


_KINDS: dict[Encoding, tuple[type[BlockStored], type[BlockRemoved], type[AllBlocksCleared]]] = {
    "map": (BlockStored, BlockRemoved, AllBlocksCleared),
    "array": (BlockStoredArray, BlockRemovedArray, AllBlocksClearedArray),
}
_DECODERS: dict[Encoding, Any] = {
    "map": msgspec.msgpack.Decoder(
        tuple[float, list[BlockStored | BlockRemoved | AllBlocksCleared], int | None]
    ),
    "array": msgspec.msgpack.Decoder(
        tuple[
            float,
            list[BlockStoredArray | BlockRemovedArray | AllBlocksClearedArray],
            int | None,
        ]
    ),
}
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes, encoding: Encoding) -> tuple[float, list[Event], int | None]:
    """A payload back into its batch (tests, tools); raises ``msgspec.DecodeError``."""
    ts, events, rank = _DECODERS[encoding].decode(payload)
    return ts, list(events), rank


class BlockNames:
    """The engine's published name for a cached block: a keyed BLAKE2b of the cache's own
    key, 64 bits, non-negative. The key (``salt``) is drawn anew at each engine start."""

    def __init__(self, salt: bytes | None = None) -> None:
        self.salt = salt if salt is not None else secrets.token_bytes(16)

    def __call__(self, key: int) -> int:
        data = (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
        digest = hashlib.blake2b(data, digest_size=8, key=self.salt).digest()
        return int.from_bytes(digest, "big")


class Knobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of ``POST /fake/kv_events`` (see the module's docstring)."""

    drop_next: Annotated[int, msgspec.Meta(ge=0)] = 0
    forget: bool = False
    duplicate_next: Annotated[int, msgspec.Meta(ge=0)] = 0
    garbage_next: Annotated[int, msgspec.Meta(ge=0)] = 0
    flood: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    restart: bool = False


KNOBS = msgspec.json.Decoder(Knobs)


class EventStream:
    """One engine's stream of batches: sequence numbers, the replay buffer, the fault
    knobs, and the events one cache change makes. It decides what goes on the wire; the
    shell (``kv_publisher``) only sends it."""

    def __init__(
        self,
        topic: str = "kv",
        encoding: Encoding = "map",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic.encode()
        self.encoding: Encoding = encoding
        self._stored, self._removed, self._cleared = _KINDS[encoding]
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.clock = clock
        self.seq = 0  # the next batch's sequence number
        self.names = BlockNames()
        self.counters: Counter[str] = Counter()
        self.drop_next = self.forget_next = self.duplicate_next = self.garbage_next = 0

    def restart(self) -> None:
        """A new engine: seq from 0, nothing buffered, a new salt (the knobs stay)."""
        self.seq = 0
        self.buffer.clear()
        self.names = BlockNames()
        self.counters["restarts"] += 1

    def set_knobs(self, knobs: Knobs) -> None:
        if knobs.restart:
            self.restart()
        if knobs.forget:
            self.forget_next += knobs.drop_next
        else:
            self.drop_next += knobs.drop_next
        self.duplicate_next += knobs.duplicate_next
        self.garbage_next += knobs.garbage_next

    # ---- events ----------------------------------------------------------------------

    def inserted(
        self, tokens: Sequence[int], change: Inserted, lora: tuple[int, str] | None = None
    ) -> list[Event]:
        """The events of one ``PrefixCache.insert``: a ``BlockStored`` per run of
        consecutive new blocks, then a ``BlockRemoved`` for the evicted ones. ``lora``: the
        adapter (its ``lora_int_id`` and name) the blocks were computed under."""
        lora_id, lora_name = lora if lora is not None else (None, None)
        out: list[Event] = []
        name, hashes = self.names, change.hashes
        for run in _runs(change.new):
            first, last = run[0], run[-1]
            out.append(
                self._stored(
                    block_hashes=[name(hashes[i]) for i in run],
                    parent_block_hash=name(hashes[first - 1]) if first else None,
                    token_ids=list(tokens[first * BLOCK_TOKENS : (last + 1) * BLOCK_TOKENS]),
                    block_size=BLOCK_TOKENS,
                    lora_id=lora_id,
                    medium=MEDIUM,
                    lora_name=lora_name,
                )
            )
        if change.evicted:
            out.append(self._removed(block_hashes=list(map(name, change.evicted)), medium=MEDIUM))
        return out

    def cleared(self) -> list[Event]:
        return [self._cleared()]

    def synthetic(self) -> list[Event]:
        """A flood's batch: a block nobody asked for, stored and removed again."""
        block = secrets.randbits(64)
        ids = [secrets.randbelow(32000) for _ in range(BLOCK_TOKENS)]
        stored = self._stored(
            block_hashes=[block],
            parent_block_hash=None,
            token_ids=ids,
            block_size=BLOCK_TOKENS,
            lora_id=None,
            medium=MEDIUM,
            lora_name=None,
        )
        return [stored, self._removed(block_hashes=[block], medium=MEDIUM)]

    # ---- batches ---------------------------------------------------------------------

    def emit(self, events: list[Event]) -> list[Frames]:
        """Sequence one batch of ``events``; the messages to send for it now (none, one,
        or two, as the knobs say)."""
        seq = self.seq
        self.seq += 1
        self.counters["batches"] += 1
        self.counters["events"] += len(events)
        payload = _ENCODER.encode(EventBatch(self.clock(), events, 0))
        if self.forget_next:
            self.forget_next -= 1
            self.counters["forgotten"] += 1
            return []
        self.buffer.append((seq, payload))
        seq_bytes = seq.to_bytes(8, "big")
        if self.drop_next:
            self.drop_next -= 1
            self.counters["withheld"] += 1
            return []
        if self.garbage_next:
            self.garbage_next -= 1
            self.counters["garbage"] += 1
            return [[self.topic, seq_bytes, GARBAGE]]
        frames = [self.topic, seq_bytes, payload]
        if self.duplicate_next:
            self.duplicate_next -= 1
            self.counters["duplicated"] += 1
            return [frames, list(frames)]
        return [frames]

    def replay(self, request: Frames) -> list[Frames] | None:
        """The answer to a replay request (None: malformed, ignored)."""
        if len(request) != 3 or request[1] != b"" or len(request[2]) != 8:
            self.counters["replay_rejected"] += 1
            log.debug("kv events: malformed replay request of %d frames ignored", len(request))
            return None
        identity, start = request[0], int.from_bytes(request[2], "big")
        # vLLM 0.32's answers: the topic before each batch, and an empty one at the end
        out = [
            [identity, b"", self.topic, seq.to_bytes(8, "big"), p]
            for seq, p in self.buffer
            if seq >= start
        ]
        self.counters["replays"] += 1
        self.counters["replayed_batches"] += len(out)
        return [*out, [identity, b"", b"", END_SEQ, b""]]


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of ascending ``indices``: [0, 1, 3] -> [[0, 1], [3]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


# ---- endpoints ------------------------------------------------------------------------------


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint with ``*`` (or ``::``, ipc, inproc), connect to any
    other; here also one whose port is 0 (an ephemeral port: nothing to connect to)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    return endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[-1] == "0"


def bind_address(endpoint: str, host: str) -> str:
    """Where to bind ``endpoint``: a ``*`` host is the engine's own (loopback by default),
    as its HTTP listener is."""
    return endpoint.replace("tcp://*:", f"tcp://{host}:", 1)


def usable(configured: str, bound: str) -> str:
    """``configured`` as a subscriber reaches it: an ephemeral port 0 replaced by the port
    bound (``bound`` is the socket's last endpoint); a ``*`` host is kept."""
    if configured.startswith("tcp://") and configured.rsplit(":", 1)[-1] == "0":
        return configured.rsplit(":", 1)[0] + ":" + bound.rsplit(":", 1)[-1]
    return configured


# ---- the command line (``narwhal fake-engine``) ----------------------------------------------


def _steps(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_BUFFER_STEPS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_BUFFER_STEPS}, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV-event options, as vLLM's ``--kv-events-config`` fields; off by default."""
    parser.add_argument(
        "--kv-events-endpoint",
        default="",
        help="publish KV events on this ZMQ endpoint: tcp://*:5557 binds (on --host), "
        "tcp://HOST:PORT connects to a subscriber that binds, port 0 binds an ephemeral "
        "port (see GET /kv_event_sources); empty: no events",
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        default="",
        help="bind a ROUTER socket that replays buffered batches, e.g. tcp://*:5558",
    )
    parser.add_argument("--kv-events-topic", default="kv", help="the topic of every message")
    parser.add_argument(
        "--kv-events-encoding",
        choices=("map", "array"),
        default="map",
        help="events as tagged maps (newer vLLM) or tagged arrays (older vLLM)",
    )
    parser.add_argument(
        "--kv-events-buffer-steps",
        type=_steps,
        default=DEFAULT_BUFFER_STEPS,
        help="batches kept for replay",
    )


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``FakeEngineConfig`` fields the options above set."""
    return {
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
        "kv_events_topic": args.kv_events_topic,
        "kv_events_encoding": args.kv_events_encoding,
        "kv_events_buffer_steps": args.kv_events_buffer_steps,
    }
