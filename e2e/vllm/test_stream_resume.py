"""Stream resume on real vLLM (contract 6.4, ``recovery.resume_streams``).

A second consumer joins the session's pair for this module only, so that a decode can be
resumed elsewhere: a router of its own (``resume_streams = 1``, a journal) places prefill on
p0 (the session's producer) and decode on d0 (the session's consumer) or d1 (started here).

For a greedy 448-token completion, a greedy 448-token chat and a greedy chat with no limit
(bounded by the context's end, as its continuation is), each:

* the reference: the request once, streamed and uninterrupted, through the same router;
* the same request streamed again; once ``KILL_AT`` text chunks have reached the client,
  the router's ``/narwhal/engines`` says which consumer holds its decode leg (the one whose
  ``inflight.decode`` is 1), and that consumer's process group gets SIGKILL at once. The
  router continues the stream (a prefill of the prompt's ids and the ids sent, a decode on
  the other consumer): the client's text equals the reference exactly, one usage counts
  the prompt once and every token, the stream ends with ``data: [DONE]``, no error event,
  one ``id`` throughout, no token ids the client did not ask for;
* the journal's line for it (by ``x-request-id``) has two attempts, the first on the
  killed consumer, the second with ``resumed_at_token`` (the ids sent before the failure:
  at least ``KILL_AT``, fewer than the reference's) and a producer and consumer of its own.

The kill needs the decode still running when it lands, so the consumer is looked for when
the kill is due, from the router's own view, and killed at once (a 128-token stream once
ended before the test, looking at its first token, found the consumer). What keeps the
decode going that long: every consumer's server has streamed each shape before
(``warm_paths``: a cold server lets its engine run ahead and merge outputs into a few
chunks), and with one id a chunk, as a warm server streams them (``resume_probe.json``),
448 tokens leave over 400 to decode after the ``KILL_AT``-th chunk, which the kill follows
by one request to the router. If the router has no single decode leg in flight then, the
test fails saying so and kills nothing.

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

import contextlib
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


class DecodeWatch(threading.Thread):
    """The router's consumers with a decode leg, read every 50 ms while a stream runs
    (bounded by ``stop`` and 300 s): at the kill's chunk a single read of the view can come
    back after a fast stream's leg ended, or before its count moved."""

    def __init__(self, url: str, consumers: dict[str, Engine]) -> None:
        super().__init__(daemon=True)
        self.url, self.consumers = url, consumers
        self.seen: list[tuple[float, list[str]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.is_set() and time.monotonic() - start < 300:
            with contextlib.suppress(OSError, AssertionError):
                self.seen.append((time.monotonic(), decoding_consumers(self.url, self.consumers)))
            self.done.wait(0.05)

    def last_single(self) -> list[str]:
        """The consumer of the last read that found exactly one, within the last second."""
        now = time.monotonic()
        for at, serving in reversed(self.seen):
            if now - at > 1.0:
                break
            if len(serving) == 1:
                return serving
        return []

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


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

    path, body = body_of(case)
    slug = "-".join(case.replace(",", "").split())  # an x-request-id takes no spaces
    rid = f"resume-{slug}-{secrets.token_hex(4)}"
    watch = DecodeWatch(url, consumers)
    watch.start()
    stream = SSE(url, path, body, {"x-request-id": rid}, timeout=HANDOFF_S * 2)
    events: list[Event] = []
    killed: str | None = None
    killed_after: int | None = None  # events read when the kill was sent
    serving: list[str] = []  # the router's consumers with a decode leg at the KILL_AT-th chunk
    texts = 0
    try:
        assert stream.response.status == 200
        for event in stream.events():
            events.append(event)
            chunk = event.json()
            if killed is None and chunk is not None and text_of(chunk):
                texts += 1
                if texts == KILL_AT:
                    serving = decoding_consumers(url, consumers)
                    if len(serving) != 1:  # the router's view, read a moment ago
                        print(f"at chunk {KILL_AT}: {serving}; watched: {watch.seen[-5:]}")
                        serving = watch.last_single()
                    if len(serving) != 1:
                        break  # no decode to cut: the stream outran the test (below)
                    consumers[serving[0]].signal(signal.SIGKILL)  # its group, by its id
                    killed, killed_after = serving[0], len(events)
    finally:
        stream.close()
        watch.stop()
    ended = f"the stream ended after {texts} text chunks, before the kill at {KILL_AT}"
    assert texts >= KILL_AT, ended
    decoding = f"at text chunk {KILL_AT} the router's decode legs were on {serving}, not one"
    assert len(serving) == 1, decoding
    assert killed is not None, ended
    assert killed_after is not None, ended
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
