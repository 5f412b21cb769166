"""Router replicas behind a real load balancer (issue "deployable", item 4; contract 9).

Two ``narwhal serve`` replicas in front of two fake engines, behind HAProxy (Debian
package) on loopback, HAProxy checking ``/ready``. Thirty-two clients, streaming and not,
run through every phase: steady, a rolling restart (each replica in turn: SIGTERM, wait for
its exit, start it again, wait until HAProxy sees it up), then one replica killed with
SIGKILL and started again. The rolling restart must lose no request; the kill loses at
most the requests that replica held. Prints the table of requests per phase.

``make e2e-lb`` installs HAProxy when it is missing and runs this file.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.lb

CLIENTS = 32
GRACE_S = 10.0  # the replicas' serving.graceful_timeout_s
URL = re.compile(r"http://127\.0\.0\.1:(\d+)")
MODEL = "fake-model"
RESULTS: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """One process of ours, its output in a log file."""

    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = GRACE_S + 10) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


def get(port: int, path: str, timeout: float = 2.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except OSError:
        return 0
    finally:
        conn.close()


def wait_until(check: Any, budget_s: float, what: str) -> None:
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:  # bounded: a process boundary, nothing to wait on
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {budget_s:g}s: {what}")


def fake_engine(logs: Path, role: str) -> tuple[Child, int]:
    port = free_port()
    child = Child(
        [
            sys.executable,
            "-m",
            "narwhal",
            "fake-engine",
            "--port",
            str(port),
            "--role",
            role,
            "--itl-s",
            "0.01",
        ],
        logs / f"engine-{role}.log",
    )
    child.start()
    wait_until(lambda: get(port, "/health") == 200, 30, f"fake {role} engine up")
    return child, port


FLEET = """\
model = "{model}"

[[engines]]
id = "p0"
url = "http://127.0.0.1:{prefill}"
role = "prefill"

[[engines]]
id = "d0"
url = "http://127.0.0.1:{decode}"
role = "decode"

[serving]
graceful_timeout_s = {grace}

[engine]
health_interval_s = 1.0
"""

HAPROXY = """\
global
    maxconn 1024
    log stdout format raw local0
defaults
    mode http
    log global
    option httplog
    option dontlog-normal
    timeout connect 2s
    timeout check 2s
    timeout client 60s
    timeout server 60s
    option http-buffer-request
    retries 3
    option redispatch 1
    # a replica that is draining answers 503 at admission, before any engine leg: safe
    # to send again; a replica gone (killed, restarting) refuses the connection
    retry-on conn-failure empty-response 503
frontend narwhal
    bind 127.0.0.1:{port}
    default_backend routers
backend routers
    balance roundrobin
    option httpchk GET /ready
    http-check expect status 200
    default-server inter 300ms fall 2 rise 2
{servers}
"""


def start_haproxy(haproxy: str, logs: Path, ports: list[int], name: str) -> tuple[Child, int]:
    """HAProxy in front of the replicas on ``ports``, up; it and its front port."""
    front = free_port()
    servers = "\n".join(f"    server r{i} 127.0.0.1:{port} check" for i, port in enumerate(ports))
    config = logs / f"{name}haproxy.cfg"
    config.write_text(HAPROXY.format(port=front, servers=servers))
    lb = Child([haproxy, "-f", str(config), "-db"], logs / f"{name}haproxy.log")
    lb.start()
    try:
        wait_until(lambda: get(front, "/ready") == 200, 30, "HAProxy up")
    except BaseException:
        lb.stop(signal.SIGTERM, timeout_s=5)
        raise
    return lb, front


@dataclass
class Phase:
    name: str
    sent: int = 0
    ok: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)


class Load:
    """CLIENTS threads sending requests through HAProxy until stopped; each request is
    counted in the phase it ended in."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.phases: list[Phase] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(CLIENTS)]

    def phase(self, name: str) -> None:
        with self.lock:
            self.phases.append(Phase(name))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def _client(self, i: int) -> None:
        n = 0
        while not self.stop.is_set() and n < 100_000:  # bounded in count and by the phases
            n += 1
            stream = (i + n) % 2 == 0
            outcome = self._one(stream, f"client {i} request {n}")
            with self.lock:  # counted in the phase it ended in: a kill cuts what is in flight
                phase = self.phases[-1]
                phase.sent += 1
                if outcome == "ok":
                    phase.ok += 1
                else:
                    phase.failed[outcome] += 1

    def _one(self, stream: bool, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(
                "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
            )
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                return f"HTTP {resp.status}"
            if stream:
                return "ok" if data.rstrip().endswith(b"data: [DONE]") else "stream cut"
            return "ok" if json.loads(data).get("choices") else "bad JSON"
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return type(exc).__name__
        finally:
            conn.close()


@pytest.fixture
def logs() -> Iterator[Path]:
    path = Path(os.environ.get("NARWHAL_LB_LOGS", "") or tempfile.mkdtemp(prefix="narwhal-lb-"))
    path.mkdir(parents=True, exist_ok=True)
    yield path
    print(f"\nlogs: {path}")


def test_a_rolling_restart_behind_haproxy_loses_no_request(logs: Path) -> None:
    haproxy = shutil.which("haproxy")
    assert haproxy, "HAProxy is not installed: run `make e2e-lb` (it installs it)"
    children: list[Child] = []
    try:
        prefill, p_port = fake_engine(logs, "prefill")
        decode, d_port = fake_engine(logs, "decode")
        children += [prefill, decode]
        fleet = logs / "fleet.toml"
        fleet.write_text(FLEET.format(model=MODEL, prefill=p_port, decode=d_port, grace=GRACE_S))
        ports = [free_port(), free_port()]
        replicas = [
            Child(
                [
                    sys.executable,
                    "-m",
                    "narwhal",
                    "serve",
                    "--config",
                    str(fleet),
                    "--port",
                    str(port),
                ],
                logs / f"router-{i}.log",
            )
            for i, port in enumerate(ports)
        ]
        for r in replicas:
            r.start()
            children.append(r)
        for port in ports:
            wait_until(lambda p=port: get(p, "/ready") == 200, 30, f"replica :{port} ready")
        lb, front = start_haproxy(haproxy, logs, ports, "")
        children.append(lb)

        load = Load(front)
        load.phase("steady")
        load.start()
        time.sleep(3)  # load runs: a phase is a span of time, not a wait for an event
        for i, (replica, port) in enumerate(zip(replicas, ports, strict=True)):
            load.phase(f"rolling restart of r{i}")
            assert replica.stop(signal.SIGTERM) == 0, f"r{i} did not exit 0 on SIGTERM"
            replica.start()
            wait_until(lambda p=port: get(p, "/ready") == 200, 30, f"r{i} ready again")
            time.sleep(1.5)  # HAProxy's rise: two checks 300 ms apart, and traffic on it
        load.phase("r0 killed (SIGKILL) and started again")
        replicas[0].stop(signal.SIGKILL)
        time.sleep(1)
        replicas[0].start()
        wait_until(lambda: get(ports[0], "/ready") == 200, 30, "r0 ready after the kill")
        time.sleep(1.5)
        load.phase("after")
        time.sleep(2)
        load.finish()
    finally:
        for child in reversed(children):
            if child.proc is not None:
                child.stop(signal.SIGTERM, timeout_s=GRACE_S + 5)

    lines = ["| phase | sent | succeeded | failed |", "|---|---|---|---|"]
    for phase in load.phases:
        failed = ", ".join(f"{k}: {v}" for k, v in phase.failed.items()) or "0"
        lines.append(f"| {phase.name} | {phase.sent} | {phase.ok} | {failed} |")
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.append(table)
    for phase in load.phases:
        assert phase.sent > 0, phase.name
        if "killed" not in phase.name:
            assert phase.ok == phase.sent, f"{phase.name}: {dict(phase.failed)}"


EVENTS_FLEET = """\
model = "{model}"

[[engines]]
id = "p0"
url = "http://127.0.0.1:{p0}"
role = "prefill"

[[engines]]
id = "d0"
url = "http://127.0.0.1:{d0}"
role = "decode"

[[engines]]
id = "d1"
url = "http://127.0.0.1:{d1}"
role = "decode"

[engine]
health_interval_s = 1.0

[admission]
queue = false

[kv_events]
mode = "subscribe"
"""
CONVERSATIONS = 5  # odd: round robin alternates each conversation's turns between replicas
TURNS = 4


def event_engine(logs: Path, name: str, role: str) -> tuple[Child, int]:
    """A fake engine publishing its prefix cache's KV events on loopback (the router reads
    where from its GET /kv_event_sources)."""
    port = free_port()
    argv = [sys.executable, "-m", "narwhal", "fake-engine", "--port", str(port), "--role", role]
    argv += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
    argv += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:0", "--prefix-cache-blocks", "512"]
    child = Child(argv, logs / f"events-{name}.log")
    child.start()
    wait_until(lambda: get(port, "/health") == 200, 30, f"fake {name} up")
    return child, port


def post(port: int, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"content-type": "application/json", "x-request-id": request_id}
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:300]
        answer: dict[str, Any] = json.loads(data)
        return answer
    finally:
        conn.close()


def live(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/narwhal/engines")
        engines = json.loads(conn.getresponse().read())["engines"]
        return all(e["kv_events"]["state"] == "live" for e in engines)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    finally:
        conn.close()


def test_each_next_turn_goes_to_the_consumer_that_holds_it_whichever_replica(
    logs: Path,
) -> None:
    """Two replicas behind HAProxy (round robin: consecutive turns land on different
    replicas), one fleet publishing KV events: every replica subscribes on its own, so a
    replica that never saw a conversation's last turn still sends the next one to the
    consumer whose events say it holds that turn."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "HAProxy is not installed: run `make e2e-lb` (it installs it)"
    children: list[Child] = []
    journals = [logs / "events-router-0.jsonl", logs / "events-router-1.jsonl"]
    try:
        ports = {}
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            child, ports[name] = event_engine(logs, name, role)
            children.append(child)
        fleet = logs / "events-fleet.toml"
        fleet.write_text(EVENTS_FLEET.format(model=MODEL, **ports))
        router_ports = [free_port(), free_port()]
        for i, port in enumerate(router_ports):
            argv = [sys.executable, "-m", "narwhal", "serve", "--config", str(fleet)]
            argv += ["--port", str(port), "--journal", str(journals[i])]
            replica = Child(argv, logs / f"events-router-{i}.log")
            replica.start()
            children.append(replica)
        for port in router_ports:
            wait_until(lambda p=port: get(p, "/ready") == 200, 30, f"replica :{port} ready")
        lb, front = start_haproxy(haproxy, logs, router_ports, "events-")
        children.append(lb)
        # a replica's stream of an engine goes live with the first batch it reads: prompt
        # every engine directly until both replicas have read each (their SUBs connect
        # in the background)
        for n in range(30):  # bounded: one prompt per engine a round
            for name in ports:
                warm = " ".join(f"warm{n}x{k}" for k in range(40))  # two full blocks
                post(ports[name], {"model": MODEL, "prompt": warm, "max_tokens": 1}, "warm")
            if all(live(port) for port in router_ports):
                break
            time.sleep(0.2)  # a process boundary: the replicas read on their own
        else:
            raise AssertionError("the replicas never read every engine's events")

        prompts = {
            c: f"conversation {c} opens with " + " ".join(f"w{c}x{k}" for k in range(60))
            for c in range(CONVERSATIONS)
        }
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                body = {"model": MODEL, "prompt": prompts[c], "max_tokens": 12}
                answer = post(front, body, f"conv{c}-turn{turn}")
                prompts[c] += answer["choices"][0]["text"] + f" and then turn {turn} asks more"
    finally:
        for child in reversed(children):
            if child.proc is not None:
                child.stop(signal.SIGTERM, timeout_s=GRACE_S + 5)

    consumers: dict[str, tuple[int, str]] = {}
    for i, journal in enumerate(journals):
        for raw in journal.read_text().splitlines():
            line = json.loads(raw)
            if line.get("request_id", "").startswith("conv"):
                consumers[line["request_id"]] = (i, line["attempts"][-1]["consumer"])
    for c in range(CONVERSATIONS):
        first = consumers[f"conv{c}-turn0"][1]
        replicas_seen = {consumers[f"conv{c}-turn{turn}"][0] for turn in range(TURNS)}
        assert replicas_seen == {0, 1}, f"conversation {c} met one replica only: {consumers}"
        for turn in range(1, TURNS):
            consumer = consumers[f"conv{c}-turn{turn}"][1]
            assert consumer == first, f"conversation {c} turn {turn} left {first}: {consumers}"
    table = [
        f"| conv{c} | "
        + " | ".join(
            f"r{consumers[f'conv{c}-turn{t}'][0]}:{consumers[f'conv{c}-turn{t}'][1]}"
            for t in range(TURNS)
        )
        + " |"
        for c in range(CONVERSATIONS)
    ]
    print("\n" + "\n".join(table))
