"""Stream resume on real vLLM (contract 6.4, ``recovery.resume_streams``).

A second consumer joins the session's pair for this module only, so that a decode can be
resumed elsewhere: a router of its own (``resume_streams = 1``, a journal) places prefill on
p0 (the session's producer) and decode on d0 (the session's consumer) or d1 (started here).

For a greedy 448-token completion, a greedy 448-token chat and a greedy chat with no limit
(bounded by the context's end, as its continuation is), each:

* the reference: the request once, streamed and uninterrupted, through the same router;
* the same request streamed again with both consumers frozen (SIGSTOP) until the router's
  ``/narwhal/engines`` shows its decode leg on one of them (``inflight.decode`` 1); the
  other is let go, the serving one is stepped (let run ``STEP_S`` at a time or a little
  longer, frozen between) until ``KILL_AT`` text chunks have reached the client, then
  SIGKILLed, frozen, its whole process group. The router continues the stream (a prefill
  of the prompt's ids and the ids sent, a decode on the other consumer): the client's
  text equals the reference exactly, one usage counts the prompt once and every token,
  the stream ends with ``data: [DONE]``, no error event, one ``id`` throughout, no token
  ids the client did not ask for;
* the journal's line for it (by ``x-request-id``) has two attempts, the first on the
  killed consumer, the second with ``resumed_at_token`` (the ids sent before the failure:
  at least ``KILL_AT``, fewer than the reference's) and a producer and consumer of its own.

The kill needs the decode still running when it lands: a warm CPU engine streams these
tokens in about a second, and a busy machine once let a whole stream end before the test,
reading the router's view at its 8th chunk, saw its consumer. Frozen, the serving engine
cannot finish first, however late the test's reads come; only a step the loaded machine
stretched can (one brought 95 tokens). The stream is sent once the router has no decode
leg in flight, so the leg seen is its own (a run once saw a leftover leg on the other
consumer, and killed that). A try that missed (its stream ended first, or the journal's
first attempt is not on the consumer killed) runs again, up to ``TRIES`` times. Every
consumer's server has also streamed each shape before (``warm_paths``: a cold server
merges outputs into a few chunks).

The client-side gap (the longest wait between text chunks from the last one before the
kill on: tokens the killed engine had written already may come first) is printed,
never asserted (handoffs here stall 15-30 s at times). The killed engine is restarted at
its URL before the next case, and the session's consumer is up again when the module ends.

Greedy continuation from token ids gives the uninterrupted text exactly on this model (the
probe ``resume_probe.py``, ``results/resume_probe.json``: cuts 1, 7, 30, 64, 127, both
shapes). A chunk may carry several ids (vLLM merges outputs a slow reader has not taken),
so ``KILL_AT`` counts chunks and ``resumed_at_token`` is checked as at least that.

Runs last (file order): it kills consumers.
"""

from __future__ import annotations

import itertools
import json
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import (
    HANDOFF_S,
    MODEL,
    PATIENT_ENGINE,
    PATIENT_SERVING,
    SSE,
    Engine,
    Event,
    Fleet,
    Process,
    fleet_toml,
    http,
    journal_line,
    restart,
    serve_router,
    start_engine,
    warm_pair,
)

pytestmark = pytest.mark.vllm

# greedy output here never ends early (resume_probe.json, same prompts: the completion
# repeats two ids, the chat one), so each case runs to its limit
# near the context's end (512): a restarted engine once streamed 256 tokens of chat in
# 0.6 s, over before the router's view was read at the kill's chunk
TOKENS = 420  # the completion's prompt is 77 tokens
# text chunks the client has read when the serving consumer is killed. Few: a busy engine
# merges outputs (a CI run once saw 165 tokens in the first 30 chunks, and a 256-token
# chat ended before its 30th), so the kill comes early in tokens whatever the merging
KILL_AT = 8
# how long a frozen consumer runs between looks at what the client read, at first and at
# most (a warm engine here decodes some 400 tokens a second)
STEP_S, MAX_STEP_S = 0.01, 0.04
TRIES = 3  # a try that missed its stream (a stretched step, another leg seen): again
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3 + "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a lazy dog and a fox."}]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": ("/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS}),
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": TOKENS}),
    # no limit: bounded by the context's end (the consumer's max_model_len, 512 here), and
    # its continuation too
    "chat, no limit": ("/v1/chat/completions", {"messages": MESSAGES}),
}


@pytest.fixture(scope="module")
def consumers(fleet: Fleet) -> Iterator[dict[str, Engine]]:
    """The session's consumer (d0) and a second one started here (d1), both paired with
    the session's producer."""
    second = start_engine(fleet, "consumer-b", "kv_consumer")
    try:
        warm_pair(fleet.producer, second)
        for engine in (fleet.consumer, second):  # the session's consumer may be cold too
            warm_paths(engine)
        yield {"d0": fleet.consumer, "d1": second}
    finally:
        second.stop()
        if fleet.consumer.proc is None or fleet.consumer.proc.poll() is not None:
            restart(fleet.consumer)  # for whatever runs after this module
            warm_pair(fleet.producer, fleet.consumer)


@pytest.fixture(scope="module")
def resuming(fleet: Fleet, consumers: dict[str, Engine]) -> Iterator[tuple[Process, Path]]:
    journal = fleet.logs / "router-resume.jsonl"
    text = fleet_toml(
        [
            ("p0", fleet.producer.url, "prefill"),
            ("d0", consumers["d0"].url, "decode"),
            ("d1", consumers["d1"].url, "decode"),
        ],
        serving=PATIENT_SERVING,
        engine=PATIENT_ENGINE,
        recovery={"eject_after": 2, "readmit_interval_s": 3.0, "resume_streams": 1},
    )
    router = serve_router(fleet, "router-resume", text, ("--journal", str(journal)))
    try:
        yield router, journal
    finally:
        router.stop()


def engines_view(url: str) -> dict[str, dict[str, Any]]:
    status, body = http("GET", url + "/narwhal/engines", timeout=30)
    assert status == 200, body
    return {e["id"]: e for e in json.loads(body)["engines"]}


def warm_paths(engine: Engine) -> None:
    """Each case's shape streamed once straight to a fresh engine. The first chat an
    engine's server renders is slow (its template and detokenizer start up), and while it
    is, the engine goes on decoding and merges the outputs: the whole stream then reaches
    the client in a few chunks, done before the kill at ``KILL_AT`` could land."""
    for case in CASES:
        path, body = body_of(case)
        stream = SSE(engine.url, path, {**body, "max_tokens": 4})
        try:
            assert stream.response.status == 200
            events = list(stream.events())
        finally:
            stream.close()
        assert events, (engine.name, case, stream.cut)
        assert events[-1].data == "[DONE]", (engine.name, case, stream.cut)


def every_consumer_serving(
    fleet: Fleet, router_url: str, consumers: dict[str, Engine], budget_s: float = 120.0
) -> None:
    """A consumer killed by an earlier case up again, paired, and placeable in the
    router's view (up, its breaker closed)."""
    for engine in consumers.values():
        if engine.proc is None or engine.proc.poll() is not None:
            restart(engine)
            warm_pair(fleet.producer, engine)  # its first pull redoes the NIXL handshake
            warm_paths(engine)
    deadline = time.monotonic() + budget_s
    while True:
        view = engines_view(router_url)
        if all(view[i]["up"] and view[i]["breaker"]["state"] == "closed" for i in consumers):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the consumers are not all placeable within {budget_s:.0f}s: {view}")
        time.sleep(1.0)  # health checks and probes run on their own; bounded by budget_s


def decoding_consumers(router_url: str, consumers: dict[str, Engine]) -> list[str]:
    """The consumers on which the router has a decode leg in flight, by its own view."""
    view = engines_view(router_url)
    return [i for i in consumers if view[i]["inflight"]["decode"] > 0]


class Reader(threading.Thread):
    """The client's side of the stream, read in a thread of its own: the test freezes and
    steps the serving consumer meanwhile, and counts what the client has read."""

    def __init__(self, url: str, path: str, body: dict[str, Any], rid: str) -> None:
        super().__init__(daemon=True)
        self.request = (url, path, body, {"x-request-id": rid})
        self.stream: SSE | None = None
        self.status: int | None = None
        self.events: list[Event] = []
        self.texts = 0  # events with text, as a client counts them
        self.lock = threading.Lock()

    def run(self) -> None:
        # the head waits for the first token (a frozen consumer's): sent from here
        self.stream = SSE(*self.request, timeout=HANDOFF_S * 2)
        self.status = self.stream.response.status
        for event in self.stream.events():  # bounded by the stream's read timeout
            chunk = event.json()
            with self.lock:
                self.events.append(event)
                self.texts += bool(chunk is not None and text_of(chunk))

    def settled(self, quiet_s: float = 0.3, budget_s: float = 10.0) -> tuple[int, int]:
        """Once nothing new has come for ``quiet_s`` (a frozen engine sends nothing more,
        and what it wrote has reached the client): the text chunks and events read."""
        deadline = time.monotonic() + budget_s
        last = (-1, -1)
        while time.monotonic() < deadline and self.is_alive():
            time.sleep(quiet_s)  # the client's reads, bounded by budget_s
            with self.lock:
                now = (self.texts, len(self.events))
            if now == last:
                break
            last = now
        with self.lock:
            return self.texts, len(self.events)


def one_decoding(
    router_url: str, consumers: dict[str, Engine], reader: Reader, budget_s: float = 120.0
) -> str | None:
    """The consumer on which the router's decode leg runs, once its view shows exactly
    one (both consumers are frozen meanwhile, so the leg cannot end first); None when the
    stream ended without one."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline and reader.is_alive():
        serving = decoding_consumers(router_url, consumers)
        if len(serving) == 1:
            return serving[0]
        time.sleep(0.05)  # the router places the decode after the prefill; bounded
    return None


def step_until(engine: Engine, reader: Reader, texts: int, steps: int = 200) -> int:
    """Let a frozen engine run a moment at a time until the client has read ``texts``
    text chunks (or the stream ended); it is left frozen. The events read then. A step
    starts at ``STEP_S`` and doubles while it brings nothing (the decode's start, its KV
    pull, take longer than a token): one step once brought 95 tokens here."""
    step = STEP_S
    read, count = reader.settled()
    for _ in range(steps):  # bounded: a few tokens a step
        if read >= texts or not reader.is_alive():
            break
        engine.signal(signal.SIGCONT)
        time.sleep(step)  # the engine's own pace, for one step
        engine.signal(signal.SIGSTOP)
        before = read
        read, count = reader.settled()
        step = step if read > before else min(step * 2, MAX_STEP_S)
    return count


def ended(events: list[Event]) -> bool:
    return bool(events) and events[-1].data == "[DONE]"


def missed_by(reader: Reader, killed: str, killed_after: int, line: dict[str, Any]) -> str | None:
    """Why a try did not cut its own stream, or None when it did: the stream ended
    within a step, or the leg the router's view showed was another request's (the
    journal's first attempt is on the consumer killed when it was cut)."""
    if ended(reader.events[:killed_after]):
        return "the stream ended within a step, before the kill"
    first = line["attempts"][0].get("consumer")
    if first != killed:
        return f"the decode seen on {killed} was not this stream's (on {first})"
    return None


def quiet(router_url: str, consumers: dict[str, Engine], budget_s: float = 60.0) -> None:
    """Until the router has no decode leg on any consumer: the next one seen is the
    stream's (a leg of the last case's, or a probe's, once showed on the other)."""
    deadline = time.monotonic() + budget_s
    while decoding_consumers(router_url, consumers):
        if time.monotonic() > deadline:
            pytest.fail(f"the router's consumers kept a decode leg for {budget_s:.0f}s")
        time.sleep(0.2)  # legs end on their own; bounded by budget_s


def cut_once(
    url: str, case: str, consumers: dict[str, Engine], rid: str
) -> tuple[Reader, str | None, int | None]:
    """The case streamed with its consumer killed after ``KILL_AT`` text chunks: the
    client's side, the consumer killed, and the events read at the kill."""
    path, body = body_of(case)
    reader = Reader(url, path, body, rid)
    killed: str | None = None
    killed_after: int | None = None
    quiet(url, consumers)
    try:
        for engine in consumers.values():  # until the router has placed the decode
            engine.signal(signal.SIGSTOP)
        reader.start()
        killed = one_decoding(url, consumers, reader)
        if killed is not None:
            for other in consumers:
                if other != killed:
                    consumers[other].signal(signal.SIGCONT)  # the resume's consumer
            killed_after = step_until(consumers[killed], reader, KILL_AT)
            consumers[killed].signal(signal.SIGKILL)  # its group, by its id, frozen
        reader.join(timeout=HANDOFF_S * 4)
    finally:
        for engine in consumers.values():
            engine.signal(signal.SIGCONT)
        if reader.stream is not None:
            reader.stream.close()
        reader.join(timeout=5)
    return reader, killed, killed_after


def text_of(chunk: dict[str, Any]) -> str:
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    if "text" in choice:
        return str(choice["text"] or "")
    return str(choice.get("delta", {}).get("content") or "")


def body_of(case: str) -> tuple[str, dict[str, Any]]:
    path, fields = CASES[case]
    body = {
        "model": MODEL,
        **fields,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return path, body


def reference(router_url: str, case: str) -> tuple[str, dict[str, Any]]:
    """The uninterrupted text and usage of the case through the router."""
    path, body = body_of(case)
    stream = SSE(router_url, path, body)
    try:
        assert stream.response.status == 200
        events = list(stream.events())
    finally:
        stream.close()
    chunks = [c for e in events if (c := e.json()) is not None]
    assert events, stream.cut
    assert events[-1].data == "[DONE]", (stream.cut, events[-3:])
    assert not [c for c in chunks if "error" in c], chunks
    usage = next(c["usage"] for c in reversed(chunks) if c.get("usage"))
    assert usage["completion_tokens"] == body.get("max_tokens", usage["completion_tokens"])
    assert usage["completion_tokens"] > KILL_AT, usage
    return "".join(text_of(c) for c in chunks), usage


@pytest.mark.parametrize("case", list(CASES))
def test_a_stream_whose_consumer_is_killed_goes_on_elsewhere(
    fleet: Fleet, consumers: dict[str, Engine], resuming: tuple[Process, Path], case: str
) -> None:
    router, journal = resuming
    url: str = router.url  # type: ignore[attr-defined]
    every_consumer_serving(fleet, url, consumers)
    expected, expected_usage = reference(url, case)

    slug = "-".join(case.replace(",", "").split())  # an x-request-id takes no spaces
    for attempt in range(1, TRIES + 1):  # bounded: a try that missed its stream
        rid = f"resume-{slug}-{secrets.token_hex(4)}"
        reader, killed, killed_after = cut_once(url, case, consumers, rid)
        if killed is None or killed_after is None:
            break
        missed = missed_by(reader, killed, killed_after, journal_line(journal, rid))
        if missed is None:
            break
        print(f"\n{case}: try {attempt}: {missed}")
        proc = consumers[killed].proc
        if proc is not None:
            proc.wait(timeout=30)  # gone before it is restarted, not merely signalled
        every_consumer_serving(fleet, url, consumers)
    stream = reader.stream
    assert stream is not None, "the request was never sent"
    assert reader.status == 200, reader.status
    events = reader.events
    assert killed is not None, "the router's view never showed one decode leg in flight"
    assert killed_after is not None
    texts = sum(1 for e in events[:killed_after] if (c := e.json()) and text_of(c))
    assert texts >= KILL_AT, f"the stream ended after {texts} text chunks, before the kill"
    assert not ended(events[:killed_after]), f"every try's stream ended before its kill ({TRIES})"
    proc = consumers[killed].proc
    assert proc is not None
    proc.wait(timeout=30)  # reaped: the engine is gone, not merely signalled

    chunks = [c for e in events if (c := e.json()) is not None]
    text = "".join(text_of(c) for c in chunks)
    before = [e for e in events[:killed_after] if (c := e.json()) and text_of(c)]
    after = [e for e in events[killed_after:] if (c := e.json()) and text_of(c)]
    # the pause the client saw: the longest wait between text chunks from the last one
    # before the kill (tokens the killed engine had already written may come first)
    seen = [e.at for e in before[-1:] + after]
    waits = [b - a for a, b in itertools.pairwise(seen)]
    gap = f"{max(waits):.3f}s" if waits else "none (nothing after the kill)"
    print(
        f"\n{case}: killed {killed} after {texts} text chunks; client-side gap {gap}; "
        f"{len(after)} text chunks after the kill; the end: {stream.cut or events[-1].data!r}"
    )

    errors = [c["error"] for c in chunks if "error" in c]
    assert not errors, f"an error event reached the client: {errors}"
    assert stream.cut is None, f"the body was cut: {stream.cut}"
    assert events[-1].data == "[DONE]", events[-2:]
    assert text == expected, f"resumed text differs:\n{text!r}\nexpected\n{expected!r}"
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1, usages
    assert usages[0]["prompt_tokens"] == expected_usage["prompt_tokens"], usages
    assert usages[0]["completion_tokens"] == expected_usage["completion_tokens"], usages
    assert len({c["id"] for c in chunks}) == 1, "the stream changed its id"
    for c in chunks:  # the router asks the legs for ids; the client did not
        assert not c.get("prompt_token_ids"), c
        for choice in c.get("choices") or []:
            assert not choice.get("token_ids"), c
            assert not choice.get("prompt_token_ids"), c

    line = journal_line(journal, rid)
    print(f"journal: {json.dumps(line['attempts'])}")
    assert line["outcome"] == "completed", line
    first, second = line["attempts"]
    assert first["consumer"] == killed, line
    resumed_at = second.get("resumed_at_token")
    assert type(resumed_at) is int, line
    assert KILL_AT <= resumed_at < expected_usage["completion_tokens"], line
    assert second.get("producer") == "p0", line  # the fleet's one producer
    assert second.get("consumer") in consumers, line
    assert second["consumer"] != killed, line
