"""Client-visible messages name engines by id, never by URL (contract 3).

A fault's ``message`` keeps the engine's address for logs and the journal; ``error_body()``,
from which the JSON error and the terminal stream event are both built, names the engine
by id instead.
"""

from __future__ import annotations

import msgspec
import pytest
import trio

from narwhal.core.faults import EngineStatusError, EngineUnreachable, Phase, name_engine
from narwhal.engines.boundary import EngineClosed, EngineErrors, Step
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, finish, post_raw, start_fleet

URL = "http://10.0.0.5:8000"


@pytest.mark.parametrize(
    ("message", "url", "engine_id", "client"),
    [
        (
            f"cannot connect to engine {URL}: all attempts to connect to 10.0.0.5:8000 failed",
            URL,
            "p0",
            "cannot connect to engine p0: all attempts to connect to engine p0 failed",
        ),
        (
            f"cannot connect to engine {URL}: [Errno 111] Connect call failed ('10.0.0.5', 8000)",
            URL + "/",
            None,
            "cannot connect to engine: [Errno 111] Connect call failed engine",
        ),
        (
            f"connect to engine {URL}/ timed out",
            URL,
            "d0",
            "connect to engine d0 timed out",
        ),
        (
            "cannot connect to engine http://[fd00::5]:8000: all attempts to connect to "
            "[fd00::5]:8000 failed",
            "http://[fd00::5]:8000",
            "d1",
            "cannot connect to engine d1: all attempts to connect to engine d1 failed",
        ),
        (
            "connection to engine http://VLLM-0.internal broke, said vllm-0.internal:80",
            "http://vllm-0.internal",
            "p1",
            "connection to engine p1 broke, said engine p1",
        ),
        (  # the same host on another port, or a longer address, is not this engine
            f"engine {URL} and 10.0.0.5:8001 and 10.0.0.50",
            URL,
            "p0",
            "engine p0 and 10.0.0.5:8001 and 10.0.0.50",
        ),
        ("prompt is too long", URL, "p0", "prompt is too long"),
        (f"engine {URL} broke", URL, r"odd\1id", r"engine odd\1id broke"),
    ],
)
def test_name_engine_replaces_every_spelling_of_the_address(
    message: str, url: str, engine_id: str | None, client: str
) -> None:
    assert name_engine(message, url, engine_id) == client


def test_the_fault_keeps_the_url_and_the_client_gets_the_id() -> None:
    fault = EngineErrors(Step.CONNECT, URL, Phase.PREFILL).fault(
        OSError("all attempts to connect to 10.0.0.5:8000 failed")
    )
    assert isinstance(fault, EngineUnreachable)
    assert fault.engine_url == URL
    assert URL in fault.message
    assert "10.0.0.5:8000 failed" in fault.message
    assert fault.error_body()["message"] == (
        "cannot connect to engine: all attempts to connect to engine failed"
    )
    fault.engine_id = "p0"
    assert fault.error_body() == {
        "message": "cannot connect to engine p0: all attempts to connect to engine p0 failed",
        "type": "bad_gateway",
        "param": None,
        "code": 502,
    }
    assert URL in fault.message  # unchanged, for the journal and the logs
    reading = EngineErrors(Step.EXCHANGE, URL, Phase.DECODE)
    reading.broken = "x: "
    broken = reading.fault(EngineClosed())
    assert broken is not None
    broken.engine_id = "d0"
    assert broken.error_body()["message"] == (
        "x: connection to engine d0 broke: connection closed by engine"
    )


def test_an_engine_client_error_still_passes_through_verbatim() -> None:
    fault = EngineStatusError(400, "prompt is too long", phase=Phase.PREFILL, engine_url=URL)
    assert fault.error_body()["message"] == "prompt is too long"
    assert fault.status == 400


# ---- over loopback: an engine that cannot be reached ------------------------------------


def _addresses(text: str | bytes) -> list[str]:
    """What in ``text`` gives an engine's address away: its loopback IP, a URL's scheme."""
    data = text if isinstance(text, str) else text.decode()
    return [mark for mark in ("127.0.0.1", "http://") if mark in data]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("engine_id", ["p0", "d0"], ids=["producer", "consumer"])
async def test_an_unreachable_engine_is_named_by_id(
    nursery: trio.Nursery, engine_id: str, stream: bool
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    url = harness.engines[engine_id].url
    harness.engines[engine_id].stop()  # its port closes: connections are refused
    reply = await harness.post(
        "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    )
    assert reply.status == 502, reply.body
    assert not _addresses(reply.body), reply.body
    error = reply.json()["error"]
    assert error["message"].startswith(f"cannot connect to engine {engine_id}"), error
    await harness.router.wait_drained()
    (line,) = harness.router.journal.lines
    assert line.outcome == "failed"
    assert line.message is not None
    assert line.message.startswith(f"cannot connect to engine {url}"), line.message
    assert line.attempts[-1].error == line.message
    if engine_id == "p0":
        assert not harness.engines["d0"].log  # no prefill, no decode leg
    await finish(harness)


async def test_a_mid_stream_failure_ends_with_an_event_without_the_url(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    consumer = harness.engines["d0"]
    url = consumer.url
    consumer.faults.push(Fault(kind="tokens_then_close", tokens=2))
    reply = await post_raw(
        harness,
        "/v1/completions",
        {"model": MODEL, "prompt": "hello", "max_tokens": 6, "stream": True},
    )
    assert reply.status == 200
    *output, terminal = reply.events()
    assert output, "tokens came before the failure"
    error = msgspec.json.decode(terminal)["error"]
    assert error["code"] == 502
    assert error["message"].startswith("stream ended before [DONE]")
    assert not _addresses(reply.body), reply.body
    await harness.router.wait_drained()
    (line,) = harness.router.journal.lines
    assert line.message is not None
    # the close without the chunked body's end is a transport error: the journal keeps the
    # URL, the client reads the id
    assert line.message.startswith(f"stream ended before [DONE]: connection to engine {url}")
    assert error["message"].startswith("stream ended before [DONE]: connection to engine d0 ")
    await finish(harness)
