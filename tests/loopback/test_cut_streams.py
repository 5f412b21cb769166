"""A stream that fails after the commit point ends with one terminal error event, and then
its body is cut: the connection closes without the chunked body's last chunk (contract 6), so a
client that ignores error events (vLLM's benchmark client) still sees a failed transfer,
and no pooled client reuses the connection. Seen from the wire: a raw socket, aiohttp as
``vllm bench serve`` reads a stream, httpx."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import msgspec
import pytest
import trio

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, RawReply, finish, post_raw, start_fleet

PROMPT = "a narwhal swims north under the ice"
STREAM = {"model": MODEL, "prompt": PROMPT, "max_tokens": 32, "stream": True}
CUT = Fault(kind="tokens_then_close", tokens=5, leg="decode")  # the consumer dies mid-stream


def tokens_and_error(reply: RawReply) -> tuple[int, dict[str, object]]:
    """(tokens the client got, the terminal event's error), asserting the event is last."""
    events = reply.events()
    assert events
    assert events[-1] != b"[DONE]"
    *tokens, last = events
    error = msgspec.json.decode(last)["error"]
    assert not any(b'"error"' in e for e in tokens)
    return sum(1 for e in tokens if msgspec.json.decode(e)["choices"][0]["text"]), error


async def test_a_raw_socket_sees_the_terminal_event_then_a_cut_body(pd: Harness) -> None:
    pd.engines["d0"].faults.push(CUT)
    reply = await post_raw(pd, "/v1/completions", STREAM)
    assert reply.status == 200
    tokens, error = tokens_and_error(reply)
    assert tokens == 5
    assert error["code"] == 502
    assert not reply.ended  # no `0\r\n\r\n`: the transfer failed
    await pd.router.wait_drained()
    [line] = pd.router.journal.lines
    assert (line.outcome, line.status) == ("failed", 502)
    await finish(pd)  # reservations and engine connections back to none


async def test_a_stream_that_succeeds_still_ends_whole(pd: Harness) -> None:
    reply = await post_raw(pd, "/v1/completions", STREAM)
    assert reply.events()[-1] == b"[DONE]"
    assert reply.ended
    await finish(pd)


async def test_a_non_streaming_client_still_gets_the_json_error(pd: Harness) -> None:
    pd.engines["d0"].faults.push(CUT)
    reply = await post_raw(pd, "/v1/completions", {**STREAM, "stream": False})
    assert reply.status == 502
    assert reply.json()["error"]["code"] == 502
    await finish(pd)


async def test_a_fanned_out_stream_is_cut_after_its_terminal_event(pd: Harness) -> None:
    pd.engines["d0"].faults.push(CUT)
    reply = await post_raw(pd, "/v1/completions", {**STREAM, "n": 2})
    assert reply.status == 200
    _, error = tokens_and_error(reply)
    assert error["code"] == 502
    assert not reply.ended
    await pd.router.wait_drained()
    assert [line.outcome for line in pd.router.journal.lines] == ["failed"]
    await finish(pd)


async def test_a_stream_past_its_deadline_is_cut_after_its_terminal_event(
    nursery: trio.Nursery,
) -> None:
    """The deadline gives the request up after the commit point: a client that reads keeps
    the terminal event (504), and the body is cut all the same."""
    serving = ServingConfig(request_timeout_s=1.0, graceful_timeout_s=0.5)
    h = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"}, serving=serving)
    h.engines["d0"].faults.push(Fault(kind="slow_drip", interval_s=0.3, leg="decode"))
    reply = await post_raw(h, "/v1/completions", STREAM)
    tokens, error = tokens_and_error(reply)
    assert 0 < tokens < 32
    assert error["code"] == 504
    assert not reply.ended
    await h.router.wait_drained()
    assert [line.outcome for line in h.router.journal.lines] == ["expired"]
    await finish(h)


def _aiohttp_reads(url: str) -> tuple[int, str]:
    """(chunks read, the exception's class name) reading as vLLM's bench client does."""

    async def run() -> tuple[int, str]:
        chunks = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            try:
                async with session.post(url, json=STREAM) as response:
                    assert response.status == 200
                    async for _ in response.content:
                        chunks += 1
            except aiohttp.ClientError as exc:
                return chunks, type(exc).__name__
        return chunks, "none"

    return asyncio.run(run())


def _httpx_reads(url: str) -> tuple[int, str]:
    lines = 0
    with httpx.Client(timeout=20) as client:
        try:
            with client.stream("POST", url, json=STREAM) as response:
                assert response.status_code == 200
                for _ in response.iter_lines():
                    lines += 1
        except httpx.HTTPError as exc:
            return lines, type(exc).__name__
    return lines, "none"


@pytest.mark.filterwarnings("ignore:unclosed transport:ResourceWarning")
async def test_aiohttp_sees_a_payload_error(pd: Harness) -> None:
    pd.engines["d0"].faults.push(CUT)
    chunks, raised = await trio.to_thread.run_sync(_aiohttp_reads, pd.url + "/v1/completions")
    assert chunks > 0
    assert raised == "ClientPayloadError"
    await pd.router.wait_drained()
    assert [line.outcome for line in pd.router.journal.lines] == ["failed"]
    await finish(pd)


async def test_httpx_sees_a_protocol_error(pd: Harness) -> None:
    pd.engines["d0"].faults.push(CUT)
    lines, raised = await trio.to_thread.run_sync(_httpx_reads, pd.url + "/v1/completions")
    assert lines > 0
    assert raised == "RemoteProtocolError"
    await pd.router.wait_drained()
    assert [line.outcome for line in pd.router.journal.lines] == ["failed"]
    await finish(pd)
