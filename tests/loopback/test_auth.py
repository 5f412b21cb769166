"""Client API keys: 401 without the right bearer key; operations endpoints stay open.
Admin endpoints (``/narwhal/*``) follow their own rule: ``tests/loopback/test_front_door.py``."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest
import trio

from narwhal.core.config import ConfigError, ServingConfig
from narwhal.router.auth import ApiKeys
from tests.support.fleet import MODEL, Harness, finish, start_fleet

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


async def _keyed_fleet(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> Harness:
    """A router that wants one of two client keys."""
    monkeypatch.setenv("NARWHAL_TEST_CLIENT_KEYS", "key-one, key-two")
    return await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        serving=ServingConfig(api_keys_env="NARWHAL_TEST_CLIENT_KEYS", graceful_timeout_s=0.5),
    )


async def test_keys_are_required_when_configured(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await _keyed_fleet(nursery, monkeypatch)
    for headers in (
        {},
        {"authorization": "Bearer key-three"},
        {"authorization": "key-one"},
        {"authorization": "Bearer key-on"},
    ):
        reply = await harness.post("/v1/completions", BODY, headers)
        assert reply.status == 401
        assert reply.json()["error"]["type"] == "authentication_error"
        assert reply.headers["www-authenticate"] == "Bearer"
        assert reply.headers["x-request-id"]
    assert not harness.engines["p0"].log  # nothing reached an engine
    for key in ("key-one", "key-two"):
        reply = await harness.post("/v1/completions", BODY, {"authorization": f"Bearer {key}"})
        assert reply.status == 200
    for open_path in ("/health", "/ready", "/metrics"):
        assert (await harness.get(open_path)).status == 200
    await finish(harness)


def test_an_unset_key_variable_fails_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NARWHAL_TEST_NO_SUCH_VAR", raising=False)
    with pytest.raises(ConfigError, match="NARWHAL_TEST_NO_SUCH_VAR is unset or empty"):
        ApiKeys("NARWHAL_TEST_NO_SUCH_VAR")
    assert ApiKeys("").allows([])  # no variable named: an open router


async def test_the_journal_says_who_asked_by_address_and_key_hash_never_the_key(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = await _keyed_fleet(nursery, monkeypatch)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    before = time.time()
    ok = await harness.post("/v1/completions", body, {"authorization": "Bearer key-two"})
    refused = await harness.post("/v1/completions", body, {"authorization": "Bearer nope"})
    assert (ok.status, refused.status) == (200, 401)
    await harness.router.wait_drained()
    served, denied = harness.router.journal.lines
    assert served.key == hashlib.sha256(b"key-two").hexdigest()[:12]
    assert denied.key == hashlib.sha256(b"nope").hexdigest()[:12]
    for line in (served, denied):
        assert line.client is not None
        assert line.client.startswith("127.0.0.1:")
        assert before - 1 <= line.at <= time.time() + 0.001  # at is rounded to a millisecond
        assert b"key-two" not in msgspec.json.encode(line)
    await finish(harness)
