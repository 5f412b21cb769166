"""Operating the router: graceful shutdown, fleet reload, structured logs without secrets."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpcore
import msgspec
import trio

from narwhal.core.config import ServingConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, finish, start_fleet
from tests.support.processes import running

STREAM = {"model": MODEL, "prompt": "hello there", "stream": True}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _stream(
    http: httpcore.AsyncConnectionPool, url: str, max_tokens: int, first: trio.Event | None = None
) -> list[bytes]:
    body = msgspec.json.encode({**STREAM, "max_tokens": max_tokens})
    parser, events = SSEParser(), []
    async with http.stream(
        "POST",
        url + "/v1/completions",
        content=body,
        headers=[("content-type", "application/json")],
    ) as resp:
        assert resp.status == 200
        try:
            async for chunk in resp.aiter_stream():
                events += parser.feed(chunk)
                if first is not None and events:
                    first.set()
        except httpcore.RemoteProtocolError:
            # the body is cut after a terminal event (contract 6): the transfer failed
            assert b'"error"' in events[-1]
            return events
    assert b'"error"' not in events[-1], "a terminal event is followed by a cut, never an end"
    return events


async def test_draining_refuses_new_work_and_ends_stragglers_with_a_terminal_event(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        engine_config={"itl_s": 0.05},
        serving=ServingConfig(graceful_timeout_s=0.5),
    )
    first = trio.Event()
    result: list[list[bytes]] = []

    async def long_stream() -> None:
        result.append(await _stream(harness.http, harness.url, 200, first))

    async with trio.open_nursery() as inner:
        inner.start_soon(long_stream)
        await first.wait()
        started = trio.current_time()
        harness.router.begin_drain()
        ready = await harness.get("/ready")
        assert (ready.status, ready.json()) == (503, {"status": "draining"})
        refused = await harness.post("/v1/completions", {**STREAM, "max_tokens": 2})
        assert refused.status == 503
        assert refused.json()["error"]["message"].startswith("router shutting down")
    elapsed = trio.current_time() - started
    (events,) = result
    assert b'"error"' not in events[0]
    terminal = msgspec.json.decode(events[-1])["error"]
    assert terminal["code"] == 503
    assert terminal["message"].startswith("router shutting down")
    assert 0.5 <= elapsed < 3.0
    await finish(harness)


async def test_reload_adds_and_removes_engines(nursery: trio.Nursery, tmp_path: Path) -> None:
    harness = await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, engine_config={"itl_s": 0.02}
    )
    d1 = FakeEngine(FakeEngineConfig(model=MODEL, role="decode"))
    d1_url = await nursery.start(d1.serve)
    path = tmp_path / "fleet.json"
    harness.router.config_path = str(path)
    config = msgspec.to_builtins(harness.router.config)
    config.pop("engine_contract")
    assert (await harness.post("/narwhal/reload", b"")).status == 400  # no file yet: kept

    first = trio.Event()
    result: list[list[bytes]] = []

    async def in_flight() -> None:
        result.append(await _stream(harness.http, harness.url, 40, first))

    async with trio.open_nursery() as inner:
        inner.start_soon(in_flight)  # a stream on d0, still running during the reload
        await first.wait()
        config["engines"] = [config["engines"][0], {"id": "d1", "url": d1_url, "role": "decode"}]
        path.write_text(json.dumps(config))
        reply = await harness.post("/narwhal/reload", b"")
        assert reply.json() == {"engines": ["p0", "d1"], "added": ["d1"], "removed": ["d0"]}
        with trio.fail_after(5):  # an added engine takes traffic once it answered /health
            await harness.router.events.wait_event("joined", "d1")
        for _ in range(3):
            assert (
                await harness.post("/v1/completions", {**STREAM, "max_tokens": 2})
            ).status == 200
    assert result[0][-1] == b"[DONE]"  # d0's in-flight leg finished normally
    # a removed engine's series leave with it: no alert keeps firing for an engine gone
    scrape = (await harness.get("/metrics")).body.decode()
    assert 'engine="d0"' not in scrape
    assert 'engine="d1"' in scrape
    assert len(d1.log) == 3  # every new request went to the added engine
    assert len(harness.engines["d0"].log) == 1

    path.write_text(json.dumps({**config, "serving": {"max_inflight": 0, "bogus": 1}}))
    reply = await harness.post("/narwhal/reload", b"")
    assert reply.status == 400
    assert reply.json()["error"]["problems"] == [
        "serving.bogus: unknown key in [serving] (known: admin_keys_env, api_keys_env, "
        "client_body_timeout_s, "
        "client_idle_timeout_s, graceful_timeout_s, handoff_timeout_s, max_attempts, "
        "max_fanout, max_inflight, max_request_bytes, prefill_timeout_s, request_timeout_s, "
        "retry_backoff_s, retry_budget, retry_replenish)",
        "serving.max_inflight: must be an integer >= 1 (got 0)",
    ]
    assert (await harness.post("/v1/completions", {**STREAM, "max_tokens": 2})).status == 200
    assert len(d1.log) == 4  # the running fleet was kept
    await finish(harness)


async def test_sigterm_drains_a_real_process_and_exits_zero(tmp_path: Path) -> None:
    os.environ["NARWHAL_TEST_ENGINE_KEY"] = "sk-engine-secret-42"
    with (
        running("fake-engine", "--port", "0", "--role", "prefill") as (_, p_url),
        running("fake-engine", "--port", "0", "--role", "decode", "--itl-s", "0.05") as (_, d_url),
    ):
        fleet = tmp_path / "fleet.toml"
        text = (
            f'model = "{MODEL}"\n[[engines]]\nid = "p0"\nurl = "{p_url}"\nrole = "prefill"\n'
            f'[[engines]]\nid = "d0"\nurl = "{d_url}"\nrole = "decode"\n'
            "[serving]\ngraceful_timeout_s = 1.0\n"
            '[engine]\napi_key_env = "NARWHAL_TEST_ENGINE_KEY"\n'
        )
        fleet.write_text(text)
        log_path = tmp_path / "router.log"
        port = _free_port()
        with log_path.open("w") as log:
            router = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "narwhal",
                    "serve",
                    "--config",
                    str(fleet),
                    "--port",
                    str(port),
                    "--log-format",
                    "json",
                ],
                stderr=log,
                stdout=subprocess.DEVNULL,
            )
        try:
            url = f"http://127.0.0.1:{port}"
            async with httpcore.AsyncConnectionPool() as http:
                with trio.fail_after(20):
                    while True:  # bounded by fail_after: the process is starting
                        try:
                            if (await http.request("GET", url + "/health")).status == 200:
                                break
                        except httpcore.ConnectError:
                            await trio.sleep(0.1)
                # an invalid fleet file on SIGHUP is reported and the running fleet kept
                fleet.write_text(text + "bogus = 1\n")
                router.send_signal(signal.SIGHUP)
                short: list[list[bytes]] = []
                long: list[list[bytes]] = []
                first, short_started = trio.Event(), trio.Event()

                async def run(out: list[list[bytes]], n: int, ev: trio.Event) -> None:
                    out.append(await _stream(http, url, n, ev))

                async with trio.open_nursery() as inner:
                    inner.start_soon(run, long, 400, first)
                    await first.wait()
                    inner.start_soon(run, short, 8, short_started)
                    await short_started.wait()  # admitted and streaming before the signal
                    router.send_signal(signal.SIGTERM)
            assert short[0][-1] == b"[DONE]"  # finished inside the graceful timeout
            terminal = msgspec.json.decode(long[0][-1])["error"]
            assert terminal["code"] == 503
            assert terminal["message"].startswith("router shutting down")
            with trio.fail_after(10):
                assert await router.wait() == 0
        finally:
            if router.poll() is None:
                router.kill()
                with trio.move_on_after(5):
                    await router.wait()
    logs = log_path.read_text()
    assert "sk-engine-secret-42" not in logs
    # JSON mode: every line is one JSON object, hypercorn's and the SIGHUP refusal too
    records = [json.loads(line) for line in logs.splitlines() if line.strip()]
    assert any(r["msg"].startswith("Running on") for r in records)
    assert any("keeping the running fleet" in r["msg"] for r in records)
    requests = [r for r in records if r["msg"] == "request"]
    assert sorted(r["outcome"] for r in requests) == ["completed", "failed"]
    assert all(len(r["request_id"]) == 16 and "prefill_s" in r for r in requests)
    assert any(r["msg"] == "draining" for r in records)
    assert "keeping the running fleet" in logs
    assert "bogus: unknown key" in logs


async def test_a_body_still_arriving_when_the_drain_ends_gets_a_503_and_a_journal_line(
    nursery: trio.Nursery,
) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(graceful_timeout_s=0.5),
    )
    host, port = harness.url.removeprefix("http://").split(":")
    sock = await trio.open_tcp_stream(host, int(port))
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL.encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    await sock.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body[:5])
    await trio.testing.wait_all_tasks_blocked()  # the router is reading the body
    harness.stop.set()  # SIGTERM: the drain starts; the rest of the body never comes
    answer = b""
    with trio.fail_after(10):
        while chunk := await sock.receive_some(65536):
            answer += chunk
    await sock.aclose()
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b"still arriving" in answer
    with trio.fail_after(10):
        await harness.stopped.wait()
    (line,) = harness.router.journal.lines
    assert (line.outcome, line.status) == ("rejected", 503)


async def test_an_admin_action_waits_for_its_whole_request(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    harness.router.config_path = str(tmp_path / "missing.toml")  # a reload would say 400
    host, port = harness.url.removeprefix("http://").split(":")
    sock = await trio.open_tcp_stream(host, int(port))
    # a chunked body that never ends: no reload happens for a request not yet whole
    await sock.send_all(
        b"POST /narwhal/reload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n"
    )
    answer = b""
    with trio.fail_after(10):
        while b"\r\n\r\n" not in answer and (chunk := await sock.receive_some(65536)):
            answer += chunk
    await sock.aclose()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    big = await harness.post("/narwhal/reload", b"x" * 5_000_000)
    assert big.status == 413
    empty = await harness.post("/narwhal/reload", b"")
    assert empty.status == 400  # the whole (empty) request: the reload ran, and said why
    await finish(harness)
