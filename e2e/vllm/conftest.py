"""Two real vLLM engines (a producer and a consumer moving KV over NIXL) and our router in
front of them, for the suite marked ``vllm``. ``make e2e-vllm`` builds the environment first.

Every process is started in its own session and ended by its own process group, on every
exit path: a fixture's ``finally``, and SIGTERM/SIGHUP turned into KeyboardInterrupt so the
finalizers run when ``make`` is interrupted too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import pytest

from .ports import free_port, http, start_in_session, stop_group  # http: 120 s = HANDOFF_S

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MODEL = "tiny"
LORA = "tinylora"  # the name engines started with lora_args() serve setup.sh's adapter under
START_S = 400.0  # an engine is ready in 40-130 s on the 2-core machine; slack for a busy one
HANDOFF_S = 120.0  # handoffs sometimes stall 15-30 s (NIXL's lease); never assert latency
KV_LEASE_S = 60.0  # the producer's kv_lease_duration (vLLM 0.32's default is 30 s)
KV_BLOCKS = 400
# a router's budgets for these engines: CPU prefills and handoffs are slow, never a failure
PATIENT_SERVING = {"request_timeout_s": 300.0, "prefill_timeout_s": 120.0, "max_attempts": 1}
PATIENT_ENGINE = {
    "kv_lease_s": KV_LEASE_S,
    "first_token_timeout_s": 120.0,
    "decode_read_timeout_s": 60.0,
    "health_timeout_s": 10.0,
}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class PortClash(Exception):
    """A child said it could not bind its port: start it again on fresh ports."""


def up(url: str) -> bool:
    try:
        return http("GET", url, timeout=5)[0] == 200
    except OSError:
        return False


@dataclass
class Process:
    """One child in its own session, its output in a log file."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_in_session(self.argv, self.log, self.env, ROOT)

    def wait_until(self, url: str, budget_s: float) -> None:
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.clashed():
                raise PortClash(f"{self.name}: a port was taken\n{self.tail()}")
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if up(url):
                return
            time.sleep(1.0)  # waiting for a child process to come up; bounded by budget_s
        pytest.fail(f"{self.name} not ready at {url} within {budget_s:.0f}s:\n{self.tail()}")

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)  # our own child's group, by its id

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace_s)
            self.proc = None

    def clashed(self) -> bool:
        # vLLM's side-channel thread dies on EADDRINUSE while the server lives on, unready
        try:
            return b"Address already in use" in self.log.read_bytes()
        except OSError:
            return False

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class Engine(Process):
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, prefix: str) -> float:
        """Sum of every sample whose name starts with ``prefix`` on the engine's /metrics."""
        status, body = http("GET", self.url + "/metrics", timeout=30)
        assert status == 200
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(prefix):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class Fleet:
    producer: Engine
    consumer: Engine
    router: Process
    router_url: str
    config: Path
    logs: Path

    def engines(self) -> dict[str, dict[str, Any]]:
        status, body = http("GET", self.router_url + "/narwhal/engines", timeout=30)
        assert status == 200
        return {e["id"]: e for e in json.loads(body)["engines"]}


def warm_pair(producer: Engine, consumer: Engine) -> None:
    """One handoff directly between the two: the first of a pair does NIXL's handshake,
    and until then what the consumer tells the producer (a pull, a release) can wait on
    it; so it happens outside the measured tests and outside any router's breaker."""
    body = {"model": MODEL, "prompt": "warm up the pair", "max_tokens": 1, "temperature": 0}
    raw = b""
    for _ in range(3):  # bounded: a first handshake can time out once on a busy machine
        pre = {**body, "kv_transfer_params": {"do_remote_decode": True}}
        status, raw = http("POST", producer.url + "/v1/completions", pre)
        assert status == 200, raw
        kv = json.loads(raw)["kv_transfer_params"]
        status, raw = http(
            "POST", consumer.url + "/v1/completions", {**body, "kv_transfer_params": kv}
        )
        if status == 200:
            return
    pytest.fail(f"no handoff {producer.name} -> {consumer.name} succeeded: {raw[:300]!r}")


def fleet_toml(engines: list[tuple[str, str, str]], **sections: dict[str, Any]) -> str:
    """A fleet file for a router of a test's own: its engines as (id, url, role), then one
    TOML table per keyword (``serving={...}``, ``placement={...}``)."""
    lines = [f"model = {json.dumps(MODEL)}", ""]
    for engine_id, url, role in engines:
        lines += ["[[engines]]", f"id = {json.dumps(engine_id)}", f"url = {json.dumps(url)}"]
        lines += [f"role = {json.dumps(role)}", ""]
    for table, keys in sections.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
        lines.append("")
    return "\n".join(lines)


def serve_router(fleet: Fleet, name: str, fleet_text: str, extra: tuple[str, ...] = ()) -> Process:
    """A router of its own on a fleet file of this text (and ``extra`` arguments to
    ``narwhal serve``), ready; its ``url`` set."""
    config = fleet.logs / f"{name}.toml"
    config.write_text(fleet_text)
    port = free_port()
    argv = [*fleet.router.argv[:3], "serve", "--config", str(config), "--port", str(port)]
    argv += extra
    router = Process(name, argv, fleet.logs / f"{name}.log")
    router.start()
    router.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    router.wait_until(router.url + "/ready", 60)  # type: ignore[attr-defined]
    return router


def _vllm_dir() -> Path:
    raw = os.environ.get("NARWHAL_VLLM_DIR", "")
    path = Path(raw) if raw else Path.home() / ".cache" / "narwhal-vllm"
    if not (path / ".ready").exists():
        pytest.fail(f"no vLLM environment in {path}: run `make e2e-vllm` (it builds one)")
    return path


def _engine(vllm: Path, logs: Path, name: str, role: str) -> Engine:
    port, side = free_port(), free_port()
    argv = ["bash", str(HERE / "serve_nixl.sh"), str(vllm), str(port), str(side), role]
    # named and required tool choice need a tool-call parser (test_differential's shapes)
    argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    # a small KV cache (400 blocks of 128 tokens), so that 20 orphaned handoffs show in
    # vllm:kv_cache_usage_perc (test_kv_lease.py); the lease is the fleet file's kv_lease_s
    argv += ["--num-gpu-blocks-override", str(KV_BLOCKS)]
    env = {"NARWHAL_KV_LEASE_S": str(int(KV_LEASE_S))}
    return Engine(name=name, argv=argv, log=logs / f"{name}.log", env=env, port=port)


def start_engine(fleet: Fleet, name: str, role: str, extra: tuple[str, ...] = ()) -> Engine:
    """One more engine beside the session's pair (``extra``: arguments for ``vllm serve``,
    the last of a repeated one wins), healthy; on a port clash once more on fresh ports.
    The caller stops it."""
    (engine,) = start_engines(fleet, [(name, role, extra)])
    return engine


def start_engines(fleet: Fleet, specs: list[tuple[str, str, tuple[str, ...]]]) -> list[Engine]:
    """Several more engines, each (name, role, extra) as for ``start_engine``, loading at
    once (a start-up is mostly waiting), all healthy; on a port clash all once more on
    fresh ports. The caller stops them."""
    vllm = _vllm_dir()
    for attempt in (1, 2):
        suffix = "" if attempt == 1 else f"-{attempt}"
        engines: list[Engine] = []
        try:
            for name, role, extra in specs:
                engine = _engine(vllm, fleet.logs, name + suffix, role)
                engine.argv += extra
                engines.append(engine)
                engine.start()
            for engine in engines:
                engine.wait_until(engine.url + "/health", START_S)
            return engines
        except PortClash as clash:
            for engine in engines:
                engine.stop()
            if attempt == 2:
                pytest.fail(str(clash))
            print(f"\n{clash}\nstarting {', '.join(s[0] for s in specs)} again on fresh ports")
        except BaseException:
            for engine in engines:
                engine.stop()
            raise
    raise AssertionError("unreachable")


def lora_args() -> tuple[str, ...]:
    """``vllm serve`` arguments that serve setup.sh's adapter (DIR/tiny-lora: rank 8 on
    ``q_proj`` and ``v_proj``) as ``LORA`` beside the base model."""
    adapter = _vllm_dir() / "tiny-lora"
    if not (adapter / "adapter_model.safetensors").exists():
        pytest.fail(f"no LoRA adapter in {adapter}: run `make e2e-vllm` (setup.sh writes it)")
    return ("--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{LORA}={adapter}")


def restart(engine: Engine) -> None:
    """An engine that was killed (or stopped) up again at its URL, healthy, logging to a
    log of its own (``<name>-restart<n>.log``: ``clashed`` reads the whole log). Its NIXL
    side-channel port may still be held for a moment after a SIGKILL: on a clash, once
    more on a fresh side-channel port (the URL stays, so the routers' fleet files do)."""
    for attempt in (1, 2):
        engine.stop()
        n = 1
        while (engine.log.parent / f"{engine.name}-restart{n}.log").exists():
            n += 1  # bounded: one log per restart
        engine.log = engine.log.parent / f"{engine.name}-restart{n}.log"
        engine.start()
        try:
            engine.wait_until(engine.url + "/health", START_S)
            return
        except PortClash as clash:
            if attempt == 2:
                engine.stop()
                pytest.fail(str(clash))
            print(f"\n{clash}\nstarting {engine.name} again on a fresh side-channel port")
            engine.argv[4] = str(free_port())  # serve_nixl.sh DIR PORT SIDE ROLE ...
    raise AssertionError("unreachable")


@dataclass
class Event:
    """One ``data:`` payload of a stream as the client read it, with its arrival time
    (``time.monotonic()``)."""

    at: float
    data: str

    def json(self) -> dict[str, Any] | None:
        """The payload decoded, or None for ``[DONE]``."""
        if self.data == "[DONE]":
            return None
        value: dict[str, Any] = json.loads(self.data)
        return value


class SSE:
    """A streamed POST read event by event, as a client reads it (``events()``); every read
    bounded by ``timeout`` and the stream by ``MAX_EVENTS``. ``cut`` says how the body
    ended when it did not end cleanly (a reset, an incomplete chunked body)."""

    MAX_EVENTS = 10_000

    def __init__(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str] | None = None,
        timeout: float = HANDOFF_S,
    ) -> None:
        host, port = url.split("//", 1)[1].split(":")
        self.conn = HTTPConnection(host, int(port), timeout=timeout)
        self.conn.request(
            "POST",
            path,
            json.dumps(body),
            {"Content-Type": "application/json", **(headers or {})},
        )
        self.response = self.conn.getresponse()
        self.cut: str | None = None

    def events(self) -> Iterator[Event]:
        # read1, not readline: http.client's readline takes a chunked body that stops
        # without its last chunk for a clean end, read1 raises IncompleteRead
        buffered, count = b"", 0
        try:
            while count < self.MAX_EVENTS:
                data = self.response.read1(65536)
                if not data:
                    return
                buffered += data
                *lines, buffered = buffered.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: "):
                        count += 1
                        yield Event(time.monotonic(), line[6:].decode().strip())
        except (HTTPException, OSError) as e:
            self.cut = f"{type(e).__name__}: {e!r}"

    def close(self) -> None:
        self.conn.close()


def journal_line(journal: Path, request_id: str, budget_s: float = 10.0) -> dict[str, Any]:
    """The journal's line for one request (its writer thread may lag a little)."""
    deadline = time.monotonic() + budget_s
    while True:
        if journal.exists():
            for raw in journal.read_text().splitlines():
                line: dict[str, Any] = json.loads(raw)
                if line.get("request_id") == request_id:
                    return line
        if time.monotonic() > deadline:
            pytest.fail(f"no journal line for {request_id} in {journal} within {budget_s:.0f}s")
        time.sleep(0.1)  # bounded by budget_s


def _start_engines(vllm: Path, logs: Path, started: list[Process]) -> tuple[Engine, Engine]:
    """Both engines up and healthy; on a port clash, both again on fresh ports (twice at most)."""
    for attempt in (1, 2):
        suffix = "" if attempt == 1 else f"-{attempt}"
        producer = _engine(vllm, logs, "producer" + suffix, "kv_producer")
        consumer = _engine(vllm, logs, "consumer" + suffix, "kv_consumer")
        pair = [producer, consumer]
        for p in pair:  # both load at once: the start-up is mostly waiting
            p.start()
            started.append(p)
        try:
            producer.wait_until(producer.url + "/health", START_S)
            consumer.wait_until(consumer.url + "/health", START_S)
            return producer, consumer
        except PortClash as clash:
            if attempt == 2:
                pytest.fail(str(clash))
            print(f"\n{clash}\nstarting both engines again on fresh ports")
            for p in pair:
                p.stop()
                started.remove(p)
    raise AssertionError("unreachable")


FLEET = """\
model = "{model}"

[[engines]]
id = "p0"
url = "{producer}"
role = "prefill"

[[engines]]
id = "d0"
url = "{consumer}"
role = "decode"

[serving]
request_timeout_s = 300.0
prefill_timeout_s = 120.0
max_attempts = 1

[engine]
kv_lease_s = {lease}
first_token_timeout_s = 120.0
decode_read_timeout_s = 60.0
connect_timeout_s = 5.0
health_timeout_s = 10.0
max_connections = 16

[recovery]
eject_after = 2
readmit_interval_s = 3.0
"""


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    vllm = _vllm_dir()
    logs = Path(os.environ.get("NARWHAL_E2E_LOGS", "") or tmp_path_factory.mktemp("logs"))
    logs.mkdir(parents=True, exist_ok=True)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    started: list[Process] = []
    try:
        producer, consumer = _start_engines(vllm, logs, started)
        config = logs / "fleet.toml"
        config.write_text(
            FLEET.format(
                model=MODEL, producer=producer.url, consumer=consumer.url, lease=KV_LEASE_S
            )
        )
        port = free_port()
        argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(config)]
        router = Process("router", [*argv, "--port", str(port)], logs / "router.log")
        router.start()
        started.append(router)
        url = f"http://127.0.0.1:{port}"
        router.wait_until(url + "/ready", 60)
        yield Fleet(producer, consumer, router, url, config, logs)
    finally:
        for p in reversed(started):
            p.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        print(f"\nlogs of the engines and the router: {logs}")
