"""The router's KV lease defaults to vLLM 0.32's (contract 2: ``engine.kv_lease_s = 30``).

vLLM 0.32's producer frees KV nobody read after ``kv_lease_duration``, 30 s unless the
engines set it; a consumer that reads the blocks after that gets other requests' KV and
vLLM reports no error. A router default above the engines' (480 s, the old NIXL abort
timeout) sent such descriptors on. ``narwhal check`` says which lease is in force and
whether the fleet file set it or it is the default.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from narwhal.fake_engine.config import FakeEngineConfig
from tests.support.fleet import MODEL
from tests.support.memory_fleet import memory_fleet

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}  # 2 prompt tokens
# every engine refuses at once: check reports them, and the lease line all the same
REFUSING = (
    'model = "fake-model"\n'
    '[[engines]]\nid = "p0"\nurl = "http://127.0.0.1:1"\nrole = "prefill"\n'
    '[[engines]]\nid = "d0"\nurl = "http://127.0.0.1:1"\nrole = "decode"\n'
)


def check(fleet: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "narwhal", "check", "--config", str(fleet)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_with_the_defaults_a_handoff_older_than_vllms_lease_is_never_decoded(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    # a producer as slow as an overloaded one: 31 s to its first (and only) token, past
    # vLLM 0.32's 30 s lease; router and engines on their defaults
    fleet = await memory_fleet(nursery, prefill_delay=15.5)
    assert fleet.producer.config.kv_lease_s == FakeEngineConfig().kv_lease_s == 30.0
    sink = await fleet.request(BODY)
    when, what, (status, body) = sink.events[-1]
    assert (what, status) == ("json", 504), body  # not a 200 decoded from freed blocks
    message = body["error"]["message"]
    assert message.startswith("KV handoff expired"), message
    assert "lease allows (28.5s)" in message, message
    assert when == 31.0
    assert [e for e in fleet.consumer.log if e["request_id"].endswith("-decode")] == []
    assert fleet.consumer.counters["kv_pull_ok"] == 0


def test_check_says_the_lease_is_the_default(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(REFUSING)
    done = check(fleet)
    assert done.returncode == 1  # the engines are unreachable
    assert "Traceback" not in done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("engine.kv_lease_s")]
    assert line.startswith("engine.kv_lease_s = 30s (the default, vLLM 0.32's"), line
    assert "older than 28.5s" in line, line


def test_check_says_the_fleet_file_set_the_lease(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(REFUSING + "[engine]\nkv_lease_s = 60.0\n")
    done = check(fleet)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("engine.kv_lease_s")]
    assert line.startswith(f"engine.kv_lease_s = 60s (set in {fleet})"), line
    assert "older than 57s" in line, line
