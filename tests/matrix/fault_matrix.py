"""The fault matrix: many requests per scenario against fake engines that break in
scripted ways, then one reconciliation of what the client saw, what the router's journal
says and what the engines logged, against the invariants of docs/contract.md.

``make faults`` runs every scenario at 200 requests, concurrency 32 (``python -m
tests.matrix.fault_matrix``); ``tests/matrix/test_fault_matrix.py`` runs them all at a
small count on every ``make test``. Everything runs in one trio run over real loopback sockets.

Fleet: two producers (p0, p1) and three consumers (d0, d1, d2); a scenario breaks p0 (one
of two producers), d0 (one of three consumers), every consumer, or the client.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpcore
import msgspec
import trio

from narwhal.core.config import (
    AdmissionConfig,
    EngineConfig,
    KvEventsConfig,
    PlacementConfig,
    PredictionConfig,
    RecoveryConfig,
    ServingConfig,
)
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine import lora
from narwhal.fake_engine.faults import Fault
from narwhal.router.health import live_tasks
from narwhal.router.journal import Journal
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, Harness, start_fleet
from tests.support.wire import h2_post

ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "d2": "decode"}
CONSUMERS = ("d0", "d1", "d2")
SERVING = ServingConfig(
    request_timeout_s=4.0,
    prefill_timeout_s=0.5,
    max_attempts=2,
    # the bound, attempts <= 1.2 x requests + 3, holds at any request count when the
    # initial retry credit is at most 3 (the default of 10 meets it from 35 requests on)
    retry_budget=3.0,
    retry_backoff_s=0.01,
    graceful_timeout_s=0.5,
)
ENGINE = EngineConfig(
    first_token_timeout_s=0.5,
    decode_read_timeout_s=0.5,
    connect_timeout_s=0.5,
    health_timeout_s=0.5,
    max_connections=64,
)
RECOVERY = RecoveryConfig(eject_after=3, readmit_interval_s=0.25)
PLACEMENT = PlacementConfig(metrics_interval_s=0.25)
CLIENT_LIMIT_S = SERVING.request_timeout_s + 2.0  # past this a request counts as hung
DRAIN_S = 2.0
CANCEL_LAG_S = 1.0
QUEUE_SLACK_S = 0.25  # a queued request's timer fires late by at most this on a busy machine
# A run that expects an ejection goes on, bounded, until the failing engine has met enough
# legs to be judged: placement passes over an engine whose hung legs fill its room, so it
# meets them a room's worth per first-token budget, and a fast fleet serves many requests
# meanwhile on the others. So the bound is in time (the budgets that many legs take, twice
# over) as well as in requests.
EVIDENCE_EXTRA = 4096  # the most requests a run adds while it waits for an expected ejection
EVIDENCE_S = 2 * (RECOVERY.eject_after + 1) * ENGINE.first_token_timeout_s
# every request also carries a forged descriptor aimed at a real-looking producer
FORGED = {
    "do_remote_prefill": True,
    "remote_engine_id": "forged",
    "remote_block_ids": [[1, 2]],
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_request_id": "forged",
}
# tasks that exist only while a request does: the app's call (the front door's task
# group) and the router's own
REQUEST_TASKS = (
    "narwhal.frontdoor.app_queue.run_app",
    "narwhal.router.service",
    "narwhal.router.request_run",
    "narwhal.router.legs",
)
_REFUSED = ("reused", "unknown", "forged", "wrong_engine", "expired")


@dataclass(frozen=True)
class Scenario:
    name: str
    armed: dict[str, tuple[Fault, ...]] = field(default_factory=dict)  # engine -> faults
    stopped: tuple[str, ...] = ()  # engines refusing connections for the whole run
    disconnect_after_s: float | None = None  # the client gives up this long after sending
    disconnect_after_tokens: int | None = None  # ... or after this many streamed tokens
    read_pause_s: float = 0.0  # a slow reader: this long between reads
    max_tokens: int = 8
    engine_config: dict[str, Any] = field(default_factory=dict)
    recover_at: float | None = None  # fraction of the run after which armed faults clear
    flap_every: int = 0  # toggle the armed faults every N requests
    expect: str = ""  # what the scenario must additionally show (checked in ``extra``)
    # the front door: every Nth client stops reading after the response head (its stream
    # must end at the request deadline), or opens an HTTP/2 connection first (refused with
    # GOAWAY); the journal written to a failing disk or pipe
    stall_every: int = 0
    stall_tokens: int = 30_000
    http2_every: int = 0
    journal: str = ""  # "" | "/dev/full" | "broken pipe"
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # its flow control
    placement: PlacementConfig = PLACEMENT
    long_every: int = 0  # every Nth request's prompt is long (about 250 tokens), else ~15
    # stream resume (contract 6.4): at most this many per request, and every client must get a
    # whole answer; ``kill``: d0 dies (its open streams dropped) once streams on it are
    # under way
    resume: int = 0
    kill: bool = False
    serving: ServingConfig = SERVING
    recovery: RecoveryConfig = RECOVERY
    # KV events: every engine publishes, the router subscribes; these knobs of p0's
    # publisher (``POST /fake/kv_events``) are turned every ``kv_every`` requests
    kv_knobs: dict[str, Any] | None = None
    kv_every: int = 0
    # models and LoRA adapters: what each engine serves (``--models``; others the base
    # alone), and every ``adapter_every``th request asks for ``ADAPTER``
    models: dict[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_every: int = 0
    # policy "predicted": its cost model's priors, and the fraction of the run after which
    # p0 computes prompts ``SLOWER`` times slower (None: never)
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    slow_at: float | None = None
    engine_configs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by engine id


# stream resume: d0 is never ejected, so that a third of the streams break on it, and
# each resume (a retry credit) has one
RESUME_SERVING = msgspec.structs.replace(SERVING, retry_budget=1000.0)
RESUME_RECOVERY = msgspec.structs.replace(RECOVERY, eject_after=100_000, resume_streams=1)
# a consumer that dies with streams open: tokens spaced so that some are mid-stream
DYING = {"itl_s": 0.01}


def _resumed(name: str, **kw: Any) -> Scenario:
    settings = {"serving": RESUME_SERVING, "recovery": RESUME_RECOVERY, **kw}
    return Scenario(f"resume: {name}", resume=1, max_tokens=16, expect="resumed", **settings)


# decode first: the short prompts are served by their consumers alone, the long ones by
# a producer and a consumer, in one run
MIXED = PlacementConfig(metrics_interval_s=0.25, local_prefill_tokens=64)


def _on(engine: str, *faults: Fault) -> dict[str, tuple[Fault, ...]]:
    return {engine: faults}


def _always(**kw: Any) -> Fault:
    return Fault(rate=1.0, **kw)


BAD_DESCRIPTORS: dict[str, Fault] = {
    "no descriptor": _always(kind="no_descriptor"),
    "engine id empty": _always(kind="bad_engine_id", value=""),
    "engine id int": _always(kind="bad_engine_id", value=7),
    "engine id null": _always(kind="bad_engine_id", value=None),
    "engine id list": _always(kind="bad_engine_id", value=["a"]),
    "block ids negative": _always(kind="bad_block_ids", value=[[1, -2]]),
    "block ids float": _always(kind="bad_block_ids", value=[[1.5]]),
    "block ids bool": _always(kind="bad_block_ids", value=[[True]]),
    "block ids string": _always(kind="bad_block_ids", value="1,2"),
    "block ids null": _always(kind="bad_block_ids", value=None),
    "block ids mixed": _always(kind="bad_block_ids", value=[[1, "2"]]),
}

# KV events: the engines' caches small enough to evict under the run's prompts
KV_ENGINES = {
    "kv_events_endpoint": "tcp://127.0.0.1:0",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:0",
    "prefix_cache_blocks": 64,
}
KV_PLACEMENT = msgspec.structs.replace(PLACEMENT, local_prefill_tokens=64)

# an adapter served by both producers and by d0 alone of the consumers
ADAPTER = "lora-a"
WITH_ADAPTER = (MODEL, f"{ADAPTER}:{MODEL}")
ADAPTER_ON_D0 = {"p0": WITH_ADAPTER, "p1": WITH_ADAPTER, "d0": WITH_ADAPTER}


# policy "predicted" over engines whose prefill takes time (a prompt of ~15 tokens: 30 ms
# on a producer, ten times that on a consumer, so plans are P/D), learning within a short run
PREDICTED = msgspec.structs.replace(PLACEMENT, policy="predicted")
LEARNING = PredictionConfig(min_samples=4, half_life_s=2.0)
PREFILLING = {"prefill_ms_per_token": 2.0}
SLOW_CONSUMERS = {c: {"prefill_ms_per_token": 20.0} for c in CONSUMERS}
SLOWER = 5.0


def _kv(name: str, knobs: dict[str, Any], every: int, expect: str) -> Scenario:
    return Scenario(
        f"kv events: {name}",
        engine_config=KV_ENGINES,
        placement=KV_PLACEMENT,
        long_every=1,  # every prompt fills blocks: every prefill is a batch of events
        kv_knobs=knobs,
        kv_every=every,
        expect=f"kv {expect}",
    )


SCENARIOS: list[Scenario] = [
    Scenario("healthy fleet"),
    _kv("a publisher that floods", {"flood": 5_000}, 50, "flood"),
    _kv("garbage frames", {"garbage_next": 1}, 7, "batch"),
    _kv("a publisher that restarts mid-run", {"restart": True}, 40, "restarts"),
    _kv("a gap repaired by replay", {"drop_next": 1}, 9, "repaired"),
    _kv("a gap not repairable", {"drop_next": 1, "forget": True}, 9, "unrepaired"),
    Scenario("producer refused", stopped=("p0",)),
    Scenario("producer hung", armed=_on("p0", _always(kind="hang"))),
    Scenario("producer 5xx", armed=_on("p0", _always(kind="status", status=503))),
    Scenario("producer 4xx", armed=_on("p0", _always(kind="status", status=400))),
    *(
        Scenario(f"bad descriptor: {name}", armed=_on("p0", fault))
        for name, fault in BAD_DESCRIPTORS.items()
    ),
    Scenario("producer reset mid-body", armed=_on("p0", _always(kind="close_mid_body"))),
    Scenario("consumer refused", stopped=("d0",)),
    Scenario(
        "an adapter's only consumer refused",
        stopped=("d0",),
        models=ADAPTER_ON_D0,
        adapter_every=3,
        expect="adapter kept apart",
    ),
    Scenario("consumer no headers", armed=_on("d0", _always(kind="hang", leg="decode"))),
    Scenario(
        "consumer headers then nothing", armed=_on("d0", _always(kind="headers_then_silence"))
    ),
    Scenario(
        "consumer N tokens then stall",
        armed=_on("d0", _always(kind="tokens_then_silence", tokens=3)),
    ),
    Scenario(
        "consumer N tokens then close", armed=_on("d0", _always(kind="tokens_then_close", tokens=3))
    ),
    Scenario("consumer malformed SSE", armed=_on("d0", _always(kind="malformed_chunk", tokens=2))),
    Scenario(
        "consumer 5xx before first chunk",
        armed={c: (Fault(kind="status", status=503, leg="decode", rate=0.2),) for c in CONSUMERS},
    ),
    Scenario(
        "consumer slow drip inside limits",
        armed=_on("d0", _always(kind="slow_drip", interval_s=0.05)),
    ),
    Scenario(
        "consumer in-stream error",
        armed=_on("d0", _always(kind="stream_error", code=500, tokens=2)),
    ),
    Scenario(
        "client disconnect during prefill",
        disconnect_after_s=0.25,
        engine_config={"prefill_delay_per_token_s": 0.04},  # ~0.45 s prefills (< 0.5 s bound)
    ),
    Scenario(
        "client disconnect between prefill and decode",
        armed={c: (_always(kind="hang", leg="decode"),) for c in CONSUMERS},
        disconnect_after_s=0.15,
    ),
    Scenario(
        "client disconnect mid-stream",
        disconnect_after_tokens=2,
        engine_config={"itl_s": 0.02},
        max_tokens=32,
    ),
    _resumed(
        "consumer closes at token k", armed=_on("d0", _always(kind="tokens_then_close", tokens=5))
    ),
    _resumed(
        "consumer goes silent at token k",
        armed=_on("d0", _always(kind="tokens_then_silence", tokens=5)),
    ),
    _resumed(
        "consumer in-stream 5xx at token k",
        armed=_on("d0", _always(kind="stream_error", code=500, tokens=5)),
    ),
    _resumed(
        "consumer killed with streams open",
        kill=True,
        engine_config=DYING,
        # a dead engine is ejected as it would be: its refused connections are retried
        recovery=msgspec.structs.replace(RECOVERY, resume_streams=1),
    ),
    Scenario("slow reader", read_pause_s=0.01, max_tokens=64),
    Scenario("stalled reader past the deadline", stall_every=4, expect="stalled cut"),
    Scenario("HTTP/2 clients beside HTTP/1.1", http2_every=2, expect="h2 refused"),
    Scenario("journal on a full disk", journal="/dev/full", expect="journal drops"),
    Scenario("journal on a broken pipe", journal="broken pipe", expect="journal drops"),
    Scenario(
        "one of three consumers failing 100%",
        armed=_on("d0", _always(kind="status", status=500, leg="decode")),
        expect="d0 ejected",
    ),
    Scenario(
        "all consumers failing",
        armed={c: (_always(kind="status", status=500, leg="decode"),) for c in CONSUMERS},
    ),
    Scenario(
        "engine recovering",
        armed=_on("d0", _always(kind="status", status=503, leg="decode")),
        recover_at=0.3,
        expect="d0 readmitted",
    ),
    Scenario(
        "flapping engine",
        armed=_on("d0", _always(kind="tokens_then_close", tokens=1)),
        flap_every=20,
    ),
    # flow control (invariant 11): two slots per engine and a queue that lets one leg wait
    # on each, so most requests wait in the router; some wait past max_queue_wait_s (429),
    # the others' clients leave while they wait or stream
    Scenario(
        "saturated fleet, queued",
        engine_config={"slots": 2, "itl_s": 0.02},
        admission=AdmissionConfig(engine_waiting_limit=1, max_queue_wait_s=0.2),
        # a stream (40 tokens, 0.8 s) outlasts the client's patience (0.5 s): each request
        # is shed, or cut while waiting or streaming, never finished as its client leaves
        max_tokens=40,
        disconnect_after_s=0.5,
        expect="queued",
    ),
    Scenario("local and P/D mixed", placement=MIXED, long_every=3),
    Scenario(
        "local and P/D mixed, consumer N tokens then close",
        armed=_on("d0", _always(kind="tokens_then_close", tokens=3)),
        placement=MIXED,
        long_every=3,
    ),
    Scenario(
        "local and P/D mixed, consumer no headers",
        armed=_on("d0", _always(kind="hang", leg="decode")),
        placement=MIXED,
        long_every=3,
    ),
    Scenario(
        "local and P/D mixed, one consumer failing 100%",
        armed=_on("d0", _always(kind="status", status=500, leg="decode")),
        placement=MIXED,
        long_every=3,
        expect="d0 ejected",
    ),
    Scenario(
        "predicted: a producer turns 5x slower mid-run",
        placement=PREDICTED,
        prediction=LEARNING,
        engine_config=PREFILLING,
        engine_configs=SLOW_CONSUMERS,
        slow_at=0.3,
        expect="p0 slowed",
    ),
    Scenario(
        "predicted: every engine's metrics stop",
        placement=PREDICTED,
        prediction=LEARNING,
        engine_config=PREFILLING,
        engine_configs=SLOW_CONSUMERS,
        armed={e: (_always(kind="hang", leg="metrics"),) for e in ROLES},
    ),
    Scenario(
        "health 200 while inference hangs",
        armed=_on("d0", _always(kind="headers_then_silence")),
        expect="d0 ejected",
    ),
]


# ---- the client side --------------------------------------------------------------------


@dataclass
class ClientResult:
    index: int
    tag: str
    stream: bool
    chat: bool
    status: int | None = None
    rid: str | None = None
    # ok | http-NNN | terminal-error | terminal-error-whole | truncated | disconnected | hung
    # | wrong | stalled-cut
    outcome: str = ""
    tokens: int = 0
    disconnected_at: float | None = None
    h2_refused: bool | None = None  # None: this client made no HTTP/2 connection


def _stalls(sc: Scenario, i: int) -> bool:
    return bool(sc.stall_every) and i % sc.stall_every == 0


def _body(sc: Scenario, i: int, tag: str) -> tuple[str, dict[str, Any], bool, bool]:
    stream, chat = i % 2 == 0, i % 4 in (1, 2)
    text = f"{tag} The quick brown fox jumps over the lazy dog"
    if sc.long_every and i % sc.long_every == 0:
        text = " ".join([text] * 20)
    max_tokens = sc.stall_tokens if _stalls(sc, i) else sc.max_tokens
    model = ADAPTER if sc.adapter_every and i % sc.adapter_every == 0 else MODEL
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    body["kv_transfer_params"] = FORGED
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, body, stream, chat


def _text(payloads: list[Any], chat: bool) -> str:
    out = []
    for chunk in payloads:
        for choice in chunk.get("choices") or []:
            out.append((choice.get("delta") or {}).get("content") or "" if chat else choice["text"])
    return "".join(out)


async def one_request(
    pool: httpcore.AsyncConnectionPool, url: str, sc: Scenario, i: int
) -> ClientResult:
    tag = f"{sc.name.replace(' ', '_')}#{i:05d}"
    path, body, stream, chat = _body(sc, i, tag)
    result = ClientResult(i, tag, stream, chat)
    if sc.http2_every and i % sc.http2_every == 0:
        result.h2_refused = await _http2_client(url)
    if _stalls(sc, i):
        return await _stalled_request(url, path, body, result)
    expected = gen.generate(gen.prompt_of(body, chat)[0], sc.max_tokens)
    if body["model"] == ADAPTER:  # an adapter says something else (the fake engine's salt)
        salt = lora.generation_salt(ADAPTER, None)
        ids = gen.token_ids(gen.prompt_of(body, chat)[0], sc.max_tokens, salt)
        expected = "".join(gen.VOCAB[i] for i in ids)
    headers = [(b"content-type", b"application/json")]
    with trio.move_on_after(CLIENT_LIMIT_S) as limit:
        with trio.move_on_after(sc.disconnect_after_s or math.inf):
            async with pool.stream(
                "POST", url + path, headers=headers, content=msgspec.json.encode(body)
            ) as resp:
                result.status = resp.status
                result.rid = dict(resp.headers).get(b"x-request-id", b"").decode() or None
                if resp.status != 200 or not stream:
                    raw = await resp.aread()
                    result.outcome = _whole(resp.status, raw, chat, expected)
                    return result
                await _read_stream(resp, sc, result, chat, expected)
                return result
        result.outcome = "disconnected"
        result.disconnected_at = trio.current_time()
    if limit.cancelled_caught:
        result.outcome = "hung"
    return result


STALL_S = CLIENT_LIMIT_S  # a stalled client reads nothing for this long


async def _stalled_request(
    url: str, path: str, body: dict[str, Any], result: ClientResult
) -> ClientResult:
    """A client that reads the response head, then nothing for ``STALL_S``, then the rest:
    the router must have ended the stream at the request deadline (invariant 10), with the
    terminal event when it still fit in the socket buffers, and by closing (or resetting)
    the connection: the body is never ended whole after a terminal event (contract 6)."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    payload = msgspec.json.encode(body)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    async with trio.SocketStream(sock) as stream:
        await stream.send_all(head + payload)
        first = await stream.receive_some(256)
        result.status = int(first.split(b" ", 2)[1]) if first.startswith(b"HTTP/1.1 ") else None
        for line in first.split(b"\r\n"):
            if line.lower().startswith(b"x-request-id:"):
                result.rid = line.split(b":", 1)[1].strip().decode()
        await trio.sleep(STALL_S)  # the stall is the behaviour under test
        tail = b""
        with trio.move_on_after(5.0) as limit:
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                tail = (tail + chunk)[-8192:]
                if tail.endswith(b"\r\n0\r\n\r\n"):
                    break
    if limit.cancelled_caught:
        result.outcome = "hung"
    elif b'data: {"error"' in tail:
        # the terminal event then the cut; ended whole, a client that ignores error events
        # would count it a success
        whole = tail.endswith(b"\r\n0\r\n\r\n")
        result.outcome = "terminal-error-whole" if whole else "terminal-error"
    else:
        result.outcome = "stalled-cut"  # the router closed on a client that read nothing
    return result


async def _http2_client(url: str) -> bool:
    """An HTTP/2 prior-knowledge client whose body is still arriving when it is answered;
    True when the router refused it with GOAWAY(HTTP_1_1_REQUIRED)."""
    conn = h2_post(10 << 20)
    conn.send_data(1, b"x" * 15_000)
    host, port = url.removeprefix("http://").split(":")
    raw = b""
    with trio.move_on_after(5.0):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            try:
                await stream.send_all(conn.data_to_send())
                while chunk := await stream.receive_some(65536):
                    raw += chunk
            except trio.BrokenResourceError:
                pass
    events = conn.receive_data(raw) if raw else []
    return any(
        isinstance(e, h2.events.ConnectionTerminated)
        and e.error_code == h2.errors.ErrorCodes.HTTP_1_1_REQUIRED
        for e in events
    )


def _whole(status: int, raw: bytes, chat: bool, expected: str) -> str:
    if status != 200:
        return f"http-{status}"
    try:
        choice = msgspec.json.decode(raw)["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return "wrong"  # a 200 without a complete answer
    return "ok" if text == expected else "wrong"


async def _read_stream(
    resp: httpcore.Response, sc: Scenario, result: ClientResult, chat: bool, expected: str
) -> None:
    parser, payloads, done, error, cut = SSEParser(), [], False, False, False
    try:
        async for data in resp.aiter_stream():
            for event in parser.feed(data):
                if event == b"[DONE]":
                    done = True
                    continue
                chunk = msgspec.json.decode(event)
                if "error" in chunk:
                    error = True
                    continue
                payloads.append(chunk)
                result.tokens = len(payloads) - (1 if chat else 0)
            if (
                sc.disconnect_after_tokens is not None
                and result.tokens >= sc.disconnect_after_tokens
            ):
                result.outcome = "disconnected"
                result.disconnected_at = trio.current_time()
                return  # leaving the context closes the connection: the client is gone
            if sc.read_pause_s:
                await trio.sleep(sc.read_pause_s)  # the slow reader is the behaviour under test
    except httpcore.RemoteProtocolError:
        cut = True  # the connection closed before the chunked body's end
    if error:
        # contract 6: the terminal event, then the body is cut; ended whole, a client that
        # ignores error events (vLLM's benchmark client) would count it a success
        result.outcome = "terminal-error" if cut else "terminal-error-whole"
    elif done and not cut:
        result.outcome = "ok" if _text(payloads, chat) == expected else "wrong"
    else:
        result.outcome = "truncated"  # a 200 stream cut without a terminal event


# ---- running a scenario -------------------------------------------------------------------


@dataclass
class Report:
    name: str
    requests: int
    outcomes: Counter[str]
    journal_ok: bool
    attempts: int
    reached: int
    hung: int
    retries_after_output: int
    descriptor_misuse: int
    leaks: str
    cancel_lag_s: float | None
    cut_without_terminal: int
    wrong_answers: int
    extra: str
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


def _journal(sc: Scenario, keep: int) -> Journal:
    """The scenario's journal: in memory, or also written to a failing disk or pipe."""
    if sc.journal == "broken pipe":
        read_end, write_end = os.pipe()
        journal = Journal(f"/dev/fd/{write_end}", keep=keep)
        os.close(write_end)
        os.close(read_end)  # the reader is gone before the first line
        return journal
    return Journal(sc.journal or None, keep=keep)


async def run_scenario(sc: Scenario, requests: int, concurrency: int) -> Report:
    async with trio.open_nursery() as nursery:
        journal = _journal(sc, (requests + EVIDENCE_EXTRA) * 4 + 100)
        h = await start_fleet(
            nursery,
            ROLES,
            engine_config={"log_size": requests * 8 + 100, **sc.engine_config},
            engine_configs={
                eid: {**sc.engine_configs.get(eid, {}), **({"models": names} if names else {})}
                for eid, names in ((eid, sc.models.get(eid)) for eid in ROLES)
            },
            journal=journal,
            serving=sc.serving,
            engine=ENGINE,
            recovery=sc.recovery,
            admission=sc.admission,
            placement=sc.placement,
            prediction=sc.prediction,
            kv_events=KvEventsConfig(mode="subscribe" if sc.kv_knobs else "off"),
        )
        if sc.kv_knobs:
            await _kv_attached(h)
        for eid in sc.stopped:
            h.engines[eid].stop()
        arm = _armer(h, sc)
        arm(True)
        results = await _load(h, sc, requests, concurrency, arm)
        report = await _reconcile(h, sc, results)
        if sc.expect.endswith("readmitted"):
            await _await_readmission(h, report)
        h.stop.set()
        with trio.fail_after(5):
            await h.stopped.wait()
        nursery.cancel_scope.cancel()  # the engines
    return report


async def _await_readmission(h: Harness, report: Report) -> None:
    """The probe readmits a recovered engine within a few readmission intervals."""
    if h.router.fleet.by_id["d0"].breaker.ejections == 0:
        report.extra = "d0 never ejected in so short a run"
        return
    with trio.move_on_after(20 * RECOVERY.readmit_interval_s):
        await h.router.events.wait_event("readmitted", "d0")
        report.extra = "d0 readmitted: yes"
        return
    report.extra = "d0 readmitted: NO"
    report.problems.append("d0 was not readmitted after it recovered")


def _armer(h: Harness, sc: Scenario) -> Callable[[bool], None]:
    def arm(on: bool) -> None:
        for eid, faults in sc.armed.items():
            h.engines[eid].faults.clear()
            if on:
                h.engines[eid].faults.push(*faults)

    return arm


async def _load(
    h: Harness, sc: Scenario, requests: int, concurrency: int, arm: Callable[[bool], None]
) -> list[ClientResult]:
    results: list[ClientResult] = []
    pool = httpcore.AsyncConnectionPool(max_connections=concurrency, keepalive_expiry=5.0)
    next_index = 0
    evidence_by = math.inf  # when the run stops waiting for an expected ejection

    def more() -> bool:
        # A scenario that expects an ejection keeps its load on (bounded, EVIDENCE_*) until
        # the failing engine has met enough legs to be judged: a short run can finish on the
        # healthy consumers while d0's first hung legs still hold it out of placement.
        nonlocal evidence_by
        if next_index < requests:
            return True
        if not _awaits_ejection(h, sc) or next_index >= requests + EVIDENCE_EXTRA:
            return False
        if evidence_by == math.inf:
            evidence_by = trio.current_time() + EVIDENCE_S
        return trio.current_time() < evidence_by

    async def worker() -> None:
        nonlocal next_index
        while more():
            i = next_index
            next_index += 1
            if sc.recover_at is not None and i == int(requests * sc.recover_at):
                arm(False)
            if sc.slow_at is not None and i == int(requests * sc.slow_at):
                slow = h.engines["p0"]
                slow.config = msgspec.structs.replace(slow.config, slowdown=SLOWER)
            if sc.flap_every and i and i % sc.flap_every == 0:
                arm((i // sc.flap_every) % 2 == 0)
            if sc.kv_knobs and i and i % min(sc.kv_every, max(2, requests // 4)) == 0:
                await _kv_turn(h, pool, sc.kv_knobs)
            results.append(await one_request(pool, h.url, sc, i))

    async with pool, trio.open_nursery() as workers:
        for _ in range(concurrency):
            workers.start_soon(worker)
        if sc.kill:
            # d0 takes about a third of the streams: a quarter of the load is on it
            workers.start_soon(_kill_mid_stream, h.engines["d0"], max(2, concurrency // 4))
    return results


async def _kill_mid_stream(engine: Any, running: int) -> None:
    """Stop ``engine`` as a SIGKILL would (connections dropped, new ones refused) once
    ``running`` of its streams are under way and one has sent tokens (or the load is about
    to end)."""
    with trio.move_on_after(CLIENT_LIMIT_S):
        await engine.wait_running(running)
        await engine.wait_streamed(2)
    engine.stop()


def _awaits_ejection(h: Harness, sc: Scenario) -> bool:
    if not sc.expect.endswith("ejected"):
        return False
    return h.router.fleet.by_id["d0"].breaker.state.value not in ("ejected", "probing")


async def _reconcile(h: Harness, sc: Scenario, results: list[ClientResult]) -> Report:
    router, problems = h.router, []
    with trio.move_on_after(DRAIN_S):
        await router.wait_drained()
        await router.reclaimer.wait_idle()
    # a readmission probe in flight holds one producer and one consumer leg: not a leak
    probes = router.health.probe_handoffs
    reserved = router.fleet.reserved() - 2 * probes
    busy = max(0, sum(active for _, active in router.client.connections().values()) - 2 * probes)
    tasks = live_tasks(REQUEST_TASKS)
    slots = router.admission.admitted  # max_inflight slots still held
    if reserved or busy or tasks or slots:
        problems.append(
            f"after {DRAIN_S:g}s: {reserved} reservations, {busy} busy, {tasks} tasks, "
            f"{slots} admission slots"
        )
    stranded, fates, excused = _stranded_kv(h)
    leaks = f"{reserved}/{busy}/{tasks}/{slots}/{stranded}"
    if fates:
        problems.append(fates)

    outcomes = Counter(r.outcome for r in results)
    lines = router.journal.lines
    ids = Counter(line.request_id for line in lines)
    # a client that gives up before its request is even read never reaches the router: the
    # only requests the router may not have are ones whose client disconnected
    unseen = len(results) - router.admission.received
    journal_ok = (
        router.journal.written == router.admission.received
        and 0 <= unseen <= outcomes["disconnected"]
        and all(n == 1 for n in ids.values())
        and all(r.rid is None or ids[r.rid] == 1 for r in results)
    )
    by_id = {line.request_id: line for line in lines}
    for r in results:
        line = by_id.get(r.rid or "")
        if line is not None and (r.outcome == "ok") != (line.outcome == "completed"):
            journal_ok = False
    if not journal_ok:
        problems.append(
            f"journal {router.journal.written} lines, router {router.admission.received}, "
            f"client {len(results)}"
        )
    legs = _legs(h.engines.values())
    # attempts as the router records them (refused connections included), and as the
    # producers saw them: the engines can never have seen more than the router sent
    attempts = sum(len(line.attempts) for line in lines)
    reached = len({leg["request_id"].rsplit("-", 1)[0] for leg in legs if leg["prefill"]})
    resumed = _resume_attempts(lines)  # continuations are counted by their own rule
    if attempts - len(resumed) > 1.2 * len(results) + 3 or reached > attempts:
        problems.append(f"{attempts} attempts ({reached} reached a producer) for {len(results)}")
    after_output = _retries_after_output(legs, resumed)
    misuse = _descriptor_misuse(h.engines.values(), legs)
    lag = _cancel_lag(results, legs)
    if lag is not None and lag > CANCEL_LAG_S:
        problems.append(f"an engine leg outlived its client's disconnect by {lag:.2f}s")
    for name, count in (
        ("hung", outcomes["hung"]),
        ("retries after output", after_output),
        ("descriptor misuse", misuse),
        ("200 cut without a terminal event", outcomes["truncated"]),
        ("terminal events in a body ended whole", outcomes["terminal-error-whole"]),
        ("wrong or empty 200 answers", outcomes["wrong"]),
    ):
        if count:
            problems.append(f"{count} {name}")
    extra = await _expectation(h, sc, problems) or await _front_door(h, sc, results, problems)
    if excused:
        extra = f"{extra}; {excused}" if extra else excused
    return Report(
        sc.name,
        len(results),
        outcomes,
        journal_ok,
        attempts,
        reached,
        outcomes["hung"],
        after_output,
        misuse,
        leaks,
        lag,
        outcomes["truncated"],
        outcomes["wrong"],
        extra,
        problems,
    )


# reclaim drops that leave a descriptor to its lease because no consumer could take it
_NO_TAKER = ("lease", "no_consumer", "saturated")


def _stranded_kv(h: Harness) -> tuple[int, str, str]:
    """(valid descriptors stranded, a problem, why the stranded ones are excused).

    Stranded: KV a producer still holds once the router is idle (lease not run out) for a
    descriptor it handed out intact and the router held as a valid handoff (the journal's
    attempt has a fate; a probe's counts too). Every one of those must have been decoded or
    reclaimed (invariant 7), unless no consumer could take its reclaim (dropped for the
    lease, no consumer, or saturation: counted, and the scenario says so). KV behind an
    invalid descriptor, a cut response or a cancelled prefill is no router's to free.
    Also a problem: handoff fates that do not add up (every descriptor decoded, expired or
    orphaned, and every one not decoded reclaimed, or its reclaim failed or dropped)."""
    lines = {line.request_id: line for line in h.router.journal.lines}
    held = [
        lease.origin
        for e in h.engines.values()
        for lease in e.store.pending()
        if _held(lease.origin, lines)
    ]
    # a readmission probe still in flight holds its handoff: its consumer has not answered
    # yet, so its KV is not stranded (the probe reclaims it when it fails)
    in_flight = min(h.router.health.probe_handoffs, sum(o.startswith("probe-") for o in held))
    stranded = len(held) - in_flight
    value = h.router.metrics.registry.get_sample_value

    def fate(name: str) -> float:
        return value("narwhal_handoffs_total", {"fate": name}) or 0.0

    produced = fate("produced")
    left = fate("expired") + fate("orphaned")
    reclaim = fate("reclaimed") + fate("reclaim_failed") + fate("reclaim_dropped")
    if produced != fate("decoded") + left or (
        h.router.config.engine.reclaim_orphans and reclaim != left
    ):
        return (
            stranded,
            f"handoff fates do not add up: {produced} produced, {left} left, "
            f"{reclaim} reclaim outcomes",
            "",
        )
    drops = {r: int(value("narwhal_reclaim_dropped_total", {"reason": r}) or 0) for r in _NO_TAKER}
    no_taker = sum(drops.values())
    if stranded > no_taker:
        return (
            stranded,
            f"{stranded} valid descriptors stranded on the producers, {no_taker} of them "
            f"with no consumer to take their reclaim ({drops})",
            "",
        )
    if stranded:
        given = ", ".join(f"{r} {n}" for r, n in drops.items() if n)
        return stranded, "", f"{stranded} stranded: no consumer could take a reclaim ({given})"
    return 0, "", ""


def _held(origin: str, lines: dict[str, Any]) -> bool:
    """Whether the router held the descriptor of the prefill leg ``origin`` as valid: a
    client attempt's journal entry records its fate; a probe's crossed handoff always."""
    if origin.startswith("probe-"):
        return True
    stem, _, attempt = origin.removesuffix("-prefill").rpartition("-a")
    line = lines.get(stem)
    if line is None or not attempt.isdigit() or int(attempt) > len(line.attempts):
        return False
    return line.attempts[int(attempt) - 1].handoff_fate is not None


def _legs(engines: Any) -> list[dict[str, Any]]:
    """Client-request legs on every engine (probes left out), marked prefill or decode."""
    out = []
    for engine in engines:
        for entry in engine.log:
            rid = entry["request_id"]
            if not rid or rid.startswith("probe-") or not rid.endswith(("-prefill", "-decode")):
                continue
            out.append({**entry, "prefill": rid.endswith("-prefill")})
    return out


def _resume_attempts(lines: list[Any]) -> set[str]:
    """The attempts (``<request id>-a<N>``) that continued a stream (contract 6.4)."""
    return {
        f"{line.request_id}-a{a.number}"
        for line in lines
        for a in line.attempts
        if a.resumed_at_token is not None
    }


def _retries_after_output(legs: list[dict[str, Any]], resumed: set[str]) -> int:
    """Requests with more than one decode leg that sent the client tokens, continuations
    of a stream resume (contract 6.4, the one exception) aside."""
    speaking: Counter[str] = Counter()
    for leg in legs:
        if leg["request_id"].removesuffix("-decode") in resumed:
            continue
        if not leg["prefill"] and leg["tokens"] > 0:
            speaking[leg["request_id"].split("-a", 1)[0]] += 1
    return sum(1 for n in speaking.values() if n > 1)


def _descriptor_misuse(engines: Any, legs: list[dict[str, Any]]) -> int:
    """Descriptors pulled twice, never issued, forged or expired; client descriptors sent;
    releases (reclaims) of descriptors never issued, forged or expired. A reclaim may
    release a descriptor its decode leg already read, when the client left between the
    consumer's read and its response head: harmless, and not a second use."""
    misuse = 0
    for engine in engines:
        misuse += sum(engine.counters[f"kv_pull_refused_{why}"] for why in _REFUSED)
        misuse += sum(
            engine.counters[f"kv_release_declined_{why}"] for why in _REFUSED if why != "reused"
        )
    for leg in legs:
        kv = leg["body"].get("kv_transfer_params")
        if leg["prefill"] and kv != {"do_remote_decode": True}:
            misuse += 1
        if not leg["prefill"] and isinstance(kv, dict) and kv.get("remote_engine_id") == "forged":
            misuse += 1
    return misuse


def _cancel_lag(results: list[ClientResult], legs: list[dict[str, Any]]) -> float | None:
    """The longest an engine leg ran on after its client disconnected (None: no disconnects)."""
    gone = {r.tag: r.disconnected_at for r in results if r.disconnected_at is not None}
    if not gone:
        return None
    worst = 0.0
    for leg in legs:
        tag = _tag_of(leg["body"])
        at = gone.get(tag)
        if at is None:
            continue
        end = leg["end"] if leg["end"] is not None else trio.current_time()
        worst = max(worst, end - at)
    return worst


def _tag_of(body: dict[str, Any]) -> str:
    text = body.get("prompt")
    if not isinstance(text, str):
        messages = body.get("messages") or [{}]
        text = str(messages[0].get("content", ""))
    return text.split(" ", 1)[0]


async def _front_door(
    h: Harness, sc: Scenario, results: list[ClientResult], problems: list[str]
) -> str:
    """What the front-door scenarios must show besides the invariants above."""
    if sc.expect == "stalled cut":
        stalled = [r for r in results if _stalls(sc, r.index)]
        lines = {line.request_id: line for line in h.router.journal.lines}
        late = [r for r in stalled if r.outcome not in ("stalled-cut", "terminal-error")]
        ended = Counter(lines[r.rid].outcome for r in stalled if r.rid in lines)
        if late or ended["completed"]:
            problems.append(f"stalled readers not ended at the deadline: {len(late)}, {ended}")
        return f"stalled: {len(stalled)}, journal {dict(ended)}"
    if sc.expect == "h2 refused":
        tried = [r.h2_refused for r in results if r.h2_refused is not None]
        if not all(tried):
            problems.append(f"{tried.count(False)} HTTP/2 clients not refused with GOAWAY")
        return f"HTTP/2 refused: {sum(tried)}/{len(tried)}"
    if sc.expect == "journal drops":
        journal = h.router.journal
        await trio.to_thread.run_sync(journal.flush)
        if journal.dropped < journal.written:
            problems.append(f"journal dropped {journal.dropped} of {journal.written} lines")
        return f"journal dropped {journal.dropped}/{journal.written}"
    return ""


async def _kv_attached(h: Harness) -> None:
    """Every engine's publisher has the router's subscription: no batch is lost to it."""
    with trio.fail_after(5):
        for engine in h.engines.values():
            assert engine.kv_events is not None
            await engine.kv_events.wait_subscribed(1)


async def _kv_turn(h: Harness, pool: httpcore.AsyncConnectionPool, knobs: dict[str, Any]) -> None:
    """Turn p0's KV-event knobs, as ``POST /fake/kv_events`` does."""
    url = h.router.fleet.by_id["p0"].url + "/fake/kv_events"
    with trio.fail_after(10):
        answer = await pool.request("POST", url, content=msgspec.json.encode(knobs))
    assert answer.status == 200, answer.content


async def _kv_kept(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """Invariant 12: after the run, the router holds exactly what each engine's cache holds
    (or less, where a gap could not be repaired and the engine has not stored since), and
    p0's stream shows what its knob did."""
    router, what = h.router, sc.expect.removeprefix("kv ")

    def agree() -> bool:
        for engine_id, engine in h.engines.items():
            stream = router.fleet.precise.streams.get(engine_id)
            held = len(engine.prefix_cache.blocks)
            if stream is None or not stream.live or len(stream.blocks) > held:
                return False
            if what != "unrepaired" and len(stream.blocks) != held:
                return False
        return True

    # a batch lost at the very end (or a restart) shows only with the next one: p0 stores
    # a prompt of its own, until the views agree (a knob still pending may take one)
    p0_url = router.fleet.by_id["p0"].url
    async with httpcore.AsyncConnectionPool() as pool:
        for n in range(3):
            words = " ".join(f"settle{n}w{k}" for k in range(40))
            body = {"model": MODEL, "prompt": words, "max_tokens": 1}
            with trio.fail_after(5):
                await pool.request(
                    "POST", p0_url + "/v1/completions", content=msgspec.json.encode(body)
                )
            with trio.move_on_after(2):
                await router.kv_subscriber.wait_until(agree)
            if agree():
                break
    if not agree():
        views = {e: s.view() for e, s in router.fleet.precise.streams.items()}
        problems.append(f"the router's view is not the engines' caches: {views}")
    p0 = router.fleet.precise.streams["p0"].view()
    rejected: Any = p0["rejected"]
    seen = {
        "flood": p0["batches"],
        "batch": rejected.get("batch", 0),
        "restarts": p0["restarts"],
        "repaired": p0["repaired"],
        "unrepaired": p0["unrepaired"],
    }[what]
    if not seen:
        problems.append(f"p0's stream shows no {what}: {p0}")
    return f"p0 {what}: {seen}, blocks {p0['blocks']}"


async def _expectation(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """A failing engine is out of placement at the end (ejected, or being probed); a
    saturated fleet queued requests and kept invariant 11."""
    if sc.expect.startswith("kv "):
        return await _kv_kept(h, sc, problems)
    if sc.expect == "queued":
        return _queue_kept(h, sc, problems)
    if sc.expect == "resumed":
        return _resumes_kept(h, sc, problems)
    if sc.expect == "adapter kept apart":
        return _adapter_kept_apart(h, sc, problems)
    if sc.expect == "p0 slowed":
        return _slowed(h, sc, problems)
    mixed = _mixed(h, sc, problems)
    if not sc.expect.endswith("ejected"):
        return mixed
    state = h.router.fleet.by_id["d0"]
    breaker = state.breaker.state.value
    ok = breaker in ("ejected", "probing")
    if not ok:
        problems.append(f"expected {sc.expect}, d0 is {breaker}")
    ejected = (
        f"{sc.expect}: {'yes' if ok else 'NO'} ({breaker}, {state.breaker.ejections} ejections)"
    )
    return f"{ejected}; {mixed}" if mixed else ejected


def _slowed(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """p0 turned 5x slower at ``slow_at`` of the run: once the model has relearned it (the
    last half of the run), it takes a smaller share of the prefills than before. Judged
    at 100 requests or more (the short run of ``make test`` only reports it)."""
    lines = [line for line in h.router.journal.lines if line.attempts]
    cut = int(len(lines) * (sc.slow_at or 0.0))
    before, after = lines[:cut], lines[len(lines) // 2 :]

    def share(part: list[Any]) -> float:
        prefills = [line.attempts[-1].producer for line in part if line.attempts[-1].producer]
        return prefills.count("p0") / len(prefills) if prefills else 0.0

    was, now = share(before), share(after)
    if len(lines) >= 100 and not now < was:
        problems.append(f"p0 turned {SLOWER:g}x slower and kept its share ({was:.0%} -> {now:.0%})")
    return f"p0's share of prefills: {was:.0%} before it slowed, {now:.0%} after"


def _adapter_kept_apart(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """An adapter's only consumer down: none of its legs reached an engine that does not
    serve it, each of its requests failed honestly (502 or 503, never a 404 nor a 200 from
    the base model), and the base model's requests went on without that consumer."""
    serving = set(sc.models)
    strays = [
        eid
        for eid, engine in h.engines.items()
        if eid not in serving
        for leg in engine.log
        if (leg.get("body") or {}).get("model") == ADAPTER
    ]
    if strays:
        problems.append(f"{len(strays)} adapter legs reached {sorted(set(strays))}")
    lines = [line for line in h.router.journal.lines if line.model == ADAPTER]
    statuses = Counter(line.status for line in lines)
    if not lines or set(statuses) - {502, 503}:
        problems.append(f"the adapter's requests ended {dict(statuses)}, not in 502 or 503")
    base = [line for line in h.router.journal.lines if line.model == MODEL]
    served = sum(1 for line in base if line.status == 200)
    if not served:
        problems.append("no request for the base model was served")
    return f"adapter {dict(statuses)}; base served {served}/{len(base)}"


def _resumes_kept(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """Stream resume: streams broke after output, and each went on to its end (every
    client's answer was checked whole against the engine's script: no error event, no
    token repeated or missing), with the tokens asked for; none was refused."""
    value = h.router.metrics.registry.get_sample_value

    def count(outcome: str) -> int:
        return int(value("narwhal_stream_resumes_total", {"outcome": outcome}) or 0)

    resumed, completed = count("resumed"), count("completed")
    refused, failed = count("refused"), count("failed")
    lines = h.router.journal.lines
    ended = Counter(line.outcome for line in lines if line.outcome != "completed")
    if ended:
        problems.append(f"requests not completed: {dict(ended)}")
    short = [line.request_id for line in lines if line.tokens != sc.max_tokens]
    if not resumed or completed != resumed or refused or failed:
        problems.append(
            f"resumes: {resumed} resumed, {completed} completed, {failed} failed, {refused} refused"
        )
    if short:
        problems.append(f"{len(short)} completed with other than {sc.max_tokens} tokens")
    return f"resumed {resumed}, completed {completed}"


def _mixed(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """Decode first: the run had local attempts (no producer leg, no descriptor) beside
    disaggregated ones, and no local attempt's request id reached a producer."""
    if not sc.placement.local_prefill_tokens:
        return ""
    attempts = [(line.request_id, a) for line in h.router.journal.lines for a in line.attempts]
    local = {f"{rid}-a{a.number}" for rid, a in attempts if a.local}
    remote = [a for _, a in attempts if not a.local and a.producer is not None]
    if not local or not remote:
        problems.append(f"{len(local)} local and {len(remote)} disaggregated attempts")
    produced = {leg["request_id"].removesuffix("-prefill") for leg in _legs(h.engines.values())}
    if local & produced:
        problems.append(f"a local attempt reached a producer: {sorted(local & produced)[0]}")
    return f"local {len(local)}, disaggregated {len(remote)}"


def _queue_kept(h: Harness, sc: Scenario, problems: list[str]) -> str:
    """Invariant 11 from the journal: requests waited in the queue, none longer than
    ``max_queue_wait_s`` (plus the scheduling slack of a loaded machine), and one that left
    it without being dispatched holds no attempt (it never reached an engine)."""
    lines = h.router.journal.lines
    waited = [line for line in lines if line.queued_s > 0]
    bound = sc.admission.max_queue_wait_s + QUEUE_SLACK_S
    too_long = [line.request_id for line in waited if line.queued_s > bound]
    shed = [line for line in lines if line.outcome == "rejected" and line.status == 429]
    attempted = [line.request_id for line in shed if line.attempts]
    if not waited:
        problems.append("no request waited in the queue: the fleet was never saturated")
    if too_long:
        problems.append(f"{len(too_long)} waited past max_queue_wait_s, e.g. {too_long[0]}")
    if attempted:
        problems.append(f"{len(attempted)} shed by the queue had attempts, e.g. {attempted[0]}")
    return f"queued {len(waited)}, shed 429 {len(shed)}"


# ---- the table ------------------------------------------------------------------------------


def table(reports: list[Report]) -> str:
    head = (
        "| scenario | requests | client outcomes | journal = client | attempts: journal / "
        "reached a producer (limit) | hung | retries after output | descriptor misuse "
        "| leaks res/conn/tasks/slots/kv | cancel lag max | cut w/o terminal | verdict |"
    )
    rows = [head, "|" + "---|" * 12]
    for r in reports:
        outcomes = " ".join(f"{k}:{v}" for k, v in sorted(r.outcomes.items()))
        lag = "-" if r.cancel_lag_s is None else f"{r.cancel_lag_s * 1000:.0f} ms"
        limit = int(1.2 * r.requests + 3)
        verdict = "pass" if r.passed else "FAIL: " + "; ".join(r.problems)
        if r.extra:
            verdict += f" ({r.extra})"
        rows.append(
            f"| {r.name} | {r.requests} | {outcomes} | {'yes' if r.journal_ok else 'NO'} "
            f"| {r.attempts} / {r.reached} ({limit}) | {r.hung} | {r.retries_after_output} "
            f"| {r.descriptor_misuse} | {r.leaks} | {lag} | {r.cut_without_terminal} | {verdict} |"
        )
    return "\n".join(rows)


async def run_all(
    scenarios: list[Scenario], requests: int, concurrency: int, echo: bool = False
) -> list[Report]:
    reports = []
    for sc in scenarios:
        report = await run_scenario(sc, requests, concurrency)
        if echo:
            print(f"{sc.name}: {'pass' if report.passed else report.problems}", file=sys.stderr)
        reports.append(report)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--only", help="run the scenarios whose name contains this")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or args.only in s.name]
    reports = trio.run(run_all, chosen, args.requests, args.concurrency, True)
    print(table(reports))
    failed = [r.name for r in reports if not r.passed]
    print(f"\n{len(reports) - len(failed)}/{len(reports)} scenarios hold every invariant")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
