"""A fleet of fake engines and a router on loopback (real clock, no mocks), and the client
harness the tests drive it with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpcore
import msgspec
import trio

from narwhal.core.config import EngineConfig, EngineSpec, FleetConfig, ServingConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from narwhal.router.serving import serve
from narwhal.stream.chunked import ChunkedDecoder
from narwhal.stream.sse import SSEParser

MODEL = "fake-model"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    def events(self) -> list[bytes]:
        return SSEParser().feed(self.body)


@dataclass
class Harness:
    """A running router in front of fake engines, and a client to talk to it."""

    url: str
    router: Router
    engines: dict[str, FakeEngine]
    http: httpcore.AsyncConnectionPool
    stop: trio.Event = field(default_factory=trio.Event)
    stopped: trio.Event = field(default_factory=trio.Event)

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
        payload = body if isinstance(body, bytes) else msgspec.json.encode(body)
        hdrs = [("content-type", "application/json"), *(headers or {}).items()]
        resp = await self.http.request("POST", self.url + path, headers=hdrs, content=payload)
        return _reply(resp)

    async def get(self, path: str) -> Reply:
        return _reply(await self.http.request("GET", self.url + path))


def _reply(resp: httpcore.Response) -> Reply:
    headers = {k.decode().lower(): v.decode() for k, v in resp.headers}
    return Reply(resp.status, headers, resp.content)


def fleet_config(engines: dict[str, tuple[str, str]], **sections: Any) -> FleetConfig:
    specs = tuple(EngineSpec(eid, url, role) for eid, (url, role) in engines.items())
    serving = sections.pop("serving", ServingConfig(graceful_timeout_s=0.5))
    engine = sections.pop("engine", EngineConfig())
    return FleetConfig(model=MODEL, engines=specs, serving=serving, engine=engine, **sections)


async def start_fleet(
    nursery: trio.Nursery,
    roles: dict[str, str],
    *,
    engine_config: dict[str, Any] | None = None,
    engine_configs: dict[str, dict[str, Any]] | None = None,
    journal: Journal | None = None,
    **sections: Any,
) -> Harness:
    """Start one fake engine per entry of ``roles`` ({id: role}) and a router over them;
    ``engine_configs``: settings of single engines, over ``engine_config``."""
    engines: dict[str, FakeEngine] = {}
    urls: dict[str, tuple[str, str]] = {}
    for eid, role in roles.items():
        settings = {**(engine_config or {}), **(engine_configs or {}).get(eid, {})}
        engine = FakeEngine(FakeEngineConfig(model=MODEL, role=role, **settings))  # type: ignore[arg-type]
        urls[eid] = (await nursery.start(engine.serve), role)
        engines[eid] = engine
    config = fleet_config(urls, **sections)
    router = Router(config, journal=journal or Journal(keep=10_000))
    return await serve_router(nursery, router, engines)


async def serve_router(
    nursery: trio.Nursery,
    router: Router,
    engines: dict[str, FakeEngine] | None = None,
    *,
    max_connections: int = 64,
) -> Harness:
    """Serve ``router`` on a free loopback port until the harness's ``stop`` is set."""
    stop, stopped = trio.Event(), trio.Event()

    async def run_router(task_status: trio.TaskStatus[str]) -> None:
        try:
            await serve(
                router.config,
                port=0,
                router=router,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
        finally:
            stopped.set()

    url = await nursery.start(run_router)
    http = httpcore.AsyncConnectionPool(max_connections=max_connections)
    return Harness(url, router, engines or {}, http, stop, stopped)


async def finish(harness: Harness, *, disconnects: int = 0) -> None:
    """After every test: no reservation, no engine connection serving a request."""
    await harness.http.aclose()
    with trio.fail_after(5):
        await harness.router.wait_drained()
        await harness.router.reclaimer.wait_idle()  # reclaim legs use engine connections
    # none held by a request; a readmission probe may be crossing a handoff (two legs each)
    assert harness.router.fleet.reserved() == 2 * harness.router.health.probe_handoffs
    assert harness.router.disconnects == disconnects
    # every request to a completion endpoint left exactly one terminal journal line
    assert harness.router.journal.written == harness.router.admission.received
    busy = {u: active for u, (_, active) in harness.router.client.connections().items() if active}
    assert busy == {}, f"engine connections still serving requests: {busy}"
    harness.stop.set()
    with trio.fail_after(5):
        await harness.stopped.wait()


@dataclass
class RawReply(Reply):
    """A response read from a raw socket until the router closed the connection."""

    ended: bool  # the chunked body's last chunk arrived (False: the body was cut)


async def post_raw(
    harness: Harness, path: str, body: Any, extra: dict[str, str] | None = None
) -> RawReply:
    """POST ``body`` (with ``extra`` headers) on a fresh kept-alive raw connection and read
    the response until it is complete or the router closes the connection: what a client
    sees on the wire, a body cut short included (``Harness.post`` raises on that)."""
    payload = msgspec.json.encode(body)
    host, port = harness.url.removeprefix("http://").split(":")
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (extra or {}).items())
    raw, content, decoder = b"", b"", ChunkedDecoder()
    headers: dict[str, str] = {}
    status = 0
    with trio.fail_after(20):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(head.encode() + b"content-length: %d\r\n\r\n" % len(payload))
            await stream.send_all(payload)
            while True:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    data = b""
                if not data:
                    return RawReply(status, headers, content, ended=False)
                if not status:
                    raw += data
                    if b"\r\n\r\n" not in raw:
                        continue
                    status, headers, data = _parse_head(raw)
                if headers.get("transfer-encoding") == "chunked":
                    content += b"".join(decoder.feed(data))
                    if decoder.done:
                        return RawReply(status, headers, content, ended=True)
                else:
                    content += data
                    if len(content) >= int(headers.get("content-length", -1)):
                        return RawReply(status, headers, content, ended=True)


def _parse_head(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    return int(lines[0].split()[1]), headers, rest
