"""A router over fake engines on an in-memory network (``tests.support.memory_network``): with
trio's MockClock and autojump, virtual time only moves when everything waits, so timeouts
fire at exactly their budgets. The timing tests and the stream models use it.

``memory_fleet(..., sockets=True)`` connects over socketpairs, and ``fleet.connect()`` opens
a client connection through the real front door (``ClientConnection``, the router's ASGI
app): a token then takes the production path, parked in the stream reactor and written to
the client's socket without waiting, still under virtual time."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from hypercorn.trio.worker_context import WorkerContext

from narwhal.core.config import FleetConfig
from narwhal.core.requests import parse_request
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.frontdoor.connection import ClientConnection
from narwhal.frontdoor.server_end import ServerEnd
from narwhal.router.app import RouterApp
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from narwhal.router.serving import hypercorn_config
from narwhal.stream.sse import SSEParser
from tests.support.fleet import MODEL, fleet_config
from tests.support.memory_network import MemoryNetwork


@dataclass
class RecordingSink:
    """The client side of one request, with the virtual time of everything it received."""

    committed: bool = False
    finished: bool = False
    events: list[tuple[float, str, Any]] = field(default_factory=list)

    def _log(self, what: str, data: Any) -> None:
        self.events.append((trio.current_time(), what, data))

    async def commit(self, data: bytes) -> None:
        self.committed = True
        self._log("commit", data)

    async def send(self, data: bytes) -> None:
        self._log("send", data)

    async def end(self, data: bytes = b"") -> None:
        self.finished = True
        self._log("end", data)

    def delivered(self) -> bool:
        return True

    @property
    def direct(self) -> None:
        return None  # every write waits: in-memory streams have no direct write

    async def cut(self, data: bytes, *, abandon: bool = False) -> None:
        self.finished = True
        self._log("cut", data)

    async def respond_json(self, status: int, body: bytes) -> None:
        self.committed = self.finished = True
        self._log("json", (status, msgspec.json.decode(body)))

    @property
    def error(self) -> tuple[float, int, str]:
        """(time, status, message) of the failure the client saw, JSON or terminal event."""
        when, what, data = self.events[-1]
        if what == "json":
            return when, data[0], data[1]["error"]["message"]
        payload = msgspec.json.decode(SSEParser().feed(data)[-1])
        return when, payload["error"]["code"], payload["error"]["message"]


@dataclass
class MemoryFleet:
    router: Router
    producer: FakeEngine
    consumer: FakeEngine
    others: list[FakeEngine] = field(default_factory=list)  # more consumers: d1, d2, ...
    config: FleetConfig | None = None
    network: MemoryNetwork | None = None

    async def connect(self) -> trio.SocketStream:
        """A client's connection to the router's front door, over a socketpair: the
        connection is served in the fleet's nursery as ``narwhal serve`` serves one."""
        assert self.config is not None
        assert self.network is not None
        hc = hypercorn_config(self.config, "127.0.0.1", 0)
        asgi = RouterApp(self.router)
        context = WorkerContext(None)
        context.terminated = ServerEnd(context.terminated)
        client, server = self.network.socket_pair()
        conn = ClientConnection(asgi, hc, context, {}, server, hooks=asgi)  # type: ignore[arg-type]
        self.network.nursery.start_soon(conn.run)
        return client

    async def request(self, body: dict[str, Any], path: str = "/v1/completions") -> RecordingSink:
        sink = RecordingSink()
        req = parse_request(msgspec.json.encode(body), endpoint=path, model=MODEL)
        await self.router.handle(req, "rid", sink, trio.sleep_forever)
        return sink


async def memory_fleet(
    nursery: trio.Nursery,
    *,
    itl_s: float = 0.0,
    prefill_delay: float = 0.0,
    consumers: int = 1,
    sockets: bool = False,
    **sections: Any,
) -> MemoryFleet:
    net = MemoryNetwork(nursery, sockets=sockets)
    engines = []
    names = [("producer", "prefill")] + [(f"consumer{i}", "decode") for i in range(consumers)]
    for name, role in names:
        cfg = FakeEngineConfig(
            model=MODEL,
            role=role,
            itl_s=itl_s,
            prefill_delay_per_token_s=prefill_delay,  # type: ignore[arg-type]
        )
        engine = FakeEngine(cfg, network=net)
        engine.attach(name)
        engines.append(engine)
    urls = {"p0": (engines[0].url, "prefill")}
    urls.update({f"d{i}": (e.url, "decode") for i, e in enumerate(engines[1:])})
    config = fleet_config(urls, **sections)
    router = Router(config, connect=net.open_stream, journal=Journal(keep=100))
    # checks and probes; over sockets, the reactor that parks decode streams too
    services = [router.health.run, *([router.reactor.run] if sockets else [])]
    await nursery.start(router.background.run, services)
    return MemoryFleet(router, engines[0], engines[1], engines[2:], config, net)


@dataclass
class EngineFleet:
    """A router over any number of fake engines (``engines``: by id) on one in-memory
    network, scraping their ``/metrics`` as ``narwhal serve`` does."""

    router: Router
    engines: dict[str, FakeEngine]


async def engine_fleet(
    nursery: trio.Nursery,
    engines: dict[str, FakeEngineConfig],
    *,
    rng: random.Random | None = None,
    **sections: Any,
) -> EngineFleet:
    """Fake engines by id, each as configured (its role from its config), and a router over
    them that runs health checks and scrapes: the cost model's queues and prefix caches
    under trio's MockClock, for placement and the admission queue as the engines load up."""
    net = MemoryNetwork(nursery)
    fakes: dict[str, FakeEngine] = {}
    for eid, cfg in engines.items():
        fakes[eid] = FakeEngine(cfg, network=net)
        fakes[eid].attach(eid)
    config = fleet_config({eid: (e.url, e.config.role) for eid, e in fakes.items()}, **sections)
    router = Router(config, connect=net.open_stream, journal=Journal(keep=100_000), rng=rng)
    await nursery.start(router.background.run, [router.health.run, router.scraper.run])
    return EngineFleet(router, fakes)
