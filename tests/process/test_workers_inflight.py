"""``serving.max_inflight`` bounds the whole router under ``--workers N`` (contract 3, 4.5): the
workers share no counter, so each admits its share (max_inflight / N, the shares summing
to max_inflight exactly), and ``/narwhal/engines`` says which. Requests beyond the total
get 429 whichever worker the kernel hands their connection to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpcore
import msgspec
import trio

from narwhal.core.config import ServingConfig
from tests.support.fleet import finish, start_fleet
from tests.support.serve_process import MODEL, narwhal_serve, start_engines, write_fleet

HELD = 12  # streams opened one after another, each on a connection of its own


async def _open_stream(url: str) -> tuple[int, trio.SocketStream, bytes]:
    """A streamed completion on a connection of its own: (status, the connection, its head,
    with the body of a refusal). A 200 stays open (the stream runs on); the caller closes
    it."""
    host, port = url.removeprefix("http://").split(":")
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": "hold this", "max_tokens": 200, "stream": True}
    )
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while not _whole(got):
        data = await stream.receive_some(65536)
        assert data, "the router closed without an answer"
        got += data
    return int(got.split(b" ", 2)[1]), stream, got


# without the queue, the request beyond max_inflight is refused at once (with the queue it
# would wait: tests/loopback/test_flow_control.py)
QUEUE_OFF = "[admission]\nqueue = false\n"


def _whole(got: bytes) -> bool:
    """The head has come, and the body too if it has a length (an error's JSON)."""
    head, end, body = got.partition(b"\r\n\r\n")
    if not end:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


async def _views(url: str) -> dict[int, dict[str, Any]]:
    """``/narwhal/engines`` of each of the two workers (fresh connections until both
    answered; the kernel picks the worker by the connection's addresses)."""
    views: dict[int, dict[str, Any]] = {}
    for _ in range(200):
        async with httpcore.AsyncConnectionPool() as http:
            reply = await http.request("GET", url + "/narwhal/engines")
        view = msgspec.json.decode(reply.content)
        views[view["worker"]["index"]] = view
        if len(views) == 2:
            return views
    raise AssertionError("one worker never answered")


async def test_two_workers_admit_max_inflight_in_all_and_429_beyond(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    # a token every 0.2 s: an admitted stream lasts far longer than the test needs it
    engines = await start_engines(nursery, {"p0": "prefill", "d0": "decode"}, itl_s=0.2)
    fleet = write_fleet(tmp_path / "fleet.toml", engines, "max_inflight = 2\n" + QUEUE_OFF)
    async with narwhal_serve("--config", str(fleet), "--workers", "2") as served:
        with trio.fail_after(60):
            views = await _views(served.url)
        for view in views.values():
            assert view["max_inflight"] == {"router": 2, "this_worker": 1, "workers": 2}
        answers: list[tuple[int, trio.SocketStream, bytes]] = []
        try:
            with trio.fail_after(60):
                for _ in range(HELD):
                    answers.append(await _open_stream(served.url))
            statuses = [status for status, _, _ in answers]
            admitted = statuses.count(200)
            assert 1 <= admitted <= 2  # never more than max_inflight across the workers
            assert statuses.count(429) == HELD - admitted
            refusal = next(got for status, _, got in answers if status == 429)
            assert b"retry-after: 1" in refusal.lower()
            assert b"router is at max_inflight=2 (this worker's share: 1, of 2 workers)" in refusal
        finally:
            for _, stream, _ in answers:
                await stream.aclose()
        # a reload splits the new figure; one that cannot be split is refused everywhere
        async with httpcore.AsyncConnectionPool() as http:
            write_fleet(fleet, engines, "max_inflight = 1\n" + QUEUE_OFF)
            refused = await http.request("POST", served.url + "/narwhal/reload")
            assert refused.status == 400
            assert b"serving.max_inflight: 1 is fewer than the 2 workers" in refused.content
            write_fleet(fleet, engines, "max_inflight = 5\n" + QUEUE_OFF)
            assert (await http.request("POST", served.url + "/narwhal/reload")).status == 200
        with trio.fail_after(60):
            views = await _views(served.url)
        shares = {index: view["max_inflight"]["this_worker"] for index, view in views.items()}
        assert shares == {0: 3, 1: 2}


async def test_a_single_router_admits_all_of_max_inflight(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(max_inflight=3, graceful_timeout_s=0.5),
    )
    view = (await harness.get("/narwhal/engines")).json()
    assert view["max_inflight"] == {"router": 3, "this_worker": 3, "workers": 1}
    await finish(harness)


def test_more_workers_than_max_inflight_is_refused_at_start(tmp_path: Path) -> None:
    fleet = write_fleet(
        tmp_path / "fleet.toml",
        {"e0": ("http://127.0.0.1:9", "both")},
        "max_inflight = 2\n",
    )
    command = [sys.executable, "-m", "narwhal", "serve", "--config", str(fleet)]
    done = subprocess.run(
        [*command, "--port", "0", "--workers", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2  # narwhal.process.startup.EXIT_INVALID_FLEET
    assert "serving.max_inflight: 2 is fewer than the 3 workers" in done.stderr
    assert "Traceback" not in done.stderr
