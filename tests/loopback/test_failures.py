"""Every scripted engine fault, over real loopback sockets: what the client sees (contract 6).

Before the commit point a failure is an ordinary HTTP error with the JSON of contract 3; after
it (headers go out with the first generated token) the stream ends with exactly one
terminal error event. Never an empty 200, never a silent truncation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec
import openai
import pytest
import trio

from narwhal.core.config import EngineConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fault_scenarios import FAULTS
from tests.support.fleet import MODEL, Harness, RawReply, finish, post_raw, start_fleet

TIMEOUTS = {
    "serving": ServingConfig(request_timeout_s=5.0, prefill_timeout_s=0.5, graceful_timeout_s=0.5),
    "engine": EngineConfig(first_token_timeout_s=0.3, decode_read_timeout_s=0.3),
}


@dataclass(frozen=True)
class Expect:
    status: int
    message: str  # what the client's error message begins with
    after_output: bool = False  # streaming clients got tokens first, then the terminal event


EXPECTED = {
    "prefill 500": Expect(502, "scripted fault"),
    "prefill 503": Expect(502, "scripted fault"),
    "prefill 400": Expect(400, "scripted fault"),
    "prefill 408": Expect(504, "scripted fault"),
    "prefill 429": Expect(502, "scripted fault"),
    "prefill hang": Expect(504, "prefill on engine p0 took longer than 0.5s"),
    "no descriptor": Expect(
        502, "missing engine identity: prefill response has no kv_transfer_params"
    ),
    "empty engine id": Expect(502, "missing engine identity: remote_engine_id is empty"),
    "non-string engine id": Expect(502, "missing engine identity: remote_engine_id is int"),
    "malformed block ids": Expect(502, "malformed block ids"),
    "prefill reset mid-body": Expect(502, "connection to engine"),
    "producer stopped": Expect(502, "cannot connect to engine"),
    "decode 503": Expect(502, "scripted fault"),
    "decode hang": Expect(504, "no first token within 0.3s"),
    "headers then nothing": Expect(504, "no first token within 0.3s"),
    "metadata then silence": Expect(504, "no first token within 0.3s"),
    "tokens then silence": Expect(504, "engine went silent between tokens", after_output=True),
    "tokens then close": Expect(502, "stream ended before [DONE]", after_output=True),
    "[DONE] before a token": Expect(502, "stream ended with [DONE] before any token arrived"),
    "in-stream 503 first": Expect(503, "scripted fault"),
    "in-stream 429 after tokens": Expect(429, "scripted fault", after_output=True),
    "in-stream error without code": Expect(500, "scripted fault", after_output=True),
    "malformed chunk": Expect(502, "engine sent a malformed stream chunk"),
    "oversized event after tokens": Expect(
        502, "engine sent a malformed stream: line longer than", after_output=True
    ),
    "consumer stopped": Expect(502, "cannot connect to engine"),
}
ENDPOINTS = {
    "completions": ("/v1/completions", {"prompt": "hello there"}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
}


async def _fleet(nursery: trio.Nursery, **kwargs: Any) -> Harness:
    return await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, **TIMEOUTS, **kwargs)


async def _break(harness: Harness, name: str) -> None:
    side, fault = FAULTS[name]
    engine = harness.engines["p0" if side == "producer" else "d0"]
    if fault is None:
        engine.stop()
    else:
        engine.faults.push(fault)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", EXPECTED)
async def test_fault_gives_the_status_and_message_of_the_spec(
    nursery: trio.Nursery, name: str, stream: bool, endpoint: str
) -> None:
    case = EXPECTED[name]
    harness = await _fleet(nursery)
    await _break(harness, name)
    path, fields = ENDPOINTS[endpoint]
    body = {"model": MODEL, "max_tokens": 6, "stream": stream, **fields}
    cut = stream and case.after_output  # the body is cut after the terminal event (contract 6)
    reply = await (post_raw(harness, path, body) if cut else harness.post(path, body))
    assert reply.headers["x-request-id"]
    if cut:
        assert reply.status == 200
        assert isinstance(reply, RawReply)
        assert not reply.ended, "the chunked body's last chunk never comes"
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
    if FAULTS[name][0] == "producer" and case.status != 400:
        assert not harness.engines["d0"].log, "no decode leg without a valid descriptor"
    await harness.router.wait_drained()  # the journal line is written as the request ends
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.status) == ("failed", case.status)
    assert line.message is not None
    assert line.message.startswith(case.message)
    await finish(harness)


async def test_slow_drip_inside_the_limits_succeeds(nursery: trio.Nursery) -> None:
    harness = await _fleet(nursery)
    await _break(harness, "slow drip inside the limits")
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


def test_every_catalogued_fault_has_an_expectation() -> None:
    assert set(FAULTS) - set(EXPECTED) == {"slow drip inside the limits"}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("name", EXPECTED)
async def test_the_openai_client_raises_for_every_fault(
    nursery: trio.Nursery, name: str, stream: bool
) -> None:
    case = EXPECTED[name]
    harness = await _fleet(nursery)
    await _break(harness, name)
    client = openai.AsyncOpenAI(base_url=harness.url + "/v1", api_key="x", max_retries=0)
    received: list[str] = []
    try:
        if stream and case.after_output:
            chunks = await client.completions.create(
                model=MODEL, prompt="hello", max_tokens=6, stream=True
            )

            async def read_all() -> None:
                async for chunk in chunks:
                    received.append(chunk.choices[0].text)

            with pytest.raises(openai.APIError, match=re.escape(case.message)):
                await read_all()
            assert received  # partial text came, then an error: never passed off as complete
        else:
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(
                    model=MODEL, prompt="hello", max_tokens=6, stream=stream
                )
            assert info.value.status_code == case.status
            assert case.message in str(info.value)
    finally:
        await client.close()
    await finish(harness)
