"""Every scripted engine fault, over real loopback sockets: what the client sees (SPEC 6).

Before the commit point a failure is an ordinary HTTP error with the JSON of SPEC 3; after
it (headers go out with the first generated token) the stream ends with exactly one
terminal error event. Never an empty 200, never a silent truncation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import openai
import pytest
import trio

from narwhal.config import EngineConfig, ServingConfig
from narwhal.testing.faults import Fault
from tests.conftest import MODEL, Harness, finish, start_fleet

TIMEOUTS = {
    "serving": ServingConfig(request_timeout_s=5.0, prefill_timeout_s=0.5, graceful_timeout_s=0.5),
    "engine": EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
}


@dataclass(frozen=True)
class Case:
    engine: str  # whose leg breaks: "p0" (producer) or "d0" (consumer)
    fault: Fault | None  # None: the engine is stopped (connection refused)
    status: int
    message: str  # what the client's error message begins with
    after_output: bool = False  # streaming clients got tokens first, then the terminal event


CASES = {
    "prefill 500": Case("p0", Fault(kind="status", status=500), 502, "scripted fault"),
    "prefill 503": Case("p0", Fault(kind="status", status=503), 502, "scripted fault"),
    "prefill 400": Case("p0", Fault(kind="status", status=400), 400, "scripted fault"),
    "prefill 408": Case("p0", Fault(kind="status", status=408), 504, "scripted fault"),
    "prefill 429": Case("p0", Fault(kind="status", status=429), 502, "scripted fault"),
    "prefill hang": Case(
        "p0", Fault(kind="hang"), 504, "prefill on engine p0 took longer than 0.5s"
    ),
    "no descriptor": Case(
        "p0",
        Fault(kind="no_descriptor"),
        502,
        "missing engine identity: prefill response has no kv_transfer_params",
    ),
    "empty engine id": Case(
        "p0",
        Fault(kind="bad_engine_id", value=""),
        502,
        "missing engine identity: remote_engine_id is empty",
    ),
    "non-string engine id": Case(
        "p0",
        Fault(kind="bad_engine_id", value=7),
        502,
        "missing engine identity: remote_engine_id is int",
    ),
    "malformed block ids": Case(
        "p0", Fault(kind="bad_block_ids", value=[[1, -2]]), 502, "malformed block ids"
    ),
    "prefill reset mid-body": Case("p0", Fault(kind="close_mid_body"), 502, "connection to engine"),
    "producer stopped": Case("p0", None, 502, "cannot connect to engine"),
    "decode 503": Case("d0", Fault(kind="status", status=503), 502, "scripted fault"),
    "decode hang": Case("d0", Fault(kind="hang", leg="decode"), 504, "no first token within 0.3s"),
    "headers then nothing": Case(
        "d0", Fault(kind="headers_then_silence"), 504, "no first token within 0.3s"
    ),
    "metadata then silence": Case(
        "d0", Fault(kind="metadata_then_silence"), 504, "no first token within 0.3s"
    ),
    "tokens then silence": Case(
        "d0",
        Fault(kind="tokens_then_silence", tokens=2),
        504,
        "engine went silent between tokens",
        after_output=True,
    ),
    "tokens then close": Case(
        "d0",
        Fault(kind="tokens_then_close", tokens=2),
        502,
        "stream ended before [DONE]",
        after_output=True,
    ),
    "[DONE] before a token": Case(
        "d0", Fault(kind="done_first"), 502, "stream ended with [DONE] before any token arrived"
    ),
    "in-stream 503 first": Case("d0", Fault(kind="stream_error", code=503), 503, "scripted fault"),
    "in-stream 429 after tokens": Case(
        "d0",
        Fault(kind="stream_error", code=429, tokens=2),
        429,
        "scripted fault",
        after_output=True,
    ),
    "in-stream error without code": Case(
        "d0",
        Fault(kind="stream_error", code=None, tokens=1),
        500,
        "scripted fault",
        after_output=True,
    ),
    "consumer stopped": Case("d0", None, 502, "cannot connect to engine"),
}
ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "hello there"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
}


async def _fleet(nursery: trio.Nursery, **kwargs: Any) -> Harness:
    return await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, **TIMEOUTS, **kwargs)


async def _break(harness: Harness, case: Case) -> None:
    engine = harness.engines[case.engine]
    if case.fault is None:
        engine.stop()
    else:
        engine.faults.push(case.fault)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", CASES)
async def test_fault_gives_the_status_and_message_of_the_spec(
    nursery: trio.Nursery, name: str, stream: bool, endpoint: str
) -> None:
    case = CASES[name]
    harness = await _fleet(nursery)
    await _break(harness, case)
    path, fields = ENDPOINTS[endpoint]
    reply = await harness.post(path, {"model": MODEL, "max_tokens": 6, "stream": stream, **fields})
    assert reply.headers["x-request-id"]
    if stream and case.after_output:
        assert reply.status == 200
        events = reply.events()
        *output, terminal = events
        assert output, "tokens came before the failure"
        assert all(b'"error"' not in e and e != b"[DONE]" for e in output)
        error = msgspec.json.decode(terminal)["error"]  # exactly one terminal event, last
        assert error["code"] == case.status
        assert error["message"].startswith(case.message)
    else:
        assert reply.status == case.status, reply.body
        error = reply.json()["error"]
        assert error["code"] == case.status
        assert error["message"].startswith(case.message), error
    if case.engine == "p0" and case.status != 400:
        assert not harness.engines["d0"].log, "no decode leg without a valid descriptor"
    await harness.router.wait_drained()  # the journal line is written as the request ends
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.status) == ("failed", case.status)
    assert line.message is not None
    assert line.message.startswith(case.message)
    await finish(harness)


async def test_slow_drip_inside_the_limits_succeeds(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery)
    harness.engines["d0"].faults.push(Fault(kind="slow_drip", interval_s=0.1))
    reply = await harness.post(
        "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
    )
    assert reply.status == 200
    assert reply.events()[-1] == b"[DONE]"
    assert len(reply.events()) == 6
    await finish(harness)


async def test_the_openai_client_raises_instead_of_hanging_or_truncating(
    nursery: trio.Nursery,
) -> None:
    harness = await _fleet(nursery)
    client = openai.AsyncOpenAI(base_url=harness.url + "/v1", api_key="x", max_retries=0)
    try:
        harness.engines["d0"].faults.push(Fault(kind="tokens_then_silence", tokens=2))
        stream = await client.completions.create(
            model=MODEL, prompt="hello", max_tokens=6, stream=True
        )
        received: list[str] = []

        async def read_all() -> None:
            async for chunk in stream:
                received.append(chunk.choices[0].text)

        with pytest.raises(openai.APIError, match="engine went silent between tokens"):
            await read_all()
        assert len(received) == 2  # the partial text came, and then an error, not an end
        harness.engines["d0"].faults.push(Fault(kind="tokens_then_close", tokens=2))
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=MODEL, prompt="hello", max_tokens=6)
        assert info.value.status_code == 502
        harness.engines["p0"].faults.push(Fault(kind="hang"))
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=4,
                stream=True,
            )
        assert info.value.status_code == 504
    finally:
        await client.close()
    await finish(harness)
