"""`narwhal serve --workers 2` acts as one router (contract 3): SIGTERM drains every worker,
a reload reaches every worker without holding up new requests, a dead worker's gauges stop
counting, and the kernel spreads connections over the workers. Real processes on
127.0.0.1: two fake engines (the decode one streams a token every 50 ms) and the router."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpcore
import msgspec
import pytest
import trio
from prometheus_client import Gauge

from narwhal.observe.metrics import Metrics
from narwhal.process.workers import RESTART_WINDOW_S, RESTARTS, failure_status, restart_allowed
from narwhal.stream.sse import SSEParser
from tests.support.processes import running

MODEL = "fake-model"
URL = re.compile(r"narwhal: serving .* on (http://127\.0\.0\.1:\d+) .* in 2 workers")
START_BOUND_S = 60.0  # two Python processes importing the router on a loaded 2-core machine


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[str, str]]:
    """A prefill and a decode fake engine (50 ms between tokens), shared by the module."""
    with (
        running("fake-engine", "--port", "0", "--role", "prefill") as (_, p_url),
        running("fake-engine", "--port", "0", "--role", "decode", "--itl-s", "0.05") as (_, d_url),
    ):
        yield p_url, d_url


def _fleet(path: Path, engines: tuple[str, str], grace_s: float, *more: str) -> Path:
    """The fleet file: p0 and d0, then ``more`` decode engines that listen nowhere."""
    p_url, d_url = engines
    text = (
        f'model = "{MODEL}"\n[[engines]]\nid = "p0"\nurl = "{p_url}"\nrole = "prefill"\n'
        f'[[engines]]\nid = "d0"\nurl = "{d_url}"\nrole = "decode"\n'
    )
    for engine_id in more:
        text += f'[[engines]]\nid = "{engine_id}"\nurl = "http://127.0.0.1:9"\nrole = "decode"\n'
    path.write_text(text + f"[serving]\ngraceful_timeout_s = {grace_s}\n")
    return path


class Served:
    """The router's parent process; its stderr lines as they come."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self.url = ""
        self.eof = False
        self._changed = trio.Event()

    async def read_stderr(self) -> None:
        assert self.process.stderr is not None
        buffer = b""
        async for chunk in self.process.stderr:
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            self.lines += [line.decode(errors="replace") for line in lines]
            self._changed.set()
            self._changed = trio.Event()
        self.eof = True
        self._changed.set()

    async def closed(self) -> None:
        """Return once every process that wrote to the stderr pipe has closed it."""
        while not self.eof:
            await self._changed.wait()

    async def line(self, pattern: str, after: int = 0) -> str:
        """The first line from ``after`` on that matches ``pattern`` (the caller bounds it)."""
        return (await self.line_at(pattern, after))[1]

    async def line_at(self, pattern: str, after: int = 0) -> tuple[int, str]:
        while True:
            for index in range(after, len(self.lines)):
                if re.search(pattern, self.lines[index]):
                    return index, self.lines[index]
            if self.eof:
                raise AssertionError(f"no line matches {pattern!r}")
            await self._changed.wait()


@asynccontextmanager
async def serve_workers(
    fleet: Path, journal: Path | None = None, env: dict[str, str] | None = None
) -> AsyncIterator[Served]:
    """``narwhal serve --workers 2`` until every worker serves; SIGTERM at the end if it
    still runs (the tests that stop it themselves check its exit)."""
    args = [sys.executable, "-m", "narwhal", "serve", "--config", str(fleet), "--port", "0"]
    args += ["--workers", "2", *(["--journal", str(journal)] if journal else [])]
    process = await trio.lowlevel.open_process(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    served = Served(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(served.read_stderr)
            with trio.fail_after(START_BOUND_S):
                match = URL.search(await served.line(URL.pattern))
            assert match is not None
            served.url = match.group(1)
            yield served
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                await process.wait()
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(5):
                await process.wait()


async def _get(url: str) -> tuple[int, Any]:
    """GET on a connection of its own (so the kernel picks a worker for it)."""
    async with httpcore.AsyncConnectionPool() as http:
        resp = await http.request("GET", url)
        return resp.status, resp.content


async def _views(base: str, tries: int = 100) -> dict[int, dict[str, Any]]:
    """``/narwhal/engines`` from each of the two workers: fresh connections until both
    answered (the kernel picks; ``tries`` bounds it)."""
    views: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        status, body = await _get(base + "/narwhal/engines")
        assert status == 200
        view = json.loads(body)
        views[view["worker"]["index"]] = view
        if len(views) == 2:
            return views
    raise AssertionError(f"only worker(s) {sorted(views)} answered in {tries} connections")


async def _stream(
    base: str, rid: str, max_tokens: int, first: trio.Event, out: dict[str, Any]
) -> None:
    """One streamed completion on its own connection; ``out[rid]``: the SSE payloads, or
    the exception that cut the stream without a terminal event. ``first`` is set at the
    first event (or the end)."""
    body = msgspec.json.encode(
        {"model": MODEL, "prompt": "hello there", "stream": True, "max_tokens": max_tokens}
    )
    headers = [("content-type", "application/json"), ("x-request-id", rid)]
    events: list[bytes] = []
    out[rid] = events
    try:
        async with (
            httpcore.AsyncConnectionPool() as http,
            http.stream("POST", base + "/v1/completions", content=body, headers=headers) as resp,
        ):
            assert resp.status == 200
            parser = SSEParser()
            async for chunk in resp.aiter_stream():
                events += parser.feed(chunk)
                if events:
                    first.set()
    except httpcore.RemoteProtocolError as exc:
        # a terminal event is followed by the body's cut (contract 6); anything else is a cut
        if not (events and b'"error"' in events[-1]):
            out[rid] = exc
    except Exception as exc:
        out[rid] = exc
    finally:
        first.set()


async def _start(nursery: trio.Nursery, base: str, rid: str, n: int, out: dict[str, Any]) -> None:
    first = trio.Event()
    nursery.start_soon(_stream, base, rid, n, first, out)
    with trio.fail_after(30):
        await first.wait()
    assert isinstance(out[rid], list), out[rid]


def _ending(events: Any) -> str:
    """How a stream ended: done, terminal (an error event), or cut (anything else)."""
    if isinstance(events, list) and events:
        if events[-1] == b"[DONE]":
            return "done"
        if b'"error"' in events[-1]:
            return "terminal"
    return "cut"


async def test_sigterm_drains_every_worker(engines: tuple[str, str], tmp_path: Path) -> None:
    fleet = _fleet(tmp_path / "fleet.toml", engines, 3.0)
    journal = tmp_path / "journal.jsonl"
    out: dict[str, Any] = {}
    async with serve_workers(fleet, journal) as router:
        base = router.url
        async with trio.open_nursery() as nursery:
            # long streams (100 s) until each worker holds two: the kernel picks the worker
            held: dict[int, int] = {}
            for n in range(24):
                await _start(nursery, base, f"long-{n}", 2000, out)
                if n >= 3:
                    held = {i: v["admitted"] for i, v in (await _views(base)).items()}
                    if min(held.values()) >= 2:
                        break
            assert min(held.values()) >= 2, held
            # short streams (30 tokens: 1.5 s) that finish inside the 3 s grace
            for n in range(4):
                await _start(nursery, base, f"short-{n}", 30, out)
            stopped_at = trio.current_time()
            router.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                status = await router.process.wait()
        took = trio.current_time() - stopped_at
    endings = Counter(_ending(events) for events in out.values())
    print(f"\nSIGTERM, --workers 2, streams per worker {held}: {dict(endings)}, exit {status}")
    print(f"parent exited {took:.1f}s after SIGTERM (graceful_timeout_s 3)")
    assert status == 0
    assert endings["cut"] == 0
    for rid, events in out.items():
        if rid.startswith("short"):
            assert _ending(events) == "done", rid
        else:
            terminal = msgspec.json.decode(events[-1])["error"]
            assert terminal["code"] == 503
            assert terminal["message"].startswith("router shutting down")
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    requests = [line for line in lines if "event" not in line]
    by_id = Counter(line["request_id"] for line in requests)
    print(f"journal: {len(requests)} request lines for {len(out)} streams")
    assert by_id == Counter(list(out))  # exactly one line per request
    for line in requests:
        expected = ("completed", 200) if line["request_id"].startswith("short") else ("failed", 503)
        assert (line["outcome"], line["status"]) == expected
    assert not any("killed" in line for line in router.lines)


async def test_a_reload_reaches_every_worker_and_holds_up_nothing(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    fleet = _fleet(tmp_path / "fleet.toml", engines, 1.0)
    out: dict[str, Any] = {}
    async with serve_workers(fleet) as router:
        base = router.url
        async with trio.open_nursery() as nursery:
            # a long stream (20 s) on each worker: a reload that waited for it would show
            held: dict[int, int] = {}
            for n in range(16):
                await _start(nursery, base, f"long-{n}", 400, out)
                held = {i: v["admitted"] for i, v in (await _views(base)).items()}
                if min(held.values()) >= 1:
                    break
            assert min(held.values()) >= 1, held

            async def short(name: str, took: dict[str, float]) -> None:
                start = trio.current_time()
                with trio.fail_after(30):
                    await _stream(base, name, 2, trio.Event(), out)
                took[name] = trio.current_time() - start
                assert _ending(out[name]) == "done", out[name]

            # POST /narwhal/reload (d9 added) to one worker; a request started with it
            _fleet(fleet, engines, 1.0, "d9")
            took: dict[str, float] = {}
            reply: dict[str, Any] = {}

            async def post() -> None:
                async with httpcore.AsyncConnectionPool() as http:
                    resp = await http.request("POST", base + "/narwhal/reload")
                reply.update(status=resp.status, body=json.loads(resp.content))

            async with trio.open_nursery() as during:
                during.start_soon(post)
                during.start_soon(short, "during-post", took)
            assert reply["status"] == 200, reply
            answers = reply["body"]["workers"]
            assert sorted(a["worker"] for a in answers) == [0, 1]
            assert all(a["added"] == ["d9"] for a in answers)
            # answered once every worker had reloaded: whichever worker answers now
            seen = await _fleets(base, 20)
            assert seen == {(0, ("p0", "d0", "d9")), (1, ("p0", "d0", "d9"))}, seen
            # an invalid file is refused by the worker asked, and no worker changes
            fleet.write_text(fleet.read_text() + "bogus = 1\n")
            async with httpcore.AsyncConnectionPool() as http:
                refused = await http.request("POST", base + "/narwhal/reload")
            assert refused.status == 400
            problems = json.loads(refused.content)["error"]["problems"]
            assert [p.split(" in ")[0] for p in problems] == ["serving.bogus: unknown key"]
            assert await _fleets(base, 4) == seen

            # SIGHUP to the parent (d9 out, d8 in); a request started with it
            _fleet(fleet, engines, 1.0, "d8")
            mark = len(router.lines)
            router.process.send_signal(signal.SIGHUP)
            await short("during-sighup", took)
            with trio.fail_after(20):
                done = await router.line("workers reloaded reason=SIGHUP", after=mark)
            assert done.count('"added":["d8"]') == 2, done
            seen = await _fleets(base, 20)
            assert seen == {(0, ("p0", "d0", "d8")), (1, ("p0", "d0", "d8"))}, seen
            # d9 left: the workers' shared metric files still hold its series, and no
            # scrape, by whichever worker, shows them (engine_up 1 would keep alerting)
            for _ in range(6):
                scrape = (await _get(base + "/metrics"))[1].decode()
                assert 'engine="d9"' not in scrape
                assert 'engine="d8"' in scrape
            longs = [out[rid] for rid in out if rid.startswith("long")]
            still = sum(isinstance(e, list) and _ending(e) == "cut" for e in longs)
            print(f"\nreload with a 20 s stream on each worker: requests took {took}")
            print(f"long streams still running after both reloads: {still}")
            assert still == len(longs)  # none ended
            assert max(took.values()) < 5.0, took
            nursery.cancel_scope.cancel()  # the long streams' clients leave
        router.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await router.process.wait() == 0


async def _fleets(base: str, n: int) -> set[tuple[int, tuple[str, ...]]]:
    """(worker, engine ids) from ``n`` fresh connections, and at least one of each worker."""
    seen = set()
    for _ in range(n):
        _, body = await _get(base + "/narwhal/engines")
        view = json.loads(body)
        seen.add((view["worker"]["index"], tuple(e["id"] for e in view["engines"])))
    for index, view in (await _views(base)).items():
        seen.add((index, tuple(e["id"] for e in view["engines"])))
    return seen


def _decode_inflight(text: str) -> float:
    for line in text.splitlines():
        if (
            line.startswith("narwhal_engine_legs_inflight{")
            and 'engine="d0",phase="decode"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("narwhal_engine_legs_inflight d0 decode not exported")


async def test_a_dead_workers_gauges_stop_counting(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    out: dict[str, Any] = {}
    async with serve_workers(_fleet(tmp_path / "fleet.toml", engines, 1.0), env=env) as router:
        base = router.url
        async with trio.open_nursery() as nursery:
            await _start(nursery, base, "held", 2000, out)
            views = await _views(base)
            victim_index = next(i for i, v in views.items() if v["admitted"] == 1)
            victim = views[victim_index]["worker"]["pid"]
            # the stream's decode leg counts, in the victim's own file
            assert (prom / f"gauge_livesum_{victim}.db").exists()
            for _ in range(4):
                assert _decode_inflight((await _get(base + "/metrics"))[1].decode()) == 1.0
            mark = len(router.lines)
            os.kill(victim, signal.SIGKILL)
            with trio.fail_after(20):
                await router.line(f"worker exited; restarting it .*pid={victim}", after=mark)
            # marked dead before the restart: from now on no scrape counts it
            assert not list(prom.glob(f"gauge_live*_{victim}.db"))
            for _ in range(10):
                assert _decode_inflight((await _get(base + "/metrics"))[1].decode()) == 0.0
            assert _ending(out["held"]) == "cut"  # its worker was killed under it
            with trio.fail_after(START_BOUND_S):
                await router.line("worker serving", after=mark)
            views = await _views(base)
            assert views[victim_index]["worker"]["pid"] != victim  # restarted
            workers = [v["worker"]["pid"] for v in views.values()]
            print(f"\nworker {victim_index} (pid {victim}) killed: restarted as {workers}")
        # the parent killed: its workers see the control channel close, drain and exit
        router.process.kill()
        with trio.fail_after(30):
            await router.process.wait()
            # the workers hold the parent's stderr until they exit: its end is their end
            await router.closed()


async def test_connections_are_spread_over_the_workers(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    total, concurrency = 400, 8
    async with serve_workers(_fleet(tmp_path / "fleet.toml", engines, 1.0)) as router:
        counts: Counter[int] = Counter()
        out: dict[str, Any] = {}

        async def client(n: int) -> None:
            for _ in range(n):
                status, body = await _get(router.url + "/narwhal/engines")
                assert status == 200
                counts[json.loads(body)["worker"]["index"]] += 1

        async with trio.open_nursery() as nursery:
            for n in range(4):  # load: streams in flight while the clients connect
                await _start(nursery, router.url, f"load-{n}", 2000, out)
            async with trio.open_nursery() as clients:
                for _ in range(concurrency):
                    clients.start_soon(client, total // concurrency)
            nursery.cancel_scope.cancel()
    share = counts[0] / total
    print(f"\n{total} connections ({concurrency} at a time): worker 0 {counts[0]}, 1 {counts[1]}")
    assert sum(counts.values()) == total
    assert 0.4 <= share <= 0.6, counts


async def test_a_worker_that_keeps_dying_stops_the_router(
    engines: tuple[str, str], tmp_path: Path
) -> None:
    async with serve_workers(_fleet(tmp_path / "fleet.toml", engines, 1.0)) as router:
        after = 0
        for _ in range(RESTARTS + 1):  # killed as soon as it is started, each time
            with trio.fail_after(20):
                at, line = await router.line_at(r"worker started worker=0 pid=\d+", after)
            os.kill(int(line.rsplit("pid=", 1)[1]), signal.SIGKILL)
            after = at + 1
        with trio.fail_after(30):
            assert await router.process.wait() == 1
        assert any("worker exits too often; stopping" in line for line in router.lines)


def test_every_gauge_counts_live_workers_only() -> None:
    """A gauge in a mode without "live" keeps a dead worker's value after
    ``mark_process_dead``: every gauge the router exports is live."""
    metrics = Metrics(["e0"])
    modes = {
        name: value._multiprocess_mode
        for name, value in vars(metrics).items()
        if isinstance(value, Gauge)
    }
    assert modes
    assert all(mode.startswith("live") for mode in modes.values()), modes


def test_restarts_are_bounded() -> None:
    from collections import deque

    exits: deque[float] = deque()
    assert all(restart_allowed(exits, float(t)) for t in range(RESTARTS))
    assert not restart_allowed(exits, float(RESTARTS))  # one too many within the window
    assert restart_allowed(exits, RESTART_WINDOW_S + 2.0)  # the early ones have aged out
    assert [failure_status(c) for c in (0, 2, 8, -9, -15, 137)] == [1, 2, 8, 1, 1, 1]


async def test_every_worker_reads_the_engines_events_in_listen_mode(tmp_path: Path) -> None:
    """``[kv_events] mode = "listen"`` under ``--workers 2``: one process can bind the
    address the engines' publishers connect to, so the parent does and hands every batch
    to both workers; each worker's view of each engine goes live."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        listen = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    publish = ("--kv-events-endpoint", listen)
    with (
        running("fake-engine", "--port", "0", "--role", "prefill", *publish,
                "--kv-events-topic", "kv-p0") as (_, p_url),
        running("fake-engine", "--port", "0", "--role", "decode", *publish,
                "--kv-events-topic", "kv-d0") as (_, d_url),
    ):  # fmt: skip
        fleet = _fleet(tmp_path / "fleet.toml", (p_url, d_url), 1.0)
        fleet.write_text(fleet.read_text() + f'[kv_events]\nmode = "listen"\nlisten = "{listen}"\n')
        async with serve_workers(fleet) as served:
            prompt = " ".join(f"w{k}" for k in range(40))  # two full blocks: a batch each
            states: dict[int, dict[str, str]] = {}
            for i in range(50):  # bounded: a request a round, until both workers read both
                body = {"model": MODEL, "prompt": f"{i} {prompt}", "max_tokens": 1}
                async with httpcore.AsyncConnectionPool() as http:
                    answer = await http.request(
                        "POST", served.url + "/v1/completions", content=msgspec.json.encode(body)
                    )
                assert answer.status == 200
                views = await _views(served.url)
                states = {
                    index: {e["id"]: e["kv_events"]["state"] for e in view["engines"]}
                    for index, view in views.items()
                }
                if all(set(s.values()) == {"live"} for s in states.values()):
                    break
            assert states == {0: {"p0": "live", "d0": "live"}, 1: {"p0": "live", "d0": "live"}}
