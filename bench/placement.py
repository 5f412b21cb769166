"""Placement policies side by side, in one run, over the same fake fleet (issue item 5),
and conditional disaggregation (decode first, contract 4.4) against always disaggregating.

    python bench/placement.py [--quick] [--peers-venv .bench-venv] [--out bench/results]
                              [--set KEY=VALUE]...   (a [placement] line for our targets;
                                 admission.KEY=VALUE: an [admission] line)
                              [--only PREFIX] [--targets NAME,...] [--thresholds 256,1024]

The fleet, started afresh for every (policy, workload) run so that every prefix cache
starts cold and every queue empty (``narwhal fake-engine`` with its cost model):

  p0, p1  producers: 4 slots (prompts computed at once; the rest wait in a FIFO queue),
          0.2 ms of prefill per prompt token the prefix cache does not hold (a 1,500-token
          system prompt: 300 ms; 20k prompt tokens/s with all slots busy: a GPU engine on a
          mid-sized model), a prefix cache of 480 16-token blocks: five of the eight
          1,500-token system prompts, so a producer can hold its share of them (the ring
          gives p0 three and p1 five) but not all eight. p1 is 2x slower (``--slowdown 2``).
  d0, d1  consumers: 16 slots, 5 ms between generated tokens; d1 2x slower. In the first
          three workloads they compute no prompt (the KV comes from the producer), so they
          have no prefix cache and the hit rate is the producers'. In the two conditional
          workloads a consumer computes the prompts a router keeps local, so it also has
          ``--prefix-cache-blocks 2048 --prefill-ms-per-token 0.2`` and pays
          ``--kv-ms-per-block 0.5`` per pulled 16-token block it does not hold, and its
          running streams' gaps grow by ``--prefill-interference 0.5`` x the prompts it is
          computing, and a pull costs ``--kv-pull-ms 5`` (the step a vLLM consumer waits for
          a remote KV load before it schedules the request). The first three keep the old
          consumers, so that their rows stay comparable with earlier runs.

Fair to every router: the same engines, restarted cold for each run; each workload's
schedule (arrival times and prompts: open loop, Poisson arrivals from a fixed seed) drawn
once and replayed to every target; the engines' cost is the only thing that differs
between a good and a bad placement (no router pays for anything but its own CPU). The rate
(8 requests/s) keeps this shared 2-core machine from being the bottleneck; the fleet's
capacity at that rate is ample unless placement wastes it (cache misses on the slow
producer, legs behind another tenant's queue). One token is one whitespace-separated word
(the fake engine's tokenizer); 16 output tokens per request unless said otherwise. A
workload's seed is its place in the list below, with ``--only`` too.

Workloads (30 s of arrivals each, 10 s with ``--quick``):
  uniform        unique 200-token prompts
  shared-prefix  80% of requests: one of 8 system prompts (1,500 tokens) and a unique
                 40-token question; 20%: a unique 300-token prompt
  burst          unique 200-token prompts, and from 5 s to 25 s another tenant (another
                 router, or clients that bypass ours) keeps 12 2,000-token prefills (400 ms
                 each) going straight to p0, the fast producer: its four slots busy and
                 eight waiting; a router sees that load only in p0's /metrics (or its own
                 legs there slowing down)
  multi-turn chat  (conditional) 32 conversations (16 with ``--quick``) of 6 turns on
                 /v1/chat/completions, streamed; a 1,500-token system prompt per 8
                 conversations (4 in all), each turn a fresh 50-token user message and a
                 100-token reply (temperature 0). Closed loop per conversation: turn n+1 is
                 sent when turn n's reply has arrived and a seeded pause of 0.25-0.75 s has
                 passed, with the previous messages, the reply exactly as this client read
                 it (its deltas' content, concatenated) and the new message; conversations
                 start at seeded Poisson arrivals (1 a second). Every turn after the first
                 is a long prompt whose uncached part on the consumer that served the last
                 turn is short: what decode-first placement should keep local.
  short prompts  (conditional) /v1/completions at 8 requests/s, 64 output tokens (decodes
                 long enough for local prefills to land on them); unique prompts, 70% of
                 20-99 tokens and 30% of 2,001-2,600 (nothing to cache): short ones stuck
                 behind long prefills on the producers, unless kept on the consumer
  cache pressure  (conditional, KV events) a chat service whose caches are too small for
                 its prompts: 24 system prompts of 1,000-1,500 tokens (fixed texts), each
                 conversation's drawn by Zipf popularity (s = 1: the first a quarter of
                 conversations, the last 1%); 90 conversations (45 with ``--quick``) of 3
                 turns on /v1/chat/completions as in multi-turn chat (50-token user
                 messages, 100-token replies, the same closed loop and pauses), starting at
                 3 a second. Every engine's prefix cache is a third of the working set
                 (every system prompt and the conversations in flight: 728 blocks,
                 ``pressure_cache_blocks``), so the LRU evicts the less popular system
                 prompts between their uses while the router that sent them believes them
                 held (the approximate index trusts a prefix for ``prefix_index_ttl_s``,
                 120 s). Every engine publishes its KV events (``--kv-events-endpoint
                 tcp://*:0 --kv-events-replay-endpoint tcp://*:0``: ephemeral loopback ports
                 its ``/kv_event_sources`` names), for every target alike; with events the
                 warm-up's prompts are one block each, so the streams are live before the
                 measured phase
  lora adapters  two LoRA adapters of the base model, ``hot`` and ``cold``, on all four
                 engines with one adapter slot each (``--models fake-model,hot:fake-model,
                 cold:fake-model --max-loras 1 --lora-swap-ms 50``: a request for the adapter
                 not loaded waits until the slot's adapter has no request running, then pays
                 50 ms; requests for the loaded one keep going past it, as in vLLM); open
                 loop at 8 requests/s, each request's name drawn: 72% ``hot``, 18% ``cold``,
                 10% the base model (no slot); unique 1,000-token prompts (200 ms of prefill
                 on p0, 400 on p1: nothing cached, so the adapters are all that placement can
                 get right) and 64 output tokens (320 ms on d0, 640 on d1), so that adapters
                 are running when an engine is scraped

Targets of the first three workloads:
  round_robin            ours, ``[placement] policy = "round_robin"``, no prefix affinity
  least_loaded           ours, ``policy = "least_loaded"``, no prefix affinity
  least_loaded+affinity  ours, ``least_loaded`` and ``prefix_affinity = true`` (the default)
  (all three with the default ``metrics_interval_s = 1.0``, ``affinity_load_factor = 1.25``)
  least_loaded+affinity 0.25s   the default but for ``metrics_interval_s = 0.25``: how much
                         of a burst's first second lands on the loaded engine before a
                         scrape shows its queue
  vllm-router cache_aware, vllm-router power_of_two   vllm-router 0.1.17 in PD mode,
                         ``--policy`` for both roles
  narwhal-0.7            narwhal-inference 0.7.0 with its own (profile-priced) placement and
                         the synthetic profiles of bench/narwhal07_config.py

With ``--kv-events`` every workload's engines publish KV events, and each of our targets
that places by prefix (the affinity ones, always-P/D, conditional N) is followed by a twin
with ``[kv_events] mode = "subscribe"``, named with " precise" after it; the report adds
each twin's TTFT p50 and p99 over its own target's in the same run.

Targets of the cache pressure workload:
  narwhal precise        ours, ``least_loaded``, prefix affinity, ``local_prefill_tokens =
                         256`` (a follow-up turn's uncached part is about 60 tokens, a system
                         prompt's 1,000 or more) and ``[kv_events] mode = "subscribe"``
  narwhal approximate    the same with the precise index off (``mode = "off"``, the default)
  vllm-router cache_aware   as above

Targets of the lora adapters workload (all three through the same P/D fleet, each of our
targets scraping every 0.25 s, ``metrics_interval_s = 0.25``: vllm:lora_requests_info is
what adapter affinity reads):
  adapter affinity       ours, ``least_loaded``, prefix affinity and ``adapter_affinity =
                         true`` (the defaults)
  adapter affinity off   the same with ``adapter_affinity = false``: the baseline
  vllm-router cache_aware   as above; it does not route by ``model`` (every engine serves
                         every name here, so whatever it picks answers)

Targets of the conditional workloads:
  always-P/D             ours with its defaults (least_loaded, prefix affinity, every request
                         disaggregated: ``local_prefill_tokens`` unset, 0)
  conditional N          the same with ``[placement] local_prefill_tokens = N``, for each N of
                         ``--thresholds`` (64, 256 and 1024 by default; LOCAL_THRESHOLDS). A
                         router that does not know the key refuses its fleet file: the row
                         says so and the run goes on
  vllm-router cache_aware, narwhal-0.7   as above

Reported per (workload, target): TTFT p50/p99 (client side: from sending the request to the
first streamed token), throughput (completed requests over the time from the first arrival
to the last completion), the producers' prefix-cache hit rate (the change of
``vllm:prefix_cache_hits_total`` over the change of ``vllm:prefix_cache_queries_total``
summed over p0 and p1 during the measured phase, in prompt tokens, the other tenant's
included), each producer's share of the prompt tokens this router sent (the tenant's taken
out), our placement decisions by reason, each engine's peak waiting queue (sampled every
0.5 s), the slowest requests (TTFT, arrival) and the machine's load average.

The conditional workloads' table has its own columns, all over the measured phase: TTFT
p50/p99 (here the first non-empty token text, not a role chunk), for short prompts the
short ones' TTFT p50 and the long ones' p99; ITL p99 of running decodes (the client's gaps
between consecutive reads that carry token text after the first, pooled over requests:
chunks one read brings together are one arrival); producer legs saved (our
``narwhal_disaggregation_decisions_total``: ``local_short`` and ``local_busy`` of all
decisions; "—" for the peers and for a router without the counter); KV transferred (summed
over d0 and d1: transfers, the change of ``vllm:nixl_xfer_time_seconds_count``, and MiB, of
``vllm:nixl_bytes_transferred_sum``, "—" where the engines do not export it); the prefix
cache hit rate of producers and of consumers apart.

The cache pressure table has the conditional columns with TTFT p90, the hit rate of all
four engines together, and how many of our router's KV-event streams were live at the end
(``/narwhal/engines``; events it refused in brackets). Its targets: the precise index's TTFT
p90 at most 0.5x the approximate one's, its hit rate at least 15 points higher.

The lora adapters table: TTFT p50/p99 over all requests and per served name, each engine's
adapter swaps (the change of ``lora_swaps`` in its ``GET /fake/stats`` over the measured
phase: a load that evicted the other adapter) and their sum against affinity off's in the
same run, each engine's loads by adapter, the peak waiting queues (requests waiting for
the slot count there, as in vLLM), and our router's mean wait in its admission queue
(``narwhal_queue_wait_seconds``: an engine whose waiting queue reaches
``engine_waiting_limit`` is saturated). Its target: adapter affinity's swaps at most 0.5x
affinity off's at a TTFT p99 no worse.

Nothing is asserted: the machine is shared and noisy; the issues' targets are checked on
this run's figures and printed: for the conditional workloads, each ``conditional N``
against always-P/D: chat TTFT p50 at least 40% lower and p99 no worse; short prompts' TTFT
p50 at least 30% lower and long prompts' p99 within 1.05x; ITL p99 within 1.10x in both.
Figures: bench/placement_plot.py draws one panel per workload (TTFT p50 and p99; ITL p99
too for the conditional ones, and for short prompts the short p50 and the long p99).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio
from peers import (
    MODEL,
    Proc,
    Result,
    engines_toml,
    fmt,
    launch_narwhal07,
    launch_vllm_router,
    one_request,
    pct,
    plot,
    prefill_leg,
    serve_narwhal,
    start_fake_fleet,
)
from stream_client import Outcome, stream_request

from narwhal.core.faults import EngineFault
from narwhal.engines.transport import Pool, tcp_connect

OUTPUT_TOKENS = 16
RATE = 8.0  # requests per second: what this shared 2-core machine drives without being the limit
REQUEST_TIMEOUT_S = 60.0  # a request not done by then is a failure ("timeout")
PRODUCER = ["--slots", "4", "--prefill-ms-per-token", "0.2", "--prefix-cache-blocks", "480"]
CONSUMER = ["--slots", "16", "--itl-s", "0.005"]
# the conditional workloads' consumers compute short prompts themselves: a prefix cache, a
# prefill cost, a KV pull cost per 16-token block they do not hold, and the slowdown a
# local prefill inflicts on their running decodes
CONSUMER_COST = (
    ("--prefix-cache-blocks", "2048"),
    ("--prefill-ms-per-token", "0.2"),
    ("--kv-ms-per-block", "0.5"),
    # a remote prefill's KV is loaded asynchronously and the request is scheduled at the
    # consumer's next step: about one decode step (5 ms) more than a local prefill
    ("--kv-pull-ms", "5"),
    ("--prefill-interference", "0.5"),
)
CHAT, SHORT = "multi-turn chat", "short prompts"  # the conditional workloads' names
PRESSURE = "cache pressure"  # the precise prefix index against the approximate one
LOCAL_THRESHOLDS = (64, 256, 1024)  # [placement] local_prefill_tokens of our conditional targets
CHAT_CONVERSATIONS, CHAT_TURNS, CHAT_PER_SYSTEM = 32, 6, 8
CHAT_SYSTEM_WORDS, CHAT_USER_WORDS, CHAT_REPLY_TOKENS = 1500, 50, 100
CHAT_START_RATE = 1.0  # conversations per second (Poisson): about 6 turns/s at the peak
THINK_S = (0.25, 0.75)  # a user's pause between a reply and the next turn (uniform)
SHORT_OUTPUT_TOKENS = 64  # long enough that local prefills land on running decodes
SHORT_SHARE, SHORT_WORDS, LONG_WORDS = 0.7, (20, 99), (2001, 2600)
FLEET = [  # (name, role, slowdown)
    ("p0", "prefill", 1.0),
    ("p1", "prefill", 2.0),
    ("d0", "decode", 1.0),
    ("d1", "decode", 2.0),
]
SYSTEM_PROMPTS, SYSTEM_WORDS, QUESTION_WORDS = 8, 1500, 40
# cache pressure: many long system prompts under Zipf popularity, caches a third of the
# working set, every engine publishing its KV events (see the docstring)
PRESSURE_SYSTEMS, PRESSURE_SYSTEM_WORDS, PRESSURE_ZIPF = 24, (1000, 1500), 1.0
PRESSURE_CONVERSATIONS, PRESSURE_TURNS, PRESSURE_START_RATE = 90, 3, 3.0
PRESSURE_THINK_S = THINK_S  # the pause before the next turn (uniform)
PRESSURE_LOCAL_TOKENS = 256  # both of our targets' [placement] local_prefill_tokens
PRESSURE_CACHE_SHARE = 1 / 3  # of the working set, in every engine's prefix cache
KV_EVENTS_ARGS = ("--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0")
KV_SUBSCRIBE = '[kv_events]\nmode = "subscribe"\n'  # our precise targets' fleet-file section
# lora adapters: two adapters of the base model on every engine, one slot each (see the
# docstring); the requests' served names and their shares
LORA = "lora adapters"
HOT, COLD = "hot", "cold"
LORA_MIX = ((HOT, 0.72), (COLD, 0.18), (MODEL, 0.10))
LORA_SWAP_MS = 50  # an adapter's load into the slot (a rank-16 adapter from the CPU cache)
LORA_ARGS = (
    "--models",
    f"{MODEL},{HOT}:{MODEL},{COLD}:{MODEL}",
    "--max-loras",
    "1",
    "--lora-swap-ms",
    str(LORA_SWAP_MS),
)
LORA_WORDS, LORA_OUTPUT_TOKENS = 1000, 64  # long enough that adapters run when scraped
LORA_INTERVAL_S = 0.25  # our targets' metrics_interval_s: vllm:lora_requests_info 4 times a second
SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", re.M)  # summed by name
DECISIONS = re.compile(
    r'^narwhal_placement_decisions_total\{leg="(\w+)",reason="(\w+)"\} (\S+)$', re.M
)
# decode first (contract 4.4): local_short and local_busy are producer legs saved
DISAGGREGATION = re.compile(
    r'^narwhal_disaggregation_decisions_total\{[^}]*decision="(\w+)"[^}]*\} (\S+)$', re.M
)
WAITING = re.compile(r"^vllm:num_requests_waiting(?:\{[^}]*\})? (\S+)$", re.M)
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PULLS, KV_BYTES = "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum"


# ---- workloads -------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    """Another tenant's prefills straight to one producer, from ``start_s`` to ``end_s``."""

    engine: str  # a name of FLEET
    workers: int  # closed loop: each sends its next prefill when the last one is done
    words: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Workload:
    """Open loop: requests on /v1/completions at seeded Poisson arrivals."""

    name: str
    rate: float  # arrivals per second (Poisson)
    requests: int
    prompt: Callable[[random.Random, int], str]
    tenant: Tenant | None = None
    max_tokens: int = OUTPUT_TOKENS
    # the conditional-disaggregation workloads: consumers with a prefill cost and a prefix
    # cache, the conditional targets, the stream client and the columns that judge them
    conditional: bool = False
    # lora adapters: each request's served name drawn by these shares (empty: MODEL alone),
    # and every engine serving the adapters with one slot (LORA_ARGS)
    models: tuple[tuple[str, float], ...] = ()

    def schedule(self, seed: int) -> list[tuple[float, bytes, str]]:
        """(arrival in seconds from the start, request body, its class: "short", "long",
        the served name with ``models``, or ""), the same for every target."""
        rng = random.Random(seed)
        at, out = 0.0, []
        names, shares = [n for n, _ in self.models], [w for _, w in self.models]
        for i in range(self.requests):
            model = rng.choices(names, shares)[0] if self.models else MODEL
            prompt = self.prompt(rng, i)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "stream": True,
                "temperature": 0,
            }
            kind = model if self.models else prompt_class(self, prompt)
            out.append((at, msgspec.json.encode(body), kind))
            at += rng.expovariate(self.rate)
        return out


def prompt_class(workload: Workload, prompt: str) -> str:
    """The short-prompts workload reports its short and long prompts apart."""
    if workload.prompt is not short_or_long_prompt:
        return ""
    return "short" if prompt.count(" ") + 1 <= SHORT_WORDS[1] else "long"


@dataclass(frozen=True)
class Conversation:
    start_s: float  # its first turn's arrival, from the start
    system: str
    users: tuple[str, ...]  # each turn's user message
    thinks: tuple[float, ...]  # the pause after each turn's reply


@dataclass(frozen=True)
class ChatWorkload:
    """Closed loop per conversation: a turn is sent when the previous reply has arrived
    (and the user has thought), with that reply in its messages; seeded Poisson starts."""

    name: str
    conversations: int
    turns: int
    start_rate: float
    conditional: bool = True
    tenant: Tenant | None = None
    # cache pressure: the system prompts drawn per conversation by Zipf popularity (empty:
    # CHAT_SYSTEM, one per CHAT_PER_SYSTEM conversations in order), every engine's prefix
    # cache (0: the usual sizes) and the engines' KV events
    systems: tuple[str, ...] = ()
    zipf: float = 0.0
    cache_blocks: int = 0
    kv_events: bool = False
    think_s: tuple[float, float] = THINK_S  # the pause after each reply (uniform)

    def plan(self, seed: int) -> list[Conversation]:
        """Every conversation's start, system prompt, user messages and pauses; the
        replies are the engines' (a function of the prompt's text, the same for every
        target as long as the router passes the messages through)."""
        rng = random.Random(seed)
        popularity = [1 / (k + 1) ** self.zipf for k in range(len(self.systems))]
        at, out = 0.0, []
        for c in range(self.conversations):
            users = tuple(words(rng, CHAT_USER_WORDS, f"c{c}u{n}") for n in range(self.turns))
            thinks = tuple(rng.uniform(*self.think_s) for _ in range(self.turns))
            if self.systems:
                system = rng.choices(self.systems, popularity)[0]
            else:
                system = CHAT_SYSTEM[(c // CHAT_PER_SYSTEM) % len(CHAT_SYSTEM)]
            out.append(Conversation(at, system, users, thinks))
            at += rng.expovariate(self.start_rate)
        return out


def words(rng: random.Random, count: int, tag: str) -> str:
    """``count`` words no other prompt shares from its first block on (``tag`` leads)."""
    return " ".join([tag, *(f"w{rng.randrange(1 << 20):x}" for _ in range(count - 1))])


SYSTEM = [" ".join(f"s{k}t{i % 97}" for i in range(SYSTEM_WORDS)) for k in range(SYSTEM_PROMPTS)]


def uniform_prompt(rng: random.Random, i: int) -> str:
    return words(rng, 200, f"u{i}")


def shared_prompt(rng: random.Random, i: int) -> str:
    if rng.random() < 0.8:
        return SYSTEM[rng.randrange(SYSTEM_PROMPTS)] + " " + words(rng, QUESTION_WORDS, f"q{i}")
    return words(rng, 300, f"x{i}")


CHAT_SYSTEM = [
    " ".join(f"c{k}s{i % 89}" for i in range(CHAT_SYSTEM_WORDS))
    for k in range(CHAT_CONVERSATIONS // CHAT_PER_SYSTEM)
]


def pressure_systems() -> tuple[str, ...]:
    """PRESSURE_SYSTEMS system prompts of 1,000-1,500 words (a fixed seed: the same texts
    in every run), each from its first block on its own."""
    rng = random.Random(PRESSURE_SYSTEMS)
    return tuple(
        " ".join(f"z{k}t{i % 89}" for i in range(rng.randint(*PRESSURE_SYSTEM_WORDS)))
        for k in range(PRESSURE_SYSTEMS)
    )


def pressure_cache_blocks(systems: tuple[str, ...]) -> int:
    """PRESSURE_CACHE_SHARE of the working set, in 16-token blocks: every system prompt,
    and the conversations in flight at once (about the start rate x a conversation's
    length, PRESSURE_TURNS turns of a reply and a pause) each with its own turns (user
    messages and replies, four framing tokens a message). The same with ``--quick``."""
    system_blocks = sum(s.count(" ") + 1 for s in systems) // 16
    # a turn: its first token, its reply, the user's pause
    turn_s = 0.2 + CHAT_REPLY_TOKENS * 0.005 + sum(PRESSURE_THINK_S) / 2
    in_flight = PRESSURE_START_RATE * PRESSURE_TURNS * turn_s
    own_blocks = PRESSURE_TURNS * (CHAT_USER_WORDS + CHAT_REPLY_TOKENS + 8) // 16
    return round(PRESSURE_CACHE_SHARE * (system_blocks + in_flight * own_blocks))


def lora_prompt(rng: random.Random, i: int) -> str:
    """A unique LORA_WORDS-token prompt: nothing cached, so only the adapters differ."""
    return words(rng, LORA_WORDS, f"l{i}")


def short_or_long_prompt(rng: random.Random, i: int) -> str:
    """Unique prompts: 70% of 20-99 tokens, 30% of 2,001-2,600 (nothing cached)."""
    low, high = SHORT_WORDS if rng.random() < SHORT_SHARE else LONG_WORDS
    return words(rng, rng.randint(low, high), f"p{i}")


def workloads(quick: bool) -> list[Workload | ChatWorkload]:
    scale = 1 / 3 if quick else 1.0
    count = int(RATE * 30 * scale)  # 30 s of arrivals per workload (10 s with --quick)
    # --quick: half the conversations (two system prompts), every turn
    chats = CHAT_CONVERSATIONS // 2 if quick else CHAT_CONVERSATIONS
    pressure = PRESSURE_CONVERSATIONS // 2 if quick else PRESSURE_CONVERSATIONS
    systems = pressure_systems()
    return [
        Workload("uniform", RATE, count, uniform_prompt),
        Workload("shared-prefix", RATE, count, shared_prompt),
        Workload(
            "burst",
            RATE,
            count,
            uniform_prompt,
            Tenant("p0", 12, 2000, 5 * scale, 25 * scale),
        ),
        # appended: the three above keep their place, so their seeds and rows stay as before
        ChatWorkload(CHAT, chats, CHAT_TURNS, CHAT_START_RATE),
        Workload(
            SHORT,
            RATE,
            count,
            short_or_long_prompt,
            max_tokens=SHORT_OUTPUT_TOKENS,
            conditional=True,
        ),
        ChatWorkload(
            PRESSURE,
            pressure,
            PRESSURE_TURNS,
            PRESSURE_START_RATE,
            systems=systems,
            zipf=PRESSURE_ZIPF,
            cache_blocks=pressure_cache_blocks(systems),
            kv_events=True,
            think_s=PRESSURE_THINK_S,
        ),
        Workload(
            LORA,
            RATE,
            count,
            lora_prompt,
            max_tokens=LORA_OUTPUT_TOKENS,
            models=LORA_MIX,
        ),
    ]


# ---- targets ---------------------------------------------------------------------------

Start = Callable[[list[str], list[str], Path], tuple[Proc, str]]


PLACEMENT_KEYS: list[str] = []  # --set: more [placement] lines for every target of ours
ADMISSION_KEYS: list[str] = []  # --set admission.KEY=VALUE: [admission] lines for ours


def ours(
    policy: str, affinity: bool, interval_s: float = 1.0, *keys: str, precise: bool = False
) -> Start:
    """Our router with these [placement] settings (``keys``: more lines of it); with
    ``precise``, ``[kv_events] mode = "subscribe"`` too (the engines must publish)."""

    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        lines = [f"metrics_interval_s = {interval_s}", *keys, *PLACEMENT_KEYS]
        extra = "".join(f"{line}\n" for line in lines) + (KV_SUBSCRIBE if precise else "")
        if ADMISSION_KEYS:
            extra += "[admission]\n" + "".join(f"{line}\n" for line in ADMISSION_KEYS)
        return serve_narwhal(
            f'model = "{MODEL}"\n' + engines_toml(prefills, decodes) + "[serving]\n"
            "max_inflight = 20000\n"
            # the peers have no first-token timeout: measure placement, not our 2.5 s default
            "[engine]\nfirst_token_timeout_s = 120.0\n"
            f'[placement]\npolicy = "{policy}"\nprefix_affinity = {str(affinity).lower()}\n'
            + extra,
            tmp,
        )

    return start


def vllm_router(policy: str) -> Start:
    def start(prefills: list[str], decodes: list[str], tmp: Path) -> tuple[Proc, str]:
        return launch_vllm_router(prefills, decodes, tmp, ("--policy", policy))

    return start


PRECISE = " precise"  # --kv-events: the suffix of our targets' twins that read KV events


def targets(kv_events: bool) -> list[tuple[str, Start]]:
    """The first three workloads' targets; with ``kv_events`` (``--kv-events``) each of
    ours that places by prefix has a twin right after it, the same with the precise
    index."""
    out: list[tuple[str, Start]] = [
        ("round_robin", ours("round_robin", False)),
        ("least_loaded", ours("least_loaded", False)),
    ]
    # the scrape's lag decides who meets a sudden burst first: the same at 4 scrapes a second
    for name, interval_s in (("least_loaded+affinity", 1.0), ("least_loaded+affinity 0.25s", 0.25)):
        out.append((name, ours("least_loaded", True, interval_s)))
        if kv_events:
            out.append((name + PRECISE, ours("least_loaded", True, interval_s, precise=True)))
    return [
        *out,
        ("vllm-router cache_aware", vllm_router("cache_aware")),
        ("vllm-router power_of_two", vllm_router("power_of_two")),
        ("narwhal-0.7", launch_narwhal07),
    ]


ALWAYS_PD = "always-P/D"


def conditional_targets(thresholds: tuple[int, ...], kv_events: bool) -> list[tuple[str, Start]]:
    """The conditional workloads' targets: our default (every request disaggregated, as
    ``local_prefill_tokens = 0`` leaves it, unset so that a router without the key runs),
    ours deciding by the consumer's uncached tokens at each threshold, and the peers; with
    ``kv_events``, each of ours followed by its precise twin."""
    out = []
    for name, keys in (
        (ALWAYS_PD, ()),
        *((f"conditional {n}", (f"local_prefill_tokens = {n}",)) for n in thresholds),
    ):
        out.append((name, ours("least_loaded", True, 1.0, *keys)))
        if kv_events:
            out.append((name + PRECISE, ours("least_loaded", True, 1.0, *keys, precise=True)))
    return [
        *out,
        ("vllm-router cache_aware", vllm_router("cache_aware")),
        ("narwhal-0.7", launch_narwhal07),
    ]


NARWHAL_PRECISE, NARWHAL_APPROXIMATE = "narwhal precise", "narwhal approximate"


def pressure_targets() -> list[tuple[str, Start]]:
    """The cache pressure workload's targets: ours deciding conditional disaggregation at
    PRESSURE_LOCAL_TOKENS with the precise index and with the approximate one (otherwise
    the same), and vllm-router's cache-aware policy."""
    local = f"local_prefill_tokens = {PRESSURE_LOCAL_TOKENS}"
    return [
        (NARWHAL_PRECISE, ours("least_loaded", True, 1.0, local, precise=True)),
        (NARWHAL_APPROXIMATE, ours("least_loaded", True, 1.0, local)),
        ("vllm-router cache_aware", vllm_router("cache_aware")),
    ]


ADAPTER_ON, ADAPTER_OFF = "adapter affinity", "adapter affinity off"


def lora_targets() -> list[tuple[str, Start]]:
    """The lora adapters workload's targets: ours (least_loaded and prefix affinity, the
    defaults, scraping every LORA_INTERVAL_S) with adapter affinity (the default) and
    without, and vllm-router's cache-aware policy (it does not route by model: every
    engine serves every name, so any placement works, at the swaps it costs)."""
    return [
        (ADAPTER_ON, ours("least_loaded", True, LORA_INTERVAL_S)),
        (ADAPTER_OFF, ours("least_loaded", True, LORA_INTERVAL_S, "adapter_affinity = false")),
        ("vllm-router cache_aware", vllm_router("cache_aware")),
    ]


# ---- one run ---------------------------------------------------------------------------


@dataclass
class Run(Result):
    """One (workload, target) run: ``scenario`` is the workload; ``ttft``, ``ok``,
    ``failed``, ``errors`` as in bench/peers.py."""

    hit_rate: float | None = None
    prefill_share: dict[str, float] = field(default_factory=dict)  # of prompt tokens
    tenant_done: int = 0
    placements: dict[str, float] = field(default_factory=dict)  # ours: decisions by reason
    peak_waiting: dict[str, float] = field(default_factory=dict)  # each engine's, sampled
    slowest: list[tuple[int, float]] = field(default_factory=list)  # (TTFT ms, arrival s)
    load_avg: float | None = None  # the machine's, over the last minute, at the run's end
    # the conditional workloads' figures (see the docstring)
    conditional: bool = False
    ttft_by: dict[str, list[float]] = field(default_factory=dict)  # by prompt class
    gaps: list[float] = field(default_factory=list)  # s between token reads, all requests
    hit_rate_consumers: float | None = None
    kv_pulls: float | None = None  # the consumers' KV transfers
    kv_bytes: float | None = None  # None: the engines do not export it
    disaggregation: dict[str, float] | None = None  # ours: this run's decisions by kind
    hit_rate_all: float | None = None  # every engine's, producers and consumers together
    # ours: engines whose KV-event stream was live at the run's end, of those followed, and
    # the events the router refused; None from a router without the precise index
    kv_live: tuple[int, int] | None = None
    kv_rejected: float | None = None
    # lora adapters: each engine's adapter swaps and loads (by adapter) in the measured
    # phase, from its /fake/stats; None for the other workloads
    lora_swaps: dict[str, float] | None = None
    lora_loads: dict[str, dict[str, float]] | None = None
    # ours: requests dispatched from the admission queue and their summed wait there
    queue_wait: tuple[float, float] | None = None

    def legs_saved(self) -> tuple[float, float] | None:
        """(producer legs saved, requests decided), from our router's counter."""
        if not self.disaggregation:
            return None
        saved = sum(v for k, v in self.disaggregation.items() if k.startswith("local"))
        return saved, sum(self.disaggregation.values())

    def summary(self) -> dict[str, Any]:
        saved = self.legs_saved()
        return {
            "workload": self.scenario,
            "target": self.target,
            "ttft_p50_ms": _ms(pct(self.ttft, 0.5)),
            "ttft_p90_ms": _ms(pct(self.ttft, 0.9)),
            "ttft_p99_ms": _ms(pct(self.ttft, 0.99)),
            "req_per_s": round(self.ok / self.wall_s, 2) if self.wall_s else None,
            "hit_rate": _rate(self.hit_rate),
            "conditional": self.conditional,
            "ttft_short_p50_ms": _ms(pct(self.ttft_by.get("short", []), 0.5)),
            "ttft_long_p99_ms": _ms(pct(self.ttft_by.get("long", []), 0.99)),
            "itl_p99_ms": _ms(pct(self.gaps, 0.99)),
            "hit_rate_consumers": _rate(self.hit_rate_consumers),
            "hit_rate_all": _rate(self.hit_rate_all),
            "kv_live": None if self.kv_live is None else list(self.kv_live),
            "lora_swaps": self.lora_swaps,
            "lora_swaps_total": None if self.lora_swaps is None else sum(self.lora_swaps.values()),
            "lora_loads": self.lora_loads,
            "queue_wait_mean_ms": None
            if not self.queue_wait or not self.queue_wait[0]
            else round(1000 * self.queue_wait[1] / self.queue_wait[0], 1),
            # lora adapters: TTFT p50/p99 and completed requests by served name
            "ttft_by_model_ms": {
                k: {"p50": _ms(pct(v, 0.5)), "p99": _ms(pct(v, 0.99)), "n": len(v)}
                for k, v in sorted(self.ttft_by.items())
            }
            if self.lora_swaps is not None
            else None,
            "kv_rejected": self.kv_rejected,
            "kv_pulls": self.kv_pulls,
            "kv_mib": None if self.kv_bytes is None else round(self.kv_bytes / 2**20, 2),
            "legs_saved": None if saved is None else saved[0],
            "legs_decided": None if saved is None else saved[1],
            "disaggregation": self.disaggregation,
            "prefill_share": self.prefill_share,
            "ok": self.ok,
            "failed": self.failed,
            "tenant_prefills": self.tenant_done,
            "placements": self.placements,
            "peak_waiting": self.peak_waiting,
            "slowest": self.slowest,
            "load_avg": self.load_avg,
            "errors": self.errors,
            "note": self.note,
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _rate(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return str(resp.read().decode())


def counters(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Each engine's /metrics, every sample of a name summed (a counter's label sets)."""
    out = {}
    for name, url in urls.items():
        found: dict[str, float] = {}
        for m in SAMPLE.finditer(get(url, "/metrics")):
            found[m[1]] = found.get(m[1], 0.0) + float(m[2])
        out[name] = found
    return out


def adapter_stats(urls: dict[str, str]) -> dict[str, tuple[float, dict[str, float]]]:
    """Each engine's adapter swaps and loads by adapter, from its ``GET /fake/stats``."""
    out = {}
    for name, url in urls.items():
        stats = json.loads(get(url, "/fake/stats"))
        loads = {k: float(v) for k, v in stats.get("lora_loads", {}).items()}
        out[name] = (float(stats.get("lora_swaps", 0)), loads)
    return out


def adapter_tally(
    run: Run,
    before: dict[str, tuple[float, dict[str, float]]],
    after: dict[str, tuple[float, dict[str, float]]],
) -> None:
    """The measured phase's swaps and loads on each engine (the warm-up's taken out)."""
    run.lora_swaps = {n: after[n][0] - before[n][0] for n in after}
    run.lora_loads = {
        n: {k: v - before[n][1].get(k, 0.0) for k, v in sorted(after[n][1].items())} for n in after
    }


QUEUE_WAIT = re.compile(r"^narwhal_queue_wait_seconds_(count|sum)(?:\{[^}]*\})? (\S+)$", re.M)


def queue_wait(url: str) -> tuple[float, float] | None:
    """Our router's admission queue: (requests that left it, seconds they waited there),
    summed over classes and models; None from a router without it (the peers)."""
    try:
        text = get(url, "/metrics")
    except OSError:
        return None
    found = {"count": 0.0, "sum": 0.0}
    for m in QUEUE_WAIT.finditer(text):
        found[m[1]] += float(m[2])
    return (found["count"], found["sum"]) if "narwhal_queue_wait_seconds" in text else None


def disaggregation(url: str) -> dict[str, float] | None:
    """Our router's decode-first decisions by kind; None from a router without them (the
    peers, or ours before conditional disaggregation)."""
    try:
        text = get(url, "/metrics")
    except OSError:
        return None
    found: dict[str, float] = {}
    for m in DISAGGREGATION.finditer(text):
        found[m[1]] = found.get(m[1], 0.0) + float(m[2])
    return found or None


def placements(url: str) -> dict[str, float]:
    """Our router's placement decisions by leg and reason (nothing from the peers)."""
    try:
        text = get(url, "/metrics")
    except OSError:  # vllm-router answers 405 on /metrics, Narwhal 0.7 has its own
        return {}
    found = ((f"{m[1]}/{m[2]}", float(m[3])) for m in DECISIONS.finditer(text))
    return {key: value for key, value in found if value}


REJECTED = re.compile(r"^narwhal_kv_events_rejected_total(?:\{[^}]*\})? (\S+)$", re.M)


def kv_streams(url: str) -> tuple[tuple[int, int] | None, float | None]:
    """Our router's KV-event streams: (live, followed) from ``/narwhal/engines``, and the
    events it refused; (None, None) from a router without them (the peers) or with the
    precise index off (no stream is followed: every state ``unknown``, no batch read)."""
    try:
        engines = json.loads(get(url, "/narwhal/engines"))
        text = get(url, "/metrics")
    except (OSError, ValueError):
        return None, None
    if isinstance(engines, dict):
        engines = engines.get("engines", [])
    # the mode off: each engine's ``kv_events`` is null
    states = [e["kv_events"] for e in engines if isinstance(e, dict) and e.get("kv_events")]
    if not any(s.get("batches") for s in states):
        return None, None
    live = sum(s.get("state") == "live" for s in states)
    return (live, len(states)), sum(float(m[1]) for m in REJECTED.finditer(text))


def pool_for(url: str, width: int = 1024) -> Pool:
    return Pool(url, tcp_connect, 60.0, width)


async def tenant_loop(tenant: Tenant, url: str, run: Run, t0: float, seed: int) -> None:
    """The other tenant: prefills (``max_tokens`` 1, ``do_remote_decode``) straight to
    ``url``, as another router's prefill legs; unique prompts, so nothing is cached."""
    pool = pool_for(url, tenant.workers + 2)
    rng = random.Random(seed)
    await trio.sleep_until(t0 + tenant.start_s)

    async def worker(w: int) -> None:
        n = 0
        while trio.current_time() < t0 + tenant.end_s and n < 10_000:  # bounded
            n += 1
            body = {"model": MODEL, "prompt": words(rng, tenant.words, f"t{w}n{n}")}
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                await prefill_leg(pool, body)
                run.tenant_done += 1

    async with trio.open_nursery() as nursery:
        for w in range(tenant.workers):
            nursery.start_soon(worker, w)


async def sample_queues(engines: dict[str, str], run: Run) -> None:
    """Each engine's ``vllm:num_requests_waiting`` every 0.5 s; the peak is kept."""
    while True:  # cancelled with the run
        for name, url in engines.items():
            text = await trio.to_thread.run_sync(get, url, "/metrics")
            found = WAITING.search(text)
            if found:
                value = float(found.group(1))
                run.peak_waiting[name] = max(run.peak_waiting.get(name, 0.0), value)
        await trio.sleep(0.5)


Request = Callable[[Pool, bytes], Awaitable[Outcome]]


async def plain(pool: Pool, body: bytes) -> Outcome:
    """The first three workloads' request: only the first ``data: {`` is timed, as before."""
    failure, first, _ = await one_request(pool, body)
    return Outcome(failure, first)


async def streamed(pool: Pool, body: bytes) -> Outcome:
    """The short-prompts workload's request: token reads timed (ITL), text kept."""
    return await stream_request(pool, b"/v1/completions", body)


async def attempt(request: Request, pool: Pool, body: bytes) -> Outcome:
    """One request bounded by REQUEST_TIMEOUT_S; a transport failure is its outcome."""
    with trio.move_on_after(REQUEST_TIMEOUT_S):
        try:
            return await request(pool, body)
        except EngineFault as exc:
            return Outcome(failure=type(exc).__name__)
    return Outcome(failure="timeout")


def record(run: Run, outcome: Outcome, at: float, kind: str) -> None:
    """Count one request's outcome; ``at``: when it was sent; ``kind``: its prompt class."""
    if outcome.failure is not None:
        run.failed += 1
        run.errors[outcome.failure] = run.errors.get(outcome.failure, 0) + 1
        return
    run.ok += 1
    run.gaps += outcome.gaps
    if outcome.ttft is None:
        return
    run.ttft.append(outcome.ttft)
    if kind:
        run.ttft_by.setdefault(kind, []).append(outcome.ttft)
    run.slowest = sorted([*run.slowest, (round(outcome.ttft * 1000), round(at, 2))])[-8:]


async def replay(
    schedule: list[tuple[float, bytes, str]],
    url: str,
    run: Run,
    tenant: tuple[Tenant, str] | None,
    engines: dict[str, str],
    request: Request = plain,
) -> None:
    """Send every request at its time (open loop), each bounded by REQUEST_TIMEOUT_S."""
    pool = pool_for(url)
    last_done = 0.0

    async def send(at: float, body: bytes, kind: str) -> None:
        nonlocal last_done
        record(run, await attempt(request, pool, body), at, kind)
        last_done = trio.current_time()

    t0 = trio.current_time()
    limit = schedule[-1][0] + REQUEST_TIMEOUT_S + 30
    with trio.fail_after(limit):
        async with trio.open_nursery() as outer:
            outer.start_soon(sample_queues, engines, run)
            async with trio.open_nursery() as nursery:
                if tenant is not None:
                    nursery.start_soon(tenant_loop, tenant[0], tenant[1], run, t0, len(schedule))
                for at, body, kind in schedule:
                    await trio.sleep_until(t0 + at)
                    nursery.start_soon(send, at, body, kind)
            outer.cancel_scope.cancel()
    run.wall_s = last_done - t0


def chat_body(messages: list[dict[str, str]]) -> bytes:
    return msgspec.json.encode(
        {
            "model": MODEL,
            "messages": messages,
            "max_tokens": CHAT_REPLY_TOKENS,
            "stream": True,
            "temperature": 0,
        }
    )


async def chat_request(pool: Pool, body: bytes) -> Outcome:
    return await stream_request(pool, b"/v1/chat/completions", body)


async def converse(plan: list[Conversation], url: str, run: Run, engines: dict[str, str]) -> None:
    """Every conversation from its start, each turn after the last one's reply (closed
    loop); the whole run bounded by its turns' timeouts and pauses."""
    pool = pool_for(url)
    t0 = trio.current_time()
    last_done = t0

    async def talk(conv: Conversation) -> None:
        nonlocal last_done
        await trio.sleep_until(t0 + conv.start_s)
        messages = [{"role": "system", "content": conv.system}]
        for n, (user, think) in enumerate(zip(conv.users, conv.thinks, strict=True)):
            messages.append({"role": "user", "content": user})
            sent = trio.current_time() - t0
            outcome = await attempt(chat_request, pool, chat_body(messages))
            record(run, outcome, sent, "")
            last_done = trio.current_time()
            if outcome.failure is not None:  # no reply to carry on with
                left = len(conv.users) - n - 1
                if left:
                    why = "not sent: an earlier turn failed"
                    run.failed += left
                    run.errors[why] = run.errors.get(why, 0) + left
                return
            # the next turn carries the reply exactly as this client received it
            messages.append({"role": "assistant", "content": outcome.text})
            if n + 1 < len(conv.users):
                await trio.sleep(think)

    turns = max(len(c.users) for c in plan)
    pause = max(t for c in plan for t in c.thinks)
    limit = plan[-1].start_s + turns * (REQUEST_TIMEOUT_S + pause) + 30
    with trio.move_on_after(limit) as scope:
        async with trio.open_nursery() as outer:
            outer.start_soon(sample_queues, engines, run)
            async with trio.open_nursery() as nursery:
                for conv in plan:
                    nursery.start_soon(talk, conv)
            outer.cancel_scope.cancel()
    if scope.cancelled_caught:
        run.note = f"cut at {limit:.0f} s"
    run.wall_s = last_done - t0


def warm_up(url: str, kv_events: bool = False) -> None:
    """A few short requests through the target (connections, first scrapes); prompts
    shorter than a block, so no cache is touched. With ``kv_events`` each is one unique
    block and a word (an engine publishes only full blocks): every engine a request lands
    on publishes a batch, and a router that subscribes sees its stream live before the
    measured phase; 8 blocks, the same for every target."""

    def body(n: int) -> bytes:
        prompt = words(random.Random(n), 17, f"warm{n}") if kv_events else "warm up"
        return msgspec.json.encode(
            {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        )

    async def main() -> None:
        pool = pool_for(url, 8)
        with trio.fail_after(60):
            for n in range(8):
                await one_request(pool, body(n))

    trio.run(main)
    time.sleep(1.5)  # a scrape of every engine has landed (our metrics_interval_s is 1 s)


def consumer_cost() -> list[str]:
    """CONSUMER_COST as command-line arguments."""
    return [arg for pair in CONSUMER_COST for arg in pair]


def start_fleet(
    tmp: Path,
    conditional: bool = False,
    cache_blocks: int = 0,
    kv_events: bool = False,
    lora: bool = False,
) -> tuple[list[Proc], dict[str, str]]:
    """The fake fleet, fresh; ``cache_blocks``: every engine's prefix cache (0: the usual
    sizes); ``kv_events``: every engine publishes its KV events (on ephemeral loopback
    ports its ``/kv_event_sources`` names); ``lora``: every engine serves the two
    adapters too, with one adapter slot (LORA_ARGS)."""
    # the first three workloads keep the old consumers, so their rows stay comparable
    consumer = [*CONSUMER, *consumer_cost()] if conditional else CONSUMER
    extra = [*KV_EVENTS_ARGS] if kv_events else []
    if lora:
        extra += LORA_ARGS
    if cache_blocks:  # the last --prefix-cache-blocks of a command line wins
        extra += ["--prefix-cache-blocks", str(cache_blocks)]
    return start_fake_fleet(
        [
            (
                name,
                role,
                [*(PRODUCER if role == "prefill" else consumer), "--slowdown", str(slow), *extra],
            )
            for name, role, slow in FLEET
        ],
        tmp,
    )


def of_role(role: str) -> list[str]:
    return [n for n, r, _ in FLEET if r == role]


def not_measured(exc: BaseException) -> str:
    """A row's note for a target that did not start: the line that says why when there is
    one (a fleet file's unknown [placement] key: a router without that feature yet)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    why = next((line for line in lines if "unknown key" in line), " ".join(lines))
    return f"not measured: {why}"[:200]


def play(
    workload: Workload | ChatWorkload, seed: int, url: str, run: Run, urls: dict[str, str]
) -> None:
    """The workload's measured phase through the target at ``url``."""
    if isinstance(workload, ChatWorkload):
        trio.run(converse, workload.plan(seed), url, run, urls)
        return
    tenant = None if workload.tenant is None else (workload.tenant, urls[workload.tenant.engine])
    request = streamed if workload.conditional else plain
    trio.run(replay, workload.schedule(seed), url, run, tenant, urls, request)


KV_EVENTS_EVERYWHERE: list[bool] = []  # --kv-events: every workload's engines publish


def measure(
    workload: Workload | ChatWorkload, target: str, start: Start, tmp: Path, seed: int
) -> Run:
    run = Run(target, workload.name, conditional=workload.conditional)
    blocks = workload.cache_blocks if isinstance(workload, ChatWorkload) else 0
    events = bool(KV_EVENTS_EVERYWHERE) or getattr(workload, "kv_events", False)
    lora = bool(getattr(workload, "models", ()))
    engines, urls = start_fleet(tmp, workload.conditional, blocks, events, lora)
    try:
        try:
            proc, url = start(
                [urls[n] for n in of_role("prefill")], [urls[n] for n in of_role("decode")], tmp
            )
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            run.note = not_measured(exc)
            return run
        try:
            warm_up(url, events)
            before, decided = counters(urls), disaggregation(url)
            adapters = adapter_stats(urls) if lora else {}
            waited = queue_wait(url) if lora else None
            play(workload, seed, url, run, urls)
            after = counters(urls)
            if lora:
                adapter_tally(run, adapters, adapter_stats(urls))
                now = queue_wait(url)
                if now is not None and waited is not None:
                    run.queue_wait = (now[0] - waited[0], now[1] - waited[1])
            run.placements = placements(url)
            run.kv_live, run.kv_rejected = kv_streams(url)
            run.disaggregation = since(decided, disaggregation(url))
        finally:
            proc.stop()
    finally:
        for engine in engines:
            engine.stop()
    tally(run, workload.tenant, before, after)
    run.load_avg = round(os.getloadavg()[0], 1)
    return run


def since(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float] | None:
    """The decisions of the measured phase (the warm-up's taken out)."""
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}


def hit_rate(delta: dict[str, dict[str, float]], names: list[str]) -> float | None:
    """Prefix-cache hits over queries (prompt tokens) summed over these engines; None
    where none of them has a cache."""
    queries = sum(delta[n].get(QUERIES, 0.0) for n in names)
    return sum(delta[n].get(HITS, 0.0) for n in names) / queries if queries else None


def tally(
    run: Run,
    tenant: Tenant | None,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
) -> None:
    """The engines' side of a run: what their counters moved by during the measured phase."""
    delta = {n: {k: after[n].get(k, 0.0) - before[n].get(k, 0.0) for k in after[n]} for n in after}
    producers, consumers = of_role("prefill"), of_role("decode")
    run.hit_rate = hit_rate(delta, producers)
    run.hit_rate_consumers = hit_rate(delta, consumers)
    run.hit_rate_all = hit_rate(delta, producers + consumers)
    run.kv_pulls = sum(delta[n].get(PULLS, 0.0) for n in consumers)
    if all(KV_BYTES in after[n] for n in consumers):  # a baseline tree's engine lacks it
        run.kv_bytes = sum(delta[n][KV_BYTES] for n in consumers)
    routed = {n: delta[n].get("vllm:prompt_tokens_total", 0.0) for n in producers}
    if tenant is not None:  # what this router sent: the tenant's prefills out
        name = tenant.engine
        routed[name] = max(0.0, routed[name] - run.tenant_done * tenant.words)
    total = sum(routed.values()) or 1.0
    run.prefill_share = {n: round(t / total, 3) for n, t in routed.items()}


# ---- report ----------------------------------------------------------------------------


HEADER = (
    "| policy | TTFT p50 ms | TTFT p99 ms | req/s | prefix-cache hit rate "
    "| prompt tokens p0/p1 | ok/failed | load avg | note |"
)
CD_HEADER = (
    "| target | TTFT p50 ms | TTFT p99 ms | short TTFT p50 ms | long TTFT p99 ms | ITL p99 ms "
    "| producer legs saved | KV transfers | KV MiB | hit rate producers | hit rate consumers "
    "| ok/failed | load avg | note |"
)

PRESSURE_HEADER = (
    "| target | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | ITL p99 ms | producer legs saved "
    "| KV transfers | KV MiB | hit rate producers | hit rate consumers | hit rate all "
    "| event streams live | ok/failed | load avg | note |"
)


LORA_HEADER = (
    "| target | TTFT p50 ms | TTFT p99 ms | hot p50 / p99 ms | cold p50 / p99 ms "
    "| base p50 / p99 ms | swaps p0/p1/d0/d1 | swaps total | swaps / affinity off "
    "| loads hot/cold p0; p1; d0; d1 | peak waiting p0/p1/d0/d1 | router queue wait mean ms "
    "| ok/failed | load avg | note |"
)


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        row: Callable[[dict[str, Any]], list[str]] = cells
        header = HEADER
        if mine[0].get("conditional"):
            header, row = CD_HEADER, cd_cells
        if workload == PRESSURE:
            header, row = PRESSURE_HEADER, pressure_cells
        if workload == LORA:
            header, row = LORA_HEADER, lora_row(mine)
        lines += [f"\n### {workload}\n", header, "|---" * (header.count("|") - 1) + "|"]
        lines += ["| " + " | ".join(row(r)) + " |" for r in mine]
    return "\n".join(lines)


def row_notes(r: dict[str, Any]) -> str:
    """What went wrong in a run and how often, and how often our affinity spilled."""
    notes = [r["note"], *(f"{why} x{n}" for why, n in sorted(r["errors"].items()))]
    decisions = r["placements"]
    homed = decisions.get("prefill/spill", 0) + decisions.get("prefill/affinity", 0)
    if homed:
        notes.append(f"spilled {decisions.get('prefill/spill', 0) / homed:.0%} of prefills")
    return " ".join(n for n in notes if n).replace("|", "/")  # a cell of a Markdown table


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1%}"


def cells(r: dict[str, Any]) -> list[str]:
    """One row of the first three workloads' table (its columns as before)."""
    return [
        r["target"],
        fmt(r["ttft_p50_ms"], 1, 1),
        fmt(r["ttft_p99_ms"], 1, 1),
        fmt(r["req_per_s"], 1, 1),
        percent(r["hit_rate"]),
        "/".join(f"{r['prefill_share'].get(n, 0):.0%}" for n in ("p0", "p1")),
        f"{r['ok']}/{r['failed']}",
        fmt(r["load_avg"], 1, 1),
        row_notes(r),
    ]


def cd_cells(r: dict[str, Any]) -> list[str]:
    """One row of a conditional workload's table: "—" where a figure does not apply (legs
    saved: the peers, and ours before conditional disaggregation; KV MiB: engines that do
    not export the bytes)."""
    saved, decided = r["legs_saved"], r["legs_decided"]
    # no decisions: our router placed nothing decode first (local_prefill_tokens = 0)
    legs = "—" if saved is None else f"{saved:.0f} of {decided:.0f}" if decided else "0"
    return [
        r["target"],
        fmt(r["ttft_p50_ms"], 1, 1),
        fmt(r["ttft_p99_ms"], 1, 1),
        fmt(r["ttft_short_p50_ms"], 1, 1),
        fmt(r["ttft_long_p99_ms"], 1, 1),
        fmt(r["itl_p99_ms"], 1, 1),
        legs,
        fmt(r["kv_pulls"], 1, 0),
        fmt(r["kv_mib"], 1, 1),
        percent(r["hit_rate"]),
        percent(r["hit_rate_consumers"]),
        f"{r['ok']}/{r['failed']}",
        fmt(r["load_avg"], 1, 1),
        row_notes(r),
    ]


def pressure_cells(r: dict[str, Any]) -> list[str]:
    """One row of the cache pressure table: the conditional columns with TTFT p90, the
    hit rate of all engines together and our router's live event streams."""
    cd = cd_cells(r)
    live = r.get("kv_live")
    streams = "—" if live is None else f"{live[0]} of {live[1]}"
    if r.get("kv_rejected"):
        streams += f" ({r['kv_rejected']:.0f} events refused)"
    return [
        *cd[:2],
        fmt(r.get("ttft_p90_ms"), 1, 1),
        cd[2],
        *cd[5:11],
        percent(r.get("hit_rate_all")),
        streams,
        *cd[11:],
    ]


ENGINES = tuple(n for n, _, _ in FLEET)


def lora_row(mine: list[dict[str, Any]]) -> Callable[[dict[str, Any]], list[str]]:
    """The lora adapters table's row maker: swaps are shown against affinity off's in the
    same run."""
    off = next((r["lora_swaps_total"] for r in mine if r["target"] == ADAPTER_OFF), None)

    def by_model(r: dict[str, Any], model: str) -> str:
        got = (r.get("ttft_by_model_ms") or {}).get(model)
        return "—" if not got else f"{fmt(got['p50'], 1, 1)} / {fmt(got['p99'], 1, 1)}"

    def row(r: dict[str, Any]) -> list[str]:
        swaps, total = r.get("lora_swaps") or {}, r.get("lora_swaps_total")
        loads = r.get("lora_loads") or {}
        ratio = "—" if total is None or not off else f"{total / off:.2f}x"
        return [
            r["target"],
            fmt(r["ttft_p50_ms"], 1, 1),
            fmt(r["ttft_p99_ms"], 1, 1),
            by_model(r, HOT),
            by_model(r, COLD),
            by_model(r, MODEL),
            "/".join(f"{swaps.get(n, 0):.0f}" for n in ENGINES) if swaps else "—",
            fmt(total, 1, 0),
            ratio,
            "; ".join(
                "/".join(f"{loads.get(n, {}).get(a, 0):.0f}" for a in (HOT, COLD)) for n in ENGINES
            )
            if loads
            else "—",
            "/".join(f"{r['peak_waiting'].get(n, 0):.0f}" for n in ENGINES),
            fmt(r.get("queue_wait_mean_ms"), 1, 1),
            f"{r['ok']}/{r['failed']}",
            fmt(r["load_avg"], 1, 1),
            row_notes(r),
        ]

    return row


def lora_met(rows: list[dict[str, Any]]) -> str:
    """Adapter affinity's target, against affinity off in this run: adapter swaps (summed
    over the four engines) at most 0.5x, at a TTFT p99 no worse."""
    by = {r["target"]: r for r in rows if r["workload"] == LORA}
    on, off = by.get(ADAPTER_ON), by.get(ADAPTER_OFF)
    if on is None or off is None or on["lora_swaps_total"] is None:
        return ""
    lines = ["\n### Targets (lora adapters, adapter affinity vs off)\n"]
    swaps, base = on["lora_swaps_total"], off["lora_swaps_total"]
    if base:
        lines.append(
            f"- adapter swaps {swaps:.0f} vs {base:.0f} ({swaps / base:.2f}x; target at most "
            f"0.5x: {'met' if swaps <= 0.5 * base else 'NOT met'})"
        )
    else:
        lines.append(f"- adapter swaps {swaps:.0f} vs 0 (target at most 0.5x: not measurable)")
    p99, p99_off = on["ttft_p99_ms"], off["ttft_p99_ms"]
    if p99 is not None and p99_off:
        lines.append(
            f"- TTFT p99 {p99:.1f} ms vs {p99_off:.1f} ms ({p99 / p99_off:.2f}x; target no "
            f"worse: {'met' if p99 <= p99_off else 'NOT met'})"
        )
    return "\n".join(lines)


def targets_met(rows: list[dict[str, Any]]) -> str:
    """The issue's targets, checked on this run's figures."""
    by = {(r["workload"], r["target"]): r for r in rows}

    def val(workload: str, target: str, key: str) -> float | None:
        r = by.get((workload, target))
        v = None if r is None else r[key]
        return None if v is None else float(v)

    lines = ["\n### Targets (issue item 5)\n"]
    rr = val("shared-prefix", "round_robin", "ttft_p50_ms")
    peers = [
        v
        for t in ("vllm-router cache_aware", "vllm-router power_of_two", "narwhal-0.7")
        if (v := val("shared-prefix", t, "ttft_p50_ms")) is not None
    ]
    for ours_name in ("least_loaded", "least_loaded+affinity", "least_loaded+affinity 0.25s"):
        p50 = val("shared-prefix", ours_name, "ttft_p50_ms")
        if p50 is None or rr is None:
            continue
        best = min(peers) if peers else None
        lines.append(
            f"- shared-prefix, {ours_name}: TTFT p50 {p50:.1f} ms vs round_robin {rr:.1f} ms "
            f"({1 - p50 / rr:+.0%} lower; target 30%: "
            f"{'met' if p50 <= 0.7 * rr else 'NOT met'}); best peer "
            f"{'—' if best is None else f'{best:.1f} ms'} (target no worse: "
            f"{'met' if best is None or p50 <= best else 'NOT met'})"
        )
    rr99 = val("burst", "round_robin", "ttft_p99_ms")
    for ours_name in ("least_loaded", "least_loaded+affinity", "least_loaded+affinity 0.25s"):
        p99 = val("burst", ours_name, "ttft_p99_ms")
        if p99 is None or rr99 is None:
            continue
        lines.append(
            f"- burst, {ours_name}: TTFT p99 {p99:.1f} ms vs round_robin {rr99:.1f} ms "
            f"({rr99 / p99:.2f}x better; target 2x: {'met' if rr99 >= 2 * p99 else 'NOT met'})"
        )
    return "\n".join(lines) if len(lines) > 1 else ""


# (workload, figure, what it is, the most ours may be as a multiple of always-P/D's, target)
CD_CHECKS = (
    (CHAT, "ttft_p50_ms", "TTFT p50", 0.60, "at least 40% lower"),
    (CHAT, "ttft_p99_ms", "TTFT p99", 1.0, "no worse"),
    (CHAT, "itl_p99_ms", "ITL p99", 1.10, "within 1.10x"),
    (SHORT, "ttft_short_p50_ms", "short prompts' TTFT p50", 0.70, "at least 30% lower"),
    (SHORT, "ttft_long_p99_ms", "long prompts' TTFT p99", 1.05, "within 1.05x"),
    (SHORT, "itl_p99_ms", "ITL p99", 1.10, "within 1.10x"),
)


def conditional_met(rows: list[dict[str, Any]]) -> str:
    """Conditional disaggregation's targets: each of our thresholds against always-P/D,
    within this run."""
    by = {(r["workload"], r["target"]): r for r in rows}
    ours_names = [t for t in dict.fromkeys(r["target"] for r in rows) if t.startswith("condit")]
    lines = []
    for name in ours_names:
        met = checked = 0
        for workload, key, label, most, target in CD_CHECKS:
            if (workload, name) not in by:  # the workload did not run (--only)
                continue
            base = by.get((workload, ALWAYS_PD), {}).get(key)
            value = by[workload, name].get(key)
            if not base or value is None:
                lines.append(f"- {workload}, {name}: {label}: not measured (target {target})")
                continue
            ok = value <= most * base
            met, checked = met + ok, checked + 1
            lines.append(
                f"- {workload}, {name}: {label} {value:.1f} ms vs {ALWAYS_PD} {base:.1f} ms "
                f"({value / base:.2f}x; target {target}: {'met' if ok else 'NOT met'})"
            )
        lines.append(f"- **{name}: {met} of {checked} checked targets met**")
    if not lines:
        return ""
    return "\n### Targets (conditional disaggregation, ours vs always-P/D)\n\n" + "\n".join(lines)


def pressure_met(rows: list[dict[str, Any]]) -> str:
    """The precise index's targets on cache pressure, against the approximate one in this
    run: TTFT p90 at most half, the hit rate 15 points higher or more (every engine's
    together, and each role's)."""
    by = {r["target"]: r for r in rows if r["workload"] == PRESSURE}
    precise, approx = by.get(NARWHAL_PRECISE), by.get(NARWHAL_APPROXIMATE)
    if precise is None or approx is None:
        return ""
    lines = ["\n### Targets (cache pressure, precise vs approximate)\n"]
    p90, base = precise["ttft_p90_ms"], approx["ttft_p90_ms"]
    if p90 is not None and base:
        lines.append(
            f"- TTFT p90 {p90:.1f} ms vs {base:.1f} ms ({p90 / base:.2f}x; target at most "
            f"0.5x: {'met' if p90 <= 0.5 * base else 'NOT met'})"
        )
    for key, label in (
        ("hit_rate_all", "all engines"),
        ("hit_rate", "producers"),
        ("hit_rate_consumers", "consumers"),
    ):
        hit, hit0 = precise[key], approx[key]
        if hit is None or hit0 is None:
            continue
        points = 100 * (hit - hit0)
        verdict = f"; target +15 points: {'met' if points >= 15 else 'NOT met'}"
        lines.append(
            f"- hit rate, {label}: {hit:.1%} vs {hit0:.1%} ({points:+.1f} points{verdict})"
        )
    return "\n".join(lines)


def precise_ratios(rows: list[dict[str, Any]]) -> str:
    """``--kv-events``: each precise twin's TTFT p50 and p99 over its approximate target's
    in the same run (target: within 1.05x)."""
    by = {(r["workload"], r["target"]): r for r in rows}
    lines = []
    for (workload, name), r in by.items():
        base = by.get((workload, name.removesuffix(PRECISE)))
        if not name.endswith(PRECISE) or base is None:
            continue
        cells = []
        for key in ("ttft_p50_ms", "ttft_p99_ms"):
            value, was = r[key], base[key]
            ratio = None if value is None or not was else value / was
            ok = ratio is not None and ratio <= 1.05
            shown = "—" if ratio is None else f"{ratio:.2f}x ({'met' if ok else 'NOT met'})"
            cells.append(shown)
        lines.append(f"| {workload} | {name.removesuffix(PRECISE)} | {' | '.join(cells)} |")
    if not lines:
        return ""
    return (
        "\n### Precise index vs approximate, same run (target: within 1.05x)\n\n"
        "| workload | target | TTFT p50 precise/approximate | TTFT p99 precise/approximate |\n"
        "|---|---|---|---|\n" + "\n".join(lines)
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="shorter workloads (smoke)")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--peers-venv", default=os.environ.get("PEERS_VENV", ".bench-venv"))
    parser.add_argument("--targets", help="comma-separated target names (default: all)")
    parser.add_argument("--only", help="run only the workloads whose name starts with this")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--name", help="the results' file name, without .md/.json (default: placement-DATE)"
    )
    parser.add_argument("--logs", help="keep the processes' logs in this folder")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [placement] line for our targets (TOML), e.g. affinity_load_factor=2.0; "
        "admission.KEY=VALUE: an [admission] line, e.g. admission.queue=false",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="every workload's engines publish KV events, and each of our prefix-placing "
        "targets has a twin with the precise index (its name ends in ' precise')",
    )
    parser.add_argument(
        "--thresholds",
        default=",".join(map(str, LOCAL_THRESHOLDS)),
        help="local_prefill_tokens of our conditional targets, comma-separated",
    )
    return parser.parse_args()


def progress(run: Run) -> str:
    """One line on stderr per run, while the bench goes on."""
    r = run.summary()
    line = (
        f"{run.scenario:16} {run.target:28} p50={fmt(r['ttft_p50_ms'], 1, 1)} "
        f"p99={fmt(r['ttft_p99_ms'], 1, 1)} hit={r['hit_rate']} "
    )
    if run.scenario == PRESSURE:
        line += f"p90={fmt(r['ttft_p90_ms'], 1, 1)} all hit={r['hit_rate_all']} "
        line += f"kv live={r['kv_live']} rejected={r['kv_rejected']} "
    if run.lora_swaps is not None:
        r_models = r["ttft_by_model_ms"] or {}
        line += f"swaps={run.lora_swaps} loads={run.lora_loads} by model={r_models} "
    if run.conditional:
        line += (
            f"short p50={fmt(r['ttft_short_p50_ms'], 1, 1)} "
            f"long p99={fmt(r['ttft_long_p99_ms'], 1, 1)} itl p99={fmt(r['itl_p99_ms'], 1, 1)} "
            f"consumer hit={r['hit_rate_consumers']} kv={r['kv_pulls']}/{r['kv_mib']} MiB "
            f"decisions={run.disaggregation} "
        )
    else:
        line += f"share={run.prefill_share} {run.placements} "
    return line + (
        f"queue={run.peak_waiting} slowest={run.slowest} ok={run.ok} failed={run.failed} {run.note}"
    )


def run_all(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Every chosen workload through every chosen target, one fresh fleet each."""
    thresholds = tuple(int(n) for n in args.thresholds.split(",") if n.strip())
    wanted = None if not args.targets else args.targets.split(",")
    rows = []
    # a workload's seed is its place in the whole list: --only replays the full run's arrivals
    for w_index, workload in enumerate(workloads(args.quick)):
        if args.only and not workload.name.startswith(args.only):
            continue
        if workload.name == PRESSURE:
            chosen = pressure_targets()
        elif workload.name == LORA:
            chosen = lora_targets()
        elif workload.conditional:
            chosen = conditional_targets(thresholds, args.kv_events)
        else:
            chosen = targets(args.kv_events)
        for name, start in chosen:
            if wanted is not None and name not in wanted:
                continue
            run = measure(workload, name, start, tmp, args.seed * 100 + w_index)
            rows.append(run.summary())
            print(progress(run), file=sys.stderr, flush=True)
    return rows


def fleet_text(rows: list[dict[str, Any]]) -> str:
    text = (
        "Fleet: p0, p1 producers (4 slots, 0.2 ms per uncached prompt token, prefix cache of "
        "480 blocks; p1 2x slower), d0, d1 consumers (16 slots, 5 ms ITL; d1 2x slower), "
        "fresh for every run; see the docstring of bench/placement.py.\n"
    )
    if KV_EVENTS_EVERYWHERE:
        text += f"`--kv-events`: every engine also runs with `{' '.join(KV_EVENTS_ARGS)}`.\n"
    if any(r["workload"] == LORA for r in rows):
        mix = ", ".join(f"{share:.0%} {name}" for name, share in LORA_MIX)
        text += (
            f"{LORA}: every engine with `{' '.join(LORA_ARGS)}`; unique {LORA_WORDS}-token "
            f"prompts, {LORA_OUTPUT_TOKENS} output tokens, {mix}; ours with "
            f"`metrics_interval_s = {LORA_INTERVAL_S}`. Swaps and loads: each engine's "
            "`/fake/stats` over the measured phase.\n"
        )
    if not any(r["conditional"] for r in rows):
        return text
    text += (
        f"Conditional workloads ({CHAT}, {SHORT}, {PRESSURE}): the consumers also run with "
        f"`{' '.join(consumer_cost())}`.\n"
    )
    if any(r["workload"] == PRESSURE for r in rows):
        blocks = next(
            w.cache_blocks
            for w in workloads(False)
            if isinstance(w, ChatWorkload) and w.name == PRESSURE
        )
        text += (
            f"{PRESSURE}: every engine with `--prefix-cache-blocks {blocks}` (a third of the "
            f"working set) and `{' '.join(KV_EVENTS_ARGS)}`; ours with `[placement] "
            f"local_prefill_tokens = {PRESSURE_LOCAL_TOKENS}`, {NARWHAL_PRECISE} also with "
            '`[kv_events] mode = "subscribe"`.\n'
        )
    return text


def main() -> int:
    args = parse_args()
    for line in args.set:
        section, dot, key = line.partition(".")
        if dot and section.strip() == "admission" and "=" in key:
            ADMISSION_KEYS.append(key)
        else:
            PLACEMENT_KEYS.append(line)
    if args.kv_events:
        KV_EVENTS_EVERYWHERE.append(True)
    os.environ["PEERS_VENV"] = args.peers_venv
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="narwhal-placement-") as tmpdir:
        tmp = Path(args.logs or tmpdir)
        tmp.mkdir(parents=True, exist_ok=True)
        rows = run_all(args, tmp)
    stamp = time.strftime("%Y-%m-%d")
    host = f"{platform.node()}, {os.cpu_count()} cores"
    command = "python bench/placement.py " + " ".join(sys.argv[1:])
    report = (
        f"# Placement benchmark, {stamp}\n\n"
        f"Command: `{command}`. Machine: {host}. "
        f"Mode: {'quick' if args.quick else 'full'}; {time.monotonic() - began:.0f} s in all.\n"
        + fleet_text(rows)
        + "\n".join(
            part
            for part in (
                table(rows),
                targets_met(rows),
                conditional_met(rows),
                pressure_met(rows),
                lora_met(rows),
                precise_ratios(rows),
            )
            if part
        )
    )
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"placement-{stamp}{'-quick' if args.quick else ''}"
    (out / f"{name}.md").write_text(report + "\n")
    (out / f"{name}.json").write_text(
        json.dumps({"command": command, "rows": rows}, indent=1) + "\n"
    )
    if plot(out / f"{name}.json", out / f"{name}.png", "placement_plot.py"):
        print(f"plot: {out / name}.png")
    else:
        print("no plot (the peers venv's matplotlib failed)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
