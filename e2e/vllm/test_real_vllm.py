"""Our router in front of two real vLLM 0.32 engines moving real KV (``make e2e-vllm``).

The tests run in file order against one fleet: the consumer is killed and restarted last.
Generous timeouts and no latency assertions: handoffs sometimes stall 15-30 s here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import openai
import pytest

from .conftest import HANDOFF_S, MODEL, START_S, Fleet, http, warm_pair

pytestmark = pytest.mark.vllm

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6 + "Once upon a time"
# vLLM's NIXL connector counts each finished KV pull in this histogram on the consumer
TRANSFERS = "vllm:nixl_xfer_time_seconds_count"


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=fleet.router_url + "/v1", api_key="unused", timeout=HANDOFF_S * 2, max_retries=0
    ) as c:
        yield c


@pytest.fixture(scope="module", autouse=True)
def warm(fleet: Fleet) -> None:
    """The first handoff of a pair does the NIXL handshake; let it happen outside a test
    (directly, not through the router, so the router's breaker starts clean)."""
    warm_pair(fleet.producer, fleet.consumer)


def local(fleet: Fleet, path: str, body: dict[str, object]) -> str:
    """What the consumer produces for this request on its own (no KV from elsewhere)."""
    status, raw = http("POST", fleet.consumer.url + path, {**body, "temperature": 0})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


class Transfers:
    """The consumer's KV transfer counter, read before and after."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.before = fleet.consumer.metric(TRANSFERS)

    def risen_by(self) -> float:
        after = self.fleet.consumer.metric(TRANSFERS)
        print(f"{TRANSFERS} on the consumer: {self.before:g} -> {after:g}")
        return after - self.before


def read_stream(stream: Iterable[Any], text_of: Callable[[Any], str | None]) -> tuple[str, Any]:
    """The streamed text (``text_of`` a choice) and the usage chunk, if one came."""
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += text_of(chunk.choices[0]) or ""
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


def test_check_passes_and_names_the_pair(fleet: Fleet) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "narwhal", "check", "--config", str(fleet.config)],
        capture_output=True,
        text=True,
        timeout=HANDOFF_S * 3,
        check=False,
    )
    report = out.stdout + out.stderr
    print(report)
    assert out.returncode == 0, report
    assert "p0 -> d0" in report


def test_completion_equals_the_consumers_own_output(fleet: Fleet, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12}
    transfers = Transfers(fleet)
    routed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert transfers.risen_by() >= 1, "the consumer pulled no KV"
    text = routed.choices[0].text
    print(f"routed {text!r}")
    assert text
    assert text == local(fleet, "/v1/completions", body)
    assert routed.usage is not None
    assert routed.usage.completion_tokens == 12


def test_streamed_completion_with_usage(fleet: Fleet, client: openai.OpenAI) -> None:
    transfers = Transfers(fleet)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT + " there",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = read_stream(stream, lambda choice: choice.text)
    assert transfers.risen_by() >= 1
    body = {"model": MODEL, "prompt": PROMPT + " there", "max_tokens": 10}
    assert text == local(fleet, "/v1/completions", body)
    assert usage is not None, "stream_options.include_usage did not pass through"
    assert usage.completion_tokens == 10


MESSAGES = [{"role": "user", "content": "Tell me a story about a lazy dog and a fox."}]


def test_chat_equals_the_consumers_own_output(fleet: Fleet, client: openai.OpenAI) -> None:
    transfers = Transfers(fleet)
    routed = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    assert transfers.risen_by() >= 1
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    assert routed.choices[0].message.content == local(fleet, "/v1/chat/completions", body)


def test_streamed_chat(fleet: Fleet, client: openai.OpenAI) -> None:
    transfers = Transfers(fleet)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = read_stream(stream, lambda choice: choice.delta.content)
    assert transfers.risen_by() >= 1
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    assert text == local(fleet, "/v1/chat/completions", body)
    assert usage is not None
    assert usage.completion_tokens == 8


def test_wrong_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-" + MODEL, prompt="hello", max_tokens=2)


def test_prompt_over_the_model_length_is_the_engines_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="fox dog " * 600, max_tokens=4)
    print("engine's 400 through the router:", caught.value.body)
    # vLLM's own error, passed through (tests/captures/err_context_length.json)
    assert caught.value.status_code == 400
    assert caught.value.message.endswith(
        "This model's maximum context length is 512 tokens. However, your prompt contains at "
        "least 513 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=513)"
    )


def test_consumer_killed_mid_stream_then_ejected_then_readmitted(
    fleet: Fleet, client: openai.OpenAI
) -> None:
    eject_after = 2  # the fleet file's recovery.eject_after
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True
    )
    received = 0

    def read_until_the_end() -> None:
        nonlocal received
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                received += 1
                if received == 3:
                    fleet.consumer.stop(grace_s=0.0)  # SIGTERM then SIGKILL: a dead engine

    with pytest.raises(openai.APIError) as caught:
        read_until_the_end()
    print(f"after {received} tokens: {caught.value.message}")
    assert received >= 3
    failures = 1
    # the breaker ejects it after eject_after failed legs, unless the active health checks
    # (two lost, 5 s apart) took it out of placement first: then clients get 503 at once
    while fleet.engines()["d0"]["breaker"]["state"] != "ejected" and fleet.engines()["d0"]["up"]:
        assert failures < eject_after, fleet.engines()["d0"]
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        failures += 1
    d0 = fleet.engines()["d0"]
    print("ejected:", d0["breaker"], "up:", d0["up"])
    if d0["breaker"]["state"] == "ejected":
        assert failures == eject_after
        assert d0["breaker"]["streak"] == eject_after
    # the last consumer stays placeable ("held in") while it still counts as answering, so
    # clients get the honest 502 of a refused connection; once two active health checks
    # went unanswered it is out of placement (clients get 503 before any prefill); either
    # way /ready tells the load balancer the fleet cannot serve
    assert d0["held_in"] is True or d0["up"] is False, d0
    assert http("GET", fleet.router_url + "/ready")[0] == 503

    fleet.consumer.start()
    fleet.consumer.wait_until(fleet.consumer.url + "/health", START_S)
    deadline = time.monotonic() + 120
    while (d0 := fleet.engines()["d0"])["breaker"]["state"] != "closed" or not d0["up"]:
        assert time.monotonic() < deadline, d0
        time.sleep(1.0)  # probes and health checks run on their own; bounded by deadline
    print("readmitted:", fleet.engines()["d0"]["breaker"])
    for _ in range(3):  # a restarted consumer's first pull redoes the NIXL handshake
        try:
            done = client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0
            )
        except openai.APIStatusError as e:
            print("first request after readmission:", e.status_code, e.message)
            continue
        assert done.choices[0].text
        return
    pytest.fail("no request succeeded after readmission")
