"""Every status line the router writes carries its standard reason phrase (contract 3): clients
print ``response.reason`` (vLLM's benchmark client showed an empty error for each 502).
Read from the wire with raw sockets, as a stranger's client sees it."""

from __future__ import annotations

from http import HTTPStatus

import msgspec
import pytest
import trio

from narwhal.core.config import AdmissionConfig, ServingConfig
from narwhal.fake_engine.faults import Fault
from tests.support.fleet import MODEL, Harness, finish, start_fleet

KEYS_ENV = "NARWHAL_TEST_PHRASE_KEYS"
KEY = b"authorization: Bearer phrase-key"
LIMIT = 64 * 1024
COMPLETION = msgspec.json.encode({"model": MODEL, "prompt": "hi", "max_tokens": 2})


def line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s" % (status, HTTPStatus(status).phrase.encode())


def request(method: bytes, path: bytes, body: bytes = b"", *headers: bytes) -> bytes:
    head = [method + b" " + path + b" HTTP/1.1", b"host: 127.0.0.1", b"connection: close"]
    if body or method == b"POST":
        head.append(b"content-length: %d" % len(body))
    return b"\r\n".join([*head, *headers, b"", b""]) + body


async def exchange(h: Harness, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the router wrote until it closed."""
    host, port = h.url.removeprefix("http://").split(":")
    received = b""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(data)
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass
    return received


def status_line(raw: bytes) -> bytes:
    return raw.partition(b"\r\n")[0]


@pytest.fixture
async def keyed(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> Harness:
    monkeypatch.setenv(KEYS_ENV, "phrase-key")
    serving = ServingConfig(
        api_keys_env=KEYS_ENV,
        graceful_timeout_s=0.5,
        max_request_bytes=LIMIT,
        max_inflight=1,
        client_body_timeout_s=0.5,
    )
    # queue off: at max_inflight the next request is refused at once (the queue's own 429s
    # are tests/loopback/test_flow_control.py's)
    admission = AdmissionConfig(queue=False)
    return await start_fleet(
        nursery, {"p0": "prefill", "d0": "decode"}, serving=serving, admission=admission
    )


async def test_status_lines_carry_their_reason_phrase(keyed: Harness) -> None:
    h = keyed
    completion = (b"POST", b"/v1/completions")
    cases = [
        (request(b"GET", b"/health"), 200),
        (request(b"GET", b"/metrics"), 200),
        (request(b"GET", b"/narwhal/engines"), 200),  # admin, from loopback
        (request(*completion, COMPLETION, KEY), 200),
        (request(*completion, b"{not json", KEY), 400),
        (request(*completion, COMPLETION), 401),
        (request(b"GET", b"/no/such/path", b"", KEY), 404),
        (request(b"GET", b"/v1/completions", b"", KEY), 405),
        (request(*completion, b"x" * (LIMIT + 1), KEY), 413),
    ]
    for data, status in cases:
        raw = await exchange(h, data)
        assert status_line(raw) == line(status), raw[:200]

    # the server's own answer to a body that breaks its framing (written outside the app)
    chunked = request(*completion, b"", KEY, b"transfer-encoding: chunked")
    chunked = chunked.replace(b"content-length: 0\r\n", b"") + b"zz\r\n"
    assert status_line(await exchange(h, chunked)) == line(400)

    # a body that trickles in slower than client_body_timeout_s
    slow = request(*completion, b"", KEY).replace(b"content-length: 0", b"content-length: 10")
    assert status_line(await exchange(h, slow)) == line(408)

    # engine faults: 500 from the producer is a 502, an engine's 504 stays a 504
    h.engines["p0"].faults.push(Fault(kind="status", status=500, leg="prefill"))
    assert status_line(await exchange(h, request(*completion, COMPLETION, KEY))) == line(502)
    h.engines["p0"].faults.push(Fault(kind="status", status=504, leg="prefill"))
    assert status_line(await exchange(h, request(*completion, COMPLETION, KEY))) == line(504)

    # at max_inflight (1): a held request makes the next one a 429
    h.engines["p0"].faults.push(Fault(kind="hang", leg="prefill"))
    async with trio.open_nursery() as held:
        held.start_soon(exchange, h, request(*completion, COMPLETION, KEY))
        with trio.fail_after(5):
            await h.engines["p0"].wait_running()  # the held request is admitted, prefilling
        assert status_line(await exchange(h, request(*completion, COMPLETION, KEY))) == line(429)
        held.cancel_scope.cancel()

    # maintenance: /ready and completions answer 503
    h.router.health.maintenance = True
    assert status_line(await exchange(h, request(b"GET", b"/ready"))) == line(503)
    assert status_line(await exchange(h, request(*completion, COMPLETION, KEY))) == line(503)
    h.router.health.maintenance = False
    await finish(h, disconnects=1)  # the held request's client left


async def test_an_interim_100_continue_carries_its_phrase(keyed: Harness) -> None:
    h = keyed
    head = request(b"POST", b"/v1/completions", b"", KEY, b"expect: 100-continue")
    head = head.replace(b"content-length: 0", b"content-length: %d" % len(COMPLETION))
    host, port = h.url.removeprefix("http://").split(":")
    received = b""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(head)
            while b"\r\n\r\n" not in received:
                received += await stream.receive_some(65536)
            assert status_line(received) == b"HTTP/1.1 100 Continue"
            await stream.send_all(COMPLETION)
            while chunk := await stream.receive_some(65536):
                received += chunk
    assert line(200) in received
    await finish(h)
