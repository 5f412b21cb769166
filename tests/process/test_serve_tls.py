"""`narwhal serve --ssl-certfile --ssl-keyfile`: the router serves TLS, and offers only
HTTP/1.1 in ALPN (it refuses HTTP/2); run from outside, with a trustme CA and httpx."""

from __future__ import annotations

import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trustme

URL = re.compile(r"(https?://127\.0\.0\.1:\d+)")
START_BOUND_S = 60.0


@contextmanager
def _process(*args: str) -> Iterator[str]:
    """Start ``narwhal ARGS`` and yield the URL it announces; SIGTERM it at the end (exit 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    announcements: list[str] = []
    found = threading.Event()

    def read() -> None:  # reads to the end: a full pipe would block the process
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            announced = ("fake-engine", "narwhal: serving", "Running on")
            if any(a in line for a in announced) and URL.search(line):
                announcements.append(line)
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_BOUND_S
        while not found.wait(0.1):
            assert proc.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, "".join(seen)
        match = URL.search(announcements[0])
        assert match is not None
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        reader.join(timeout=5)
        proc.stderr.close()
    assert proc.returncode == 0, "".join(seen)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def tls_files(ca: trustme.CA, tmp_path: Path) -> tuple[str, str]:
    issued = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    return str(cert), str(key)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Path]:
    """Two fake engines (p0 prefill, d0 decode) as processes, and a fleet file naming them."""
    with (
        _process("fake-engine", "--port", "0", "--role", "prefill") as p_url,
        _process("fake-engine", "--port", "0", "--role", "decode") as d_url,
    ):
        path = tmp_path / "fleet.toml"
        path.write_text(
            f'model = "fake-model"\n[[engines]]\nid = "p0"\nurl = "{p_url}"\nrole = "prefill"\n'
            f'[[engines]]\nid = "d0"\nurl = "{d_url}"\nrole = "decode"\n'
        )
        yield path


def _client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


def _alpn(url: str, ca: trustme.CA) -> str | None:
    """The protocol the server picks when a client offers h2 first, then http/1.1."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    context = _client_context(ca)
    context.set_alpn_protocols(["h2", "http/1.1"])
    with (
        socket.create_connection((host, int(port)), timeout=20) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        return tls.selected_alpn_protocol()


def test_serve_tls_answers_a_completion(
    fleet: Path, tls_files: tuple[str, str], ca: trustme.CA
) -> None:
    cert, key = tls_files
    args = ("serve", "--config", str(fleet), "--port", "0")
    with _process(*args, "--ssl-certfile", cert, "--ssl-keyfile", key) as url:
        assert url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=_client_context(ca), timeout=20) as client:
            reply = client.post(
                url + "/v1/completions",
                json={"model": "fake-model", "prompt": "hi", "max_tokens": 3},
            )
            assert reply.status_code == 200, reply.text
            assert reply.http_version == "HTTP/1.1"
            assert reply.json()["usage"]["completion_tokens"] == 3
            assert reply.headers["x-request-id"]
            with client.stream(
                "POST",
                url + "/v1/chat/completions",
                json={
                    "model": "fake-model",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "stream": True,
                },
            ) as stream:
                assert stream.status_code == 200
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert len(events) >= 5  # a role chunk, four tokens, [DONE]
        assert _alpn(url, ca) == "http/1.1"
        # no silent downgrade: a client that does not trust the CA is refused
        with (
            httpx.Client(verify=ssl.create_default_context(), timeout=20) as untrusting,
            pytest.raises(httpx.ConnectError),
        ):
            untrusting.get(url + "/health")


def test_serve_tls_with_workers(fleet: Path, tls_files: tuple[str, str], ca: trustme.CA) -> None:
    cert, key = tls_files
    args = ("serve", "--config", str(fleet), "--port", "0", "--workers", "2")
    with _process(*args, "--ssl-certfile", cert, "--ssl-keyfile", key) as url:
        assert url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=_client_context(ca), timeout=20) as client:
            for _ in range(4):
                assert client.get(url + "/health").status_code == 200
        assert _alpn(url, ca) == "http/1.1"
