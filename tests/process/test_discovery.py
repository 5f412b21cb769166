"""DNS discovery (contract 2 ``[[discover]]``).

The sans-IO part (what a resolution stands for, what it changed, what a failure keeps) is
walked with hypothesis; the whole of it runs against a real DNS server: ``dnsmasq`` on a
loopback port serving the names from a hosts file, fake engines on 127.0.0.x behind them,
records added and removed while load runs, and the server stopped for a while.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpcore
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.config import (
    ConfigError,
    DiscoverBlock,
    DiscoveryConfig,
    EngineConfig,
    EngineSpec,
    FleetConfig,
    ServingConfig,
)
from narwhal.core.config_parse import parse_config
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.process.check import check_fleet
from narwhal.router.discovery import (
    RECORD_TYPES,
    Discovered,
    Resolution,
    engine_id,
    engine_specs,
    make_resolver,
    resolve,
)
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from tests.support.fleet import MODEL, finish, serve_router


def test_a_router_without_discover_blocks_does_not_load_dnspython() -> None:
    """dnspython and the HTTP client it loads for DNS over HTTPS are about 6 MiB of a
    router's resident memory: only a fleet with ``[[discover]]`` pays for them."""
    code = (
        "import sys, narwhal.process.cli, narwhal.frontdoor.server, narwhal.router.app,"
        " narwhal.process.check\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'dns', 'httpx2', 'anyio'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- sans-IO: what a resolution stands for ------------------------------------------------

BLOCK = DiscoverBlock(name="prefill", dns="p.svc", port=8000, role="prefill")
V4 = [f"10.0.0.{i}" for i in range(1, 6)]
V6 = ["fd00::1", "fd00::2", "fd00::a"]
POOL = {"A": V4, "AAAA": V6}


def test_one_engine_per_address_with_a_stable_id() -> None:
    specs = engine_specs(BLOCK, ["10.0.0.2", "fd00::1", "10.0.0.10", "10.0.0.2"])
    assert [(s.id, s.url, s.role) for s in specs] == [
        ("prefill/10.0.0.2:8000", "http://10.0.0.2:8000", "prefill"),
        ("prefill/10.0.0.10:8000", "http://10.0.0.10:8000", "prefill"),
        ("prefill/[fd00::1]:8000", "http://[fd00::1]:8000", "prefill"),
    ]
    https = msgspec.structs.replace(BLOCK, scheme="https", port=443)
    assert engine_specs(https, ["10.0.0.2"])[0].url == "https://10.0.0.2:443"


def _resolution(draw: st.DrawFn) -> Resolution:
    answers, errors = {}, {}
    for rdtype in RECORD_TYPES:
        if draw(st.booleans()):
            errors[rdtype] = draw(st.sampled_from(["timeout", "SERVFAIL", "REFUSED"]))
        else:
            answers[rdtype] = frozenset(draw(st.sets(st.sampled_from(POOL[rdtype]))))
    return Resolution(answers, errors)


resolutions = st.lists(st.composite(_resolution)(), max_size=25)


@settings(max_examples=300 * int(os.environ.get("NARWHAL_FUZZ_SCALE", "1")), deadline=None)
@given(resolutions)
def test_a_failure_keeps_the_last_good_set_and_changes_are_exact(
    script: list[Resolution],
) -> None:
    state = Discovered([BLOCK])
    last_good: dict[str, frozenset[str]] = {}  # the model: per record type
    failing = False
    for n, resolution in enumerate(script):
        before = {s.id for s in state.specs()}
        change = state.observe(BLOCK, resolution, now=float(n))
        assert change is not None
        last_good.update(resolution.answers)
        wanted = {engine_id(BLOCK, a) for addrs in last_good.values() for a in addrs}
        after = {s.id for s in state.specs()}
        assert after == wanted
        if not resolution.answers:  # a resolution that failed whole changes nothing
            assert after == before
        assert set(change.added) == after - before
        assert set(change.removed) == before - after
        assert (change.error is not None) == resolution.failed
        assert change.began_failing == (resolution.failed and not failing)
        assert change.recovered == (failing and not resolution.failed)
        failing = resolution.failed
        name = state.names["prefill"]
        assert name.failures == sum(r.failed for r in script[: n + 1])
        assert name.failing == failing
        for spec in state.specs():  # every discovered engine is a usable one
            url = urlsplit(spec.url)
            assert (url.scheme, url.port, spec.role) == ("http", 8000, "prefill")
            assert spec.id == f"prefill/{url.netloc}"


@settings(max_examples=100 * int(os.environ.get("NARWHAL_FUZZ_SCALE", "1")), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.composite(_resolution)())))
def test_names_are_apart_and_in_block_order(script: list[tuple[str, Resolution]]) -> None:
    blocks = [DiscoverBlock(name=n, dns=f"{n}.svc", port=9000 + i) for i, n in enumerate("abc")]
    state = Discovered(blocks)
    for name, resolution in script:
        block = next(b for b in blocks if b.name == name)
        state.observe(block, resolution, now=0.0)
    ids = [s.id for s in state.specs()]
    assert len(ids) == len(set(ids))
    assert [i.split("/")[0] for i in ids] == sorted(i.split("/")[0] for i in ids)
    for name in "abc":
        assert {i for i in ids if i.startswith(f"{name}/")} == {
            s.id for s in state.names[name].specs()
        }


def test_the_fleet_file_decides_what_is_kept() -> None:
    state = Discovered([BLOCK])
    state.observe(BLOCK, Resolution({"A": frozenset(V4[:2]), "AAAA": frozenset()}), now=1.0)
    assert [s.id for s in state.specs()] == ["prefill/10.0.0.1:8000", "prefill/10.0.0.2:8000"]
    # another port or role: the same addresses, engines under the new port
    moved = msgspec.structs.replace(BLOCK, port=8001, role="both")
    state.configure([moved])
    assert [(s.id, s.role) for s in state.specs()] == [
        ("prefill/10.0.0.1:8001", "both"),
        ("prefill/10.0.0.2:8001", "both"),
    ]
    # a resolution of the block as it was before the reload is not taken
    assert state.observe(BLOCK, Resolution({"A": frozenset()}), now=2.0) is not None
    renamed = msgspec.structs.replace(moved, dns="other.svc")
    assert state.observe(renamed, Resolution({"A": frozenset(V4)}), now=2.0) is None
    # another DNS name: nothing known of it yet
    state.configure([renamed])
    assert state.specs() == ()
    state.configure([])
    assert state.names == {}


def test_a_reload_keeps_the_discovered_engines_of_the_blocks_it_keeps() -> None:
    blocks = (
        DiscoverBlock(name="p", dns="p.svc", port=8000, role="prefill"),
        DiscoverBlock(name="d", dns="d.svc", port=8000, role="decode"),
    )
    config = FleetConfig(model=MODEL, discover=blocks)
    router = Router(config)
    assert router.fleet.engines == []
    for block, addresses in zip(blocks, (V4[:2], V4[2:3]), strict=True):
        router.discovery.state.observe(block, Resolution({"A": frozenset(addresses)}), now=0.0)
    change = router.apply_discovered()
    assert change["added"] == ["d/10.0.0.3:8000", "p/10.0.0.1:8000", "p/10.0.0.2:8000"]
    kept = router.fleet.by_id["p/10.0.0.1:8000"]
    assert [e.id for e in router.fleet.producers] == ["p/10.0.0.1:8000", "p/10.0.0.2:8000"]
    assert [e.id for e in router.fleet.consumers] == ["d/10.0.0.3:8000"]

    # the fleet file is read again (SIGHUP): a static engine more, the same blocks
    static = FleetConfig(
        model=MODEL,
        engines=(EngineSpec("d0", "http://10.0.1.1:8000", "decode"),),
        discover=blocks,
    )
    change = router.reload(static)
    assert (change["added"], change["removed"]) == (["d0"], [])
    assert router.fleet.by_id["p/10.0.0.1:8000"] is kept  # its state (breaker, legs) stays

    # a block dropped from the file takes its engines with it; the others stay
    change = router.reload(msgspec.structs.replace(static, discover=blocks[:1]))
    assert change["removed"] == ["d/10.0.0.3:8000"]
    assert router.fleet.by_id["p/10.0.0.1:8000"] is kept


# ---- the fleet file -----------------------------------------------------------------------


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text.encode(), fmt="toml")
    return info.value.problems


DISCOVER = (
    '[[discover]]\nname = "prefill"\ndns = "vllm-prefill.llm.svc.cluster.local"\n'
    'role = "prefill"\n'
    '[[discover]]\nname = "decode"\ndns = "vllm-decode.llm.svc.cluster.local"\n'
    'port = 8100\nrole = "decode"\nscheme = "https"\n'
)


def test_a_fleet_of_discovered_engines_only() -> None:
    fleet = parse_config(
        (
            'model = "m"\n' + DISCOVER + '[discovery]\ninterval_s = 2\nnameserver = "10.0.0.53"\n'
        ).encode(),
        fmt="toml",
    )
    assert fleet.engines == ()
    assert [(b.name, b.port, b.role, b.scheme) for b in fleet.discover] == [
        ("prefill", 8000, "prefill", "http"),
        ("decode", 8100, "decode", "https"),
    ]
    assert fleet.discovery == DiscoveryConfig(interval_s=2.0, nameserver="10.0.0.53")
    # listed and discovered together
    both = parse_config(
        b'model = "m"\n[[engines]]\nid = "p0"\nurl = "http://h:1"\nrole = "prefill"\n'
        b'[[discover]]\nname = "d"\ndns = "d.svc"\nrole = "decode"\n',
        fmt="toml",
    )
    assert [e.id for e in both.engines] == ["p0"]


def test_discovery_problems_are_named_in_one_pass() -> None:
    assert _problems(
        'model = "m"\n'
        '[[engines]]\nid = "p/10.0.0.1:80"\nurl = "http://h:1"\nrole = "decode"\n'
        '[[discover]]\nname = "p"\ndns = "10.0.0.9"\nrole = "decode"\n'
        '[[discover]]\nname = "p"\ndns = "ok.svc"\nport = 70000\nweight = 1\n'
        '[[discover]]\nname = "bad name"\ndns = "-x.svc"\nrole = "decode"\nscheme = "ftp"\n'
        '[discovery]\ninterval_s = 0\nnameserver = "dns.internal:53"\n'
    ) == [
        "discover[0].dns: must be a DNS name, got the address '10.0.0.9' (list it in [[engines]])",
        "discover[1].weight: unknown key in [discover[1]] (known: dns, name, port, role, scheme)",
        "discover[1].port: must be an integer >= 1 and <= 65535 (got 70000)",
        "discover[2].scheme: must be one of 'http', 'https' (got 'ftp')",
        "discover[2].name: must be letters, digits, '.', '_' or '-' (it starts engine ids), "
        "got 'bad name'",
        "discover[2].dns: must be a DNS name (dot-separated labels of letters, digits, '-'), "
        "got '-x.svc'",
        "discovery.interval_s: must be a number > 0 (got 0)",
        'discovery.nameserver: must be "" (the system resolver) or an IP address with an '
        'optional port ("10.0.0.2:53", "[fd00::2]:53"), got \'dns.internal:53\'',
        "discover[1].name: duplicate name 'p' (also discover[0])",
        "engines[0].id: 'p/10.0.0.1:80' is in the ids of [[discover]] 'p' (discovered "
        "engines are 'p/<ip>:<port>')",
    ]
    assert _problems(
        'model = "m"\n[[discover]]\nname = "a"\ndns = "a.svc"\nrole = "decode"\n'
        '[[discover]]\nname = "a"\ndns = "b.svc"\nrole = "decode"\n'
        '[[discover]]\nname = "c d"\ndns = "c..svc"\nrole = "decode"\n'
    ) == [
        "discover[2].name: must be letters, digits, '.', '_' or '-' (it starts engine ids), "
        "got 'c d'",
        "discover[2].dns: must be a DNS name (dot-separated labels of letters, digits, '-'), "
        "got 'c..svc'",
        "discover[1].name: duplicate name 'a' (also discover[0])",
        "discover: no engine listed or discoverable can prefill (need role 'prefill' or "
        "'both' in [[engines]] or [[discover]])",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("discover = 3\n", ["discover: must be an array of tables, got int"]),
        (
            "discover = []\n",
            ["engines: required, at least one [[engines]] entry"],
        ),
        (
            '[[discover]]\nname = "a"\n',
            ["discover[0].dns: required key is missing"],
        ),
        (
            '[[engines]]\nid = "p"\nurl = "http://h:1"\nrole = "prefill"\n'
            '[[discover]]\nname = "d"\ndns = "d.svc"\nrole = "prefill"\n',
            [
                "discover: no engine listed or discoverable can decode (need role 'decode' "
                "or 'both' in [[engines]] or [[discover]])"
            ],
        ),
    ],
)
def test_discover_blocks_are_checked(text: str, expected: list[str]) -> None:
    assert _problems('model = "m"\n' + text) == expected


@pytest.mark.parametrize(
    ("nameserver", "ok"),
    [
        ("", True),
        ("10.0.0.2", True),
        ("10.0.0.2:5353", True),
        ("[fd00::2]:53", True),
        ("fd00::2", True),
        ("10.0.0.2:0", False),
        ("10.0.0.2:x", False),
        ("[fd00::2", False),
        ("localhost", False),
    ],
)
def test_nameserver_forms(nameserver: str, ok: bool) -> None:
    text = f'model = "m"\n{DISCOVER}[discovery]\nnameserver = "{nameserver}"\n'
    if ok:
        parse_config(text.encode(), fmt="toml")
    else:
        assert _problems(text)[0].startswith("discovery.nameserver: must be")


# ---- a real DNS server: dnsmasq on a loopback port ----------------------------------------

ZONE = "narwhal.test"  # dnsmasq answers for it alone (--local): absent names are NXDOMAIN
PREFILL, DECODE = f"prefill.{ZONE}", f"decode.{ZONE}"


def _dnsmasq_binary() -> str:
    """dnsmasq, installed from Debian's dnsmasq-base when missing (CI installs it first)."""
    found = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
    if found:
        return found
    why = "dnsmasq is not installed"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "dnsmasq-base"]
        for step in (install, ["apt-get", "update", "-q"], install):
            done = subprocess.run(step, capture_output=True, text=True, env=env, check=False)
            if step is install and done.returncode == 0:
                break
            why = f"`{' '.join(step)}` failed: {done.stderr.strip()[-300:]}"
    found = shutil.which("dnsmasq") or shutil.which("dnsmasq", path="/usr/sbin:/sbin")
    if not found:
        pytest.skip(f"needs dnsmasq (Debian package dnsmasq-base) and cannot install it: {why}")
    return found


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class Dnsmasq:
    """One dnsmasq serving ``hosts`` (re-read on SIGHUP) on 127.0.0.1:``port``."""

    binary: str
    directory: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    records: dict[str, set[str]] = field(default_factory=dict)

    @property
    def hosts(self) -> Path:
        return self.directory / "hosts"

    def write(self) -> None:
        lines = [f"{ip} {name}\n" for name, ips in self.records.items() for ip in sorted(ips)]
        tmp = self.directory / "hosts.tmp"
        tmp.write_text("".join(lines))
        tmp.replace(self.hosts)

    def set(self, name: str, *ips: str) -> None:
        """The records of ``name`` become ``ips``; a running dnsmasq re-reads them."""
        self.records[name] = set(ips)
        self.write()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)

    def start(self) -> None:
        self.write()
        for _ in range(5):  # the port is picked free, and taken by the time we bind: again
            self.port = self.port or _free_udp_port()
            log = (self.directory / "dnsmasq.log").open("ab")
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--no-daemon",
                    "--conf-file=/dev/null",  # not the machine's /etc/dnsmasq.conf
                    "--no-resolv",
                    "--no-hosts",
                    f"--port={self.port}",
                    "--listen-address=127.0.0.1",
                    "--bind-interfaces",
                    f"--addn-hosts={self.hosts}",
                    f"--local=/{ZONE}/",
                    f"--user={getpass.getuser()}",  # it keeps reading our files after SIGHUP
                    f"--pid-file={self.directory / 'dnsmasq.pid'}",
                    "--log-facility=-",
                ],
                stdout=log,
                stderr=log,
            )
            log.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.3)  # it exits at once when the port is taken
            if self.proc.poll() is None:
                return
            self.proc, self.port = None, 0
        raise RuntimeError("dnsmasq did not start: " + (self.directory / "dnsmasq.log").read_text())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # by its pid: only the process this test started
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(_dnsmasq_binary(), tmp_path)
    try:
        yield server
    finally:
        server.stop()


async def _answers(server: Dnsmasq, name: str) -> frozenset[str]:
    """What the server says now, asked until it answers (it starts in milliseconds)."""
    resolver = make_resolver(DiscoveryConfig(nameserver=f"127.0.0.1:{server.port}"), 0.5)
    with trio.fail_after(10):
        while True:
            resolution = await resolve(resolver, name, 0.5)
            if not resolution.failed:
                return resolution.answers["A"]


def _shared_port(hosts: list[str]) -> int:
    """A TCP port free on every one of ``hosts`` (a [[discover]] block has one port)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port: int = probe.getsockname()[1]
        try:
            with contextlib.ExitStack() as stack:
                for host in hosts:
                    sock = stack.enter_context(socket.socket())
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclass
class Load:
    """Streaming completions from a few clients until told to stop (or a bound is hit)."""

    url: str
    sent: int = 0
    failed: list[str] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    limit: int = 5000

    async def run(self, clients: int = 4) -> None:
        pool = httpcore.AsyncConnectionPool(max_connections=clients)
        async with pool as http, trio.open_nursery() as nursery:
            for n in range(clients):
                nursery.start_soon(self._client, http, n)

    async def _client(self, http: httpcore.AsyncConnectionPool, n: int) -> None:
        while not self.done.is_set() and self.sent < self.limit:
            self.sent += 1
            body = {"model": MODEL, "prompt": f"client {n} asks {self.sent}", "max_tokens": 6}
            body["stream"] = True
            resp = await http.request(
                "POST",
                self.url + "/v1/completions",
                headers=[("content-type", "application/json")],
                content=msgspec.json.encode(body),
            )
            text = resp.content.decode()
            if resp.status != 200 or '"error"' in text or not text.endswith("data: [DONE]\n\n"):
                self.failed.append(f"{resp.status}: {text[-300:]}")


async def test_engines_follow_dns_records_under_load_and_survive_a_resolver_outage(
    nursery: trio.Nursery, dnsmasq: Dnsmasq
) -> None:
    """Records added and removed while requests run: none fails, added engines join after
    their health check, removed ones drain, and a dead DNS server changes nothing."""
    hosts = {"p1": "127.0.0.2", "p2": "127.0.0.3", "d1": "127.0.0.4", "d2": "127.0.0.5"}
    nobody = "127.0.0.6"  # a record with no engine behind it
    port = _shared_port([*hosts.values(), nobody])
    engines: dict[str, FakeEngine] = {}
    for name, host in hosts.items():
        role = "prefill" if name.startswith("p") else "decode"
        engine = FakeEngine(
            FakeEngineConfig(model=MODEL, role=role, host=host, port=port, itl_s=0.005)
        )
        await nursery.start(engine.serve)
        engines[f"{role}/{host}:{port}"] = engine
    p1, p2, d1, d2 = (
        f"{r}/{hosts[n]}:{port}"
        for n, r in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"))
    )
    dead = f"decode/{nobody}:{port}"

    dnsmasq.records = {PREFILL: {hosts["p1"]}, DECODE: {hosts["d1"]}}
    dnsmasq.start()
    assert await _answers(dnsmasq, PREFILL) == {hosts["p1"]}

    config = FleetConfig(
        model=MODEL,
        discover=(
            DiscoverBlock(name="prefill", dns=PREFILL, port=port, role="prefill"),
            DiscoverBlock(name="decode", dns=DECODE, port=port, role="decode"),
        ),
        discovery=DiscoveryConfig(interval_s=0.2, nameserver=f"127.0.0.1:{dnsmasq.port}"),
        serving=ServingConfig(graceful_timeout_s=0.5),
        engine=EngineConfig(health_interval_s=2.0),
    )
    router = Router(config, journal=Journal(keep=10_000))
    health, discovery = router.events, router.discovery
    harness = await serve_router(nursery, router, engines)
    with trio.fail_after(60):
        # the first round ran before the server started: the engines join once they answer
        await health.wait_event("joined", p1)
        await health.wait_event("joined", d1)
        assert (await harness.get("/ready")).status == 200

        load = Load(harness.url)
        async with trio.open_nursery() as traffic:
            traffic.start_soon(load.run)

            # records added: the engines join placement after a passing health check, and
            # an address that does not answer never does
            dnsmasq.set(PREFILL, hosts["p1"], hosts["p2"])
            dnsmasq.set(DECODE, hosts["d1"], hosts["d2"], nobody)
            await health.wait_event("discovery_changed", name="prefill", added=[p2])
            await health.wait_event("discovery_changed", name="decode", added=[d2, dead])
            await health.wait_event("joined", p2)
            await health.wait_event("joined", d2)
            sent_at_join = load.sent
            while engines[p2].counters["prefill"] == 0 or engines[d2].counters["completions"] == 0:
                await discovery.next_round()  # traffic reaches them
            assert load.sent > sent_at_join
            assert router.fleet.by_id[dead].checked_at is not None
            assert not router.fleet.by_id[dead].up

            # records removed: no new legs, the legs in flight finish (one slow stream at least)
            engines[d1].faults.push(Fault(kind="slow_drip", leg="decode", interval_s=0.2))
            while not engines[d1].counters["fault_slow_drip"]:
                await discovery.next_round()
            gone = {p1: router.fleet.by_id[p1], d1: router.fleet.by_id[d1]}
            dnsmasq.set(PREFILL, hosts["p2"])
            dnsmasq.set(DECODE, hosts["d2"])
            await health.wait_event("discovery_changed", name="prefill", removed=[p1])
            await health.wait_event("discovery_changed", name="decode", removed=[d1, dead])
            in_flight = {eid: state.load for eid, state in gone.items()}
            assert in_flight[d1] >= 1
            served = {eid: engines[eid].counters["completions"] for eid in gone}
            assert set(router.fleet.by_id) == {p2, d2}

            # the DNS server goes away: the last good set stays, the failures are counted
            dnsmasq.stop()
            await health.wait_event("discovery_failed", name="prefill")
            await health.wait_event("discovery_failed", name="decode")
            rounds = await discovery.next_round()
            while discovery.rounds < rounds + 2:
                await discovery.next_round()
            assert set(router.fleet.by_id) == {p2, d2}
            assert router.fleet.ready(trio.current_time())
            view = (await harness.get("/narwhal/engines")).json()
            names = view["discovery"]["names"]
            assert names["prefill"]["engines"] == [p2]
            assert names["prefill"]["failing"] is True
            assert "no answer within" in names["prefill"]["last_error"]
            metrics = (await harness.get("/metrics")).body.decode()
            failures = _sample(metrics, 'narwhal_discovery_failures_total{name="prefill"}')
            assert failures >= 3
            assert _sample(metrics, 'narwhal_discovery_engines{name="decode"}') == 1

            for eid in gone:  # no new legs since the removal: only those in flight then
                assert engines[eid].counters["completions"] - served[eid] <= in_flight[eid]

            # it comes back, with p1 again
            dnsmasq.set(PREFILL, hosts["p1"], hosts["p2"])
            dnsmasq.start()
            await health.wait_event("discovery_recovered", name="prefill")
            # (the first round added p1 too, with one engine in the set)
            await health.wait_event("discovery_changed", name="prefill", added=[p1], engines=2)
            back, served_before = router.fleet.by_id[p1], engines[p1].counters["prefill"]
            assert back is not gone[p1]  # a new engine: placeable once it answers
            while not back.up or engines[p1].counters["prefill"] == served_before:
                await discovery.next_round()
            load.done.set()

    assert load.failed == [], load.failed[:3]
    assert load.sent >= 50
    assert not [e for e in health.events if e.get("engine") == dead and e["event"] == "joined"]
    # drained: every leg the removed engines had finished, and finished well
    assert [state.load for state in gone.values()] == [0, 0]
    changes = [e for e in health.events if e["event"] == "discovery_changed"][2:]  # after start
    added = sum(len(e["added"]) for e in changes)
    removed = sum(len(e["removed"]) for e in changes)
    print(
        f"\ndiscovery run: records changed ({added} added, {removed} removed), resolver down "
        f"for {int(failures)}+ rounds, requests sent: {load.sent}, failed: {len(load.failed)}"
    )
    await finish(harness)


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not exported")


async def test_check_moves_kv_between_the_engines_dns_names(
    nursery: trio.Nursery, dnsmasq: Dnsmasq
) -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    port = _shared_port(hosts)
    for host, role in zip(hosts, ("prefill", "decode"), strict=True):
        engine = FakeEngine(FakeEngineConfig(model=MODEL, role=role, host=host, port=port))
        await nursery.start(engine.serve)
    dnsmasq.records = {PREFILL: {hosts[0]}, DECODE: {hosts[1]}}
    dnsmasq.start()
    await _answers(dnsmasq, PREFILL)
    config = FleetConfig(
        model=MODEL,
        discover=(
            DiscoverBlock(name="prefill", dns=PREFILL, port=port, role="prefill"),
            DiscoverBlock(name="decode", dns=DECODE, port=port, role="decode"),
        ),
        discovery=DiscoveryConfig(nameserver=f"127.0.0.1:{dnsmasq.port}"),
    )
    lines, ok = await check_fleet(config)
    assert ok, lines
    assert f"discover prefill (prefill, {PREFILL}:{port}): 1 engine(s)" in lines
    assert lines[-1] == "PASS: 2/2 engines ok, 1/1 transfers moved KV"
