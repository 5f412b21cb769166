"""TLS to engines (contract 2): ``https://`` engine URLs are spoken to over TLS, verified against
``engine.ca_file`` (or the system trust store), by the router, its health probes and
``narwhal check``; a certificate that does not verify is an engine fault like a refused
connection, and the bearer token never leaves the router before the engine is verified.

Real loopback sockets and a trustme CA; each fake engine is put behind a small
TLS-terminating front that hands the decrypted stream to the engine's own request loop.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from narwhal.core.config import ConfigError, EngineConfig
from narwhal.core.config_parse import parse_config
from narwhal.core.faults import EngineStatusError, EngineUnreachable
from narwhal.engines.client import EngineClient
from narwhal.engines.engine_connection import EngineConnection
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.http import Exchange, Request, serve_connection
from narwhal.process.check import check_fleet
from narwhal.process.config_files import load_config_bytes
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from tests.support.fleet import MODEL, Harness, finish, fleet_config, serve_router

TOKEN = "engine-token-7f3a"
TOKEN_ENV = "NARWHAL_TEST_TLS_ENGINE_KEY"
BODY = {"model": MODEL, "prompt": "hello over tls", "max_tokens": 8}


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture(scope="module")
def untrusted_context() -> ssl.SSLContext:
    """A certificate for the same names from a CA the router does not trust."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "engines-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
def wrong_ca_file(tmp_path: Path) -> str:
    path = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return str(path)


class TLSFront:
    """An https listener in front of a fake engine: TLS handshake, then the engine's HTTP
    loop on the decrypted stream. Counts handshakes and records each request's
    Authorization header (which only ever travels inside TLS)."""

    def __init__(self, engine: FakeEngine, context: ssl.SSLContext) -> None:
        self.engine = engine
        self.context = context
        self.handshakes = 0
        self.failed_handshakes = 0
        self.authorization: list[str | None] = []
        self.connections: set[trio.CancelScope] = set()
        self._closed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        task_status.started(f"https://127.0.0.1:{port}")
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, self.context, server_side=True, https_compatible=True)
        with trio.CancelScope() as scope:
            self.connections.add(scope)
            try:
                try:
                    await tls.do_handshake()
                except trio.BrokenResourceError:
                    self.failed_handshakes += 1
                    return
                self.handshakes += 1
                await serve_connection(tls, self.answer)  # closes the TLS stream
            finally:
                try:  # closes the socket at once, then may raise Cancelled
                    await trio.aclose_forcefully(stream)  # a failed or cancelled handshake
                finally:
                    self.connections.discard(scope)
                    if not self.connections:
                        self._closed.set()

    async def answer(self, req: Request, ex: Exchange) -> None:
        self.authorization.append(req.headers.get("authorization"))
        await self.engine.handle(req, ex)

    async def drop_connections(self) -> None:
        """Close every open connection (as a restarted engine would), and wait until the
        sockets are closed."""
        self._closed = trio.Event()
        if not self.connections:
            return
        for scope in self.connections:
            scope.cancel()
        with trio.fail_after(5):
            await self._closed.wait()


class PlainListener:
    """A plain-HTTP listener: records every byte each connection sends until it closes,
    answering its first read as an HTTP server would (which ends a TLS handshake)."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        self._changed = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[int]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self.handle, listeners)

    async def handle(self, stream: trio.SocketStream) -> None:
        data = bytearray()
        try:
            first = await stream.receive_some(65536)
            data += first
            if b"\r\n\r\n" in first or first[:1] == b"\x16":
                await stream.send_all(
                    b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                )
            while chunk := await stream.receive_some(65536):
                data += chunk
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)
            self.received.append(bytes(data))
            self._changed.set()

    async def wait_received(self, connections: int) -> None:
        """Until that many connections have closed (everything they sent is recorded)."""
        with trio.fail_after(5):
            while len(self.received) < connections:
                self._changed = trio.Event()
                await self._changed.wait()


async def start_engine(
    nursery: trio.Nursery, role: str, context: ssl.SSLContext
) -> tuple[str, FakeEngine, TLSFront]:
    engine = FakeEngine(FakeEngineConfig(model=MODEL, role=role))  # type: ignore[arg-type]
    await nursery.start(engine.serve)  # its KV side channel; HTTP comes through the front
    front = TLSFront(engine, context)
    url: str = await nursery.start(front.serve)
    return url, engine, front


async def start_router(
    nursery: trio.Nursery, urls: dict[str, tuple[str, str]], engine: EngineConfig
) -> Harness:
    config = fleet_config(urls, engine=engine)
    router = Router(config, journal=Journal(keep=1000))
    return await serve_router(nursery, router, max_connections=8)


@pytest.fixture
async def https_pd(
    nursery: trio.Nursery,
    server_context: ssl.SSLContext,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """A producer and a consumer behind TLS; the router is started by each test."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    p_url, p_engine, p_front = await start_engine(nursery, "prefill", server_context)
    d_url, d_engine, d_front = await start_engine(nursery, "decode", server_context)
    return {
        "urls": {"p0": (p_url, "prefill"), "d0": (d_url, "decode")},
        "engines": {"p0": p_engine, "d0": d_engine},
        "fronts": {"p0": p_front, "d0": d_front},
    }


# ---- (a) the whole request path over TLS -------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_through_the_router_over_tls(
    nursery: trio.Nursery, https_pd: dict[str, Any], ca_file: str, stream: bool
) -> None:
    engine = EngineConfig(ca_file=ca_file, api_key_env=TOKEN_ENV)
    harness = await start_router(nursery, https_pd["urls"], engine)
    reply = await harness.post("/v1/completions", {**BODY, "stream": stream})
    assert reply.status == 200, reply.body
    if stream:
        events = reply.events()
        assert events[-1] == b"[DONE]"
        assert any(b'"text"' in e for e in events[:-1])
    else:
        assert reply.json()["choices"][0]["text"]
    p_front, d_front = https_pd["fronts"]["p0"], https_pd["fronts"]["d0"]
    # the engines are reachable only through their TLS fronts: every request, legs and
    # health checks, came over TLS, the token inside it
    assert p_front.handshakes >= 1
    assert d_front.handshakes >= 1
    assert p_front.failed_handshakes == d_front.failed_handshakes == 0
    assert f"Bearer {TOKEN}" in p_front.authorization
    assert f"Bearer {TOKEN}" in d_front.authorization
    # and the KV moved from producer to consumer (a crossed handoff, not a local decode)
    assert https_pd["engines"]["p0"].counters["prefill"] == 1
    assert https_pd["engines"]["d0"].counters["kv_pull_ok"] == 1
    await finish(harness)


async def test_tls_connections_are_kept_alive_and_replaced_when_closed(
    nursery: trio.Nursery, https_pd: dict[str, Any], ca_file: str
) -> None:
    url = https_pd["urls"]["d0"][0]
    front: TLSFront = https_pd["fronts"]["d0"]
    client = EngineClient(ca_file=ca_file)
    for _ in range(3):
        assert await client.get(url, "/health") == (200, b"")
    assert front.handshakes == 1  # one connection, reused
    assert client.connections()[url] == (1, 0)
    conn: EngineConnection = client._engines[url].pool.idle[0]
    assert isinstance(conn.stream, trio.SSLStream)
    assert conn.socket is None  # never read past TLS
    assert conn.poll_socket is not None
    assert conn.looks_alive(trio.current_time())
    await front.drop_connections()  # the engine closes the idle connection
    with trio.fail_after(5):
        await trio.lowlevel.wait_readable(conn.poll_socket)
    assert not conn.looks_alive(trio.current_time())
    assert await client.get(url, "/health") == (200, b"")
    assert front.handshakes == 2
    await client.aclose()


async def test_plain_http_keeps_the_direct_read_path(nursery: trio.Nursery) -> None:
    engine = FakeEngine(FakeEngineConfig(model=MODEL))
    url = await nursery.start(engine.serve)
    client = EngineClient()
    assert await client.get(url, "/health") == (200, b"")
    conn: EngineConnection = client._engines[url].pool.idle[0]
    assert isinstance(conn.stream, trio.SocketStream)
    assert conn.socket is not None
    assert conn.socket is conn.poll_socket
    assert client._tls is None  # an http-only client never loads a trust store
    await client.aclose()


async def test_check_passes_over_tls(https_pd: dict[str, Any], ca_file: str) -> None:
    engine = EngineConfig(ca_file=ca_file, api_key_env=TOKEN_ENV)
    lines, ok = await check_fleet(fleet_config(https_pd["urls"], engine=engine), leg_timeout_s=5.0)
    assert ok, lines
    assert lines[-1] == "PASS: 2/2 engines ok, 1/1 transfers moved KV"
    for front in https_pd["fronts"].values():  # check speaks to engines as the router does
        assert front.authorization
        assert set(front.authorization) == {f"Bearer {TOKEN}"}


# ---- (b) a certificate that does not verify ----------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_whose_certificate_stops_verifying_is_an_engine_fault(
    nursery: trio.Nursery,
    https_pd: dict[str, Any],
    ca_file: str,
    untrusted_context: ssl.SSLContext,
    stream: bool,
) -> None:
    """The producer comes back with a certificate from a CA the router does not trust: its
    leg fails as a refused connection would (502), the message names the problem."""
    engine = EngineConfig(ca_file=ca_file, api_key_env=TOKEN_ENV)
    harness = await start_router(nursery, https_pd["urls"], engine)
    p_front: TLSFront = https_pd["fronts"]["p0"]
    p_front.context = untrusted_context
    await p_front.drop_connections()  # the health check's verified connection goes too
    handshakes, tokens = p_front.handshakes, len(p_front.authorization)
    reply = await harness.post("/v1/completions", {**BODY, "stream": stream})
    assert reply.status == 502, reply.body
    error = reply.json()["error"]
    assert error["code"] == 502
    assert error["message"].startswith("cannot connect to engine p0: TLS handshake failed: ")
    assert "certificate verify failed" in error["message"]
    assert p_front.handshakes == handshakes
    assert p_front.failed_handshakes >= 1
    assert len(p_front.authorization) == tokens  # no request reached it
    await finish(harness)
    line = harness.router.journal.lines[-1]  # the journal names the engine by its URL
    assert line.message is not None
    assert line.message.startswith(f"cannot connect to engine {https_pd['urls']['p0'][0]}: ")


@pytest.mark.parametrize("trust", ["wrong_ca", "system_store"])
async def test_a_router_that_cannot_verify_an_engine_never_speaks_to_it(
    nursery: trio.Nursery,
    https_pd: dict[str, Any],
    wrong_ca_file: str,
    trust: str,
) -> None:
    """Started with the wrong CA (or the system store, which does not know the test CA):
    requests fail (502 from the leg, or 503 when active health keeps the engine out of
    placement) and no request, no token, ever reaches an engine."""
    engine = EngineConfig(
        ca_file=wrong_ca_file if trust == "wrong_ca" else "", api_key_env=TOKEN_ENV
    )
    harness = await start_router(nursery, https_pd["urls"], engine)
    reply = await harness.post("/v1/completions", BODY)
    assert reply.status in (502, 503), reply.body
    if reply.status == 502:
        assert "certificate verify failed" in reply.json()["error"]["message"]
    for front in https_pd["fronts"].values():
        assert front.handshakes == 0
        assert front.authorization == []
    await finish(harness)


@pytest.mark.parametrize("trust", ["wrong_ca", "system_store", "name_mismatch"])
async def test_engine_client_names_the_engine_and_the_verification_problem(
    nursery: trio.Nursery,
    ca: trustme.CA,
    ca_file: str,
    wrong_ca_file: str,
    server_context: ssl.SSLContext,
    trust: str,
) -> None:
    context = server_context
    if trust == "name_mismatch":  # a certificate for another name than the URL's host
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("engine.example").configure_cert(context)
    url, _, _ = await start_engine(nursery, "both", context)
    client = EngineClient(
        ca_file={"wrong_ca": wrong_ca_file, "system_store": ""}.get(trust, ca_file)
    )
    with pytest.raises(EngineUnreachable) as caught:
        await client.get(url, "/health")
    message = caught.value.message
    assert message.startswith(f"cannot connect to engine {url}: TLS handshake failed: ")
    assert "certificate verify failed" in message
    if trust == "name_mismatch":
        assert "mismatch" in message
    assert caught.value.status == 502
    assert client.connections()[url] == (0, 0)
    await client.aclose()


async def test_check_fails_on_an_unverified_engine(
    https_pd: dict[str, Any], wrong_ca_file: str
) -> None:
    config = fleet_config(https_pd["urls"], engine=EngineConfig(ca_file=wrong_ca_file))
    lines, ok = await check_fleet(config, leg_timeout_s=5.0)
    assert not ok
    assert lines[-1].startswith("FAIL: 0/2 engines ok")
    assert "certificate verify failed" in lines[0]


# ---- (c) the bearer token never travels in plain text to an https URL --------------------


async def test_the_token_never_goes_to_an_https_url_in_plain_text(
    nursery: trio.Nursery,
    https_pd: dict[str, Any],
    ca_file: str,
) -> None:
    """A plain-HTTP listener at an https URL sees a TLS ClientHello and nothing else: from
    the engine client's data legs, from the router (its health checks and legs) and from
    ``narwhal check``. The control: the same listener at an http URL sees the token, so the
    listener would have caught it."""
    listener = PlainListener()
    port = await nursery.start(listener.serve)
    url = f"https://127.0.0.1:{port}"
    client = EngineClient(api_key=TOKEN, ca_file=ca_file)
    with pytest.raises(EngineUnreachable, match="TLS handshake failed"):
        await client.prefill(url, "/v1/completions", BODY)
    with pytest.raises(EngineUnreachable, match="TLS handshake failed"):
        async with client.decode(url, "/v1/completions", BODY, None):
            pass
    await client.aclose()

    urls = {**https_pd["urls"], "p0": (url, "prefill")}
    engine = EngineConfig(ca_file=ca_file, api_key_env=TOKEN_ENV)
    harness = await start_router(nursery, urls, engine)
    for stream in (False, True):
        reply = await harness.post("/v1/completions", {**BODY, "stream": stream})
        assert reply.status in (502, 503), reply.body  # 503: active health keeps it out
    await finish(harness)
    lines, ok = await check_fleet(fleet_config(urls, engine=engine), leg_timeout_s=5.0)
    assert not ok
    assert lines[0].startswith(f"p0 (prefill, {url}): unreachable: ")
    assert "TLS handshake failed" in lines[0]

    await listener.wait_received(4)  # 2 legs, at least 1 from the router, 1 from check
    for data in listener.received:
        assert data[:1] == b"\x16"  # a TLS handshake record: the ClientHello
        assert b"authorization" not in data.lower()
        assert TOKEN.encode() not in data
        assert b"HTTP/1.1" not in data

    control = PlainListener()  # the same listener at an http URL
    port = await nursery.start(control.serve)
    client = EngineClient(api_key=TOKEN)
    with pytest.raises(EngineStatusError):  # it answers 400: the request went out
        async with client.decode(f"http://127.0.0.1:{port}", "/v1/completions", BODY, None):
            pass
    await client.aclose()
    await control.wait_received(1)
    assert f"authorization: Bearer {TOKEN}".encode() in control.received[0]


# ---- configuration ----------------------------------------------------------------------


def _fleet_toml(engine: str = "", url: str = "https://127.0.0.1:8443") -> bytes:
    return f"""
model = "m"
[[engines]]
id = "e0"
url = "{url}"
[engine]
{engine}
""".encode()


def test_ca_file_loads(ca_file: str) -> None:
    fleet = load_config_bytes(_fleet_toml(f"ca_file = {ca_file!r}"), fmt="toml")
    assert fleet.engine.ca_file == ca_file
    assert load_config_bytes(_fleet_toml(), fmt="toml").engine.ca_file == ""


def test_a_missing_ca_file_is_a_config_error(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigError) as caught:
        load_config_bytes(_fleet_toml(f"ca_file = {missing!r}"), fmt="toml")
    assert caught.value.problems == [
        f"engine.ca_file: cannot load CA bundle {missing!r}: No such file or directory"
    ]


@pytest.mark.parametrize("content", [b"", b"not a certificate\n", b"-----BEGIN CERTIFICATE-----\n"])
def test_a_ca_file_that_is_not_a_bundle_is_a_config_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.pem"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        load_config_bytes(_fleet_toml(f"ca_file = {str(path)!r}"), fmt="toml")
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(
        f"engine.ca_file: cannot load CA bundle {str(path)!r}"
    )


@pytest.mark.parametrize(
    "url", ["ftp://10.0.0.1:8000", "grpc://e0:50051", "unix:///tmp/e0.sock", "10.0.0.1:8000"]
)
def test_an_engine_url_scheme_other_than_http_or_https_is_refused(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_fleet_toml(url=url), fmt="toml")
    assert any(p.startswith("engines[0].url: ") for p in caught.value.problems)


async def test_an_unknown_scheme_never_falls_back_to_plain_http() -> None:
    client = EngineClient()
    with pytest.raises(EngineUnreachable, match="unsupported URL scheme 'ftp'"):
        await client.get("ftp://127.0.0.1:1", "/health")
    await client.aclose()
