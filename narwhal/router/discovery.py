"""DNS discovery (contract 2, ``[[discover]]`` and ``[discovery]``): a name's A/AAAA records
are the engines of its block, as a Kubernetes headless Service, a Consul or Nomad service
or docker compose publish them.

The decisions are sans-IO (``Discovered``): which engines a resolution stands for (one per
address, id ``<name>/<ip>:<port>``), what changed against the last good set, and what a
failure keeps. A record type that answered replaces what that type had; one that failed
(timeout, SERVFAIL, REFUSED, no nameserver) keeps its last good records, and the failure
is counted. An authoritative "no such name" or "no records of this type" is an answer: the
engines it no longer names are drained, as a scale-down to zero should be.

The trio shell (``Discovery``) runs one loop in the server's background nursery: every
``discovery.interval_s`` it resolves every block at once with dnspython's resolver on its
trio backend, each resolution bounded, then applies the discovered set through the path
of a reload (``Router.apply_discovered``): an added engine joins placement only after it
answered ``/health``, a removed one gets no new legs while its in-flight legs finish.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from narwhal.core.config import DiscoverBlock, DiscoveryConfig, EngineSpec, FleetConfig
from narwhal.core.config_rules import nameserver_address as parse_nameserver
from narwhal.observe.metrics import Metrics
from narwhal.router.engine_events import EngineEvents

if TYPE_CHECKING:
    from dns.asyncresolver import Resolver

log = logging.getLogger("narwhal.discovery")
RECORD_TYPES = ("A", "AAAA")
MIN_RESOLVE_TIMEOUT_S = 0.5  # a resolution is bounded by the interval, within these
MAX_RESOLVE_TIMEOUT_S = 5.0


# ---- sans-IO ------------------------------------------------------------------------------


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def engine_id(block: DiscoverBlock, address: str) -> str:
    return f"{block.name}/{_host(address)}:{block.port}"


def engine_specs(block: DiscoverBlock, addresses: Iterable[str]) -> tuple[EngineSpec, ...]:
    """One engine per address, IPv4 before IPv6, in address order."""
    ordered = sorted({ipaddress.ip_address(a) for a in addresses}, key=lambda a: (a.version, a))
    return tuple(
        EngineSpec(
            id=engine_id(block, str(a)),
            url=f"{block.scheme}://{_host(str(a))}:{block.port}",
            role=block.role,
        )
        for a in ordered
    )


@dataclass(frozen=True)
class Resolution:
    """One resolution of one name: per record type, its addresses (an empty set when the
    name or the type has none) or why it failed."""

    answers: Mapping[str, frozenset[str]] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return bool(self.errors)


@dataclass(frozen=True)
class Change:
    """What one resolution changed for one name."""

    name: str
    added: tuple[str, ...]
    removed: tuple[str, ...]
    error: str | None  # the failure, when a record type failed (its last good set stays)
    began_failing: bool  # the first failed resolution after a clean one (or none)
    recovered: bool  # the first clean resolution after failures

    @property
    def moved(self) -> bool:
        return bool(self.added or self.removed)


class NameState:
    """One ``[[discover]]`` block: its last good records and how resolving it went."""

    def __init__(self, block: DiscoverBlock) -> None:
        self.block = block
        self.records: dict[str, frozenset[str]] = {}  # last good answer per record type
        self.resolutions = 0
        self.failures = 0  # resolutions with a failed record type, ever
        self.failing = False  # the latest resolution failed
        self.last_success: float | None = None  # wall clock of the latest clean resolution
        self.last_error: str | None = None
        self.last_error_at: float | None = None

    @property
    def addresses(self) -> frozenset[str]:
        return frozenset().union(*self.records.values())

    def specs(self) -> tuple[EngineSpec, ...]:
        return engine_specs(self.block, self.addresses)

    def view(self, now: float) -> dict[str, object]:
        def ago(at: float | None) -> float | None:
            return None if at is None else round(now - at, 3)

        b = self.block
        return {
            "dns": b.dns,
            "port": b.port,
            "role": b.role,
            "scheme": b.scheme,
            "engines": [s.id for s in self.specs()],
            "resolutions": self.resolutions,
            "failures": self.failures,
            "failing": self.failing,
            "last_success_at": self.last_success,
            "last_success_ago_s": ago(self.last_success),
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_error_ago_s": ago(self.last_error_at),
        }


class Discovered:
    """Every block's last good set; the engines they stand for, in block order."""

    def __init__(self, blocks: Iterable[DiscoverBlock] = ()) -> None:
        self.names: dict[str, NameState] = {}
        self.configure(blocks)

    def configure(self, blocks: Iterable[DiscoverBlock]) -> None:
        """Follow the fleet file: a block that is gone takes its engines with it; one that
        now names another DNS name starts empty; port, role or scheme apply to the
        addresses it has."""
        names: dict[str, NameState] = {}
        for block in blocks:
            state = self.names.get(block.name)
            if state is None or state.block.dns != block.dns:
                state = NameState(block)
            state.block = block
            names[block.name] = state
        self.names = names

    def observe(self, block: DiscoverBlock, resolution: Resolution, now: float) -> Change | None:
        """Take one resolution of ``block``; None when the block is no longer configured
        as it was resolved (a reload came in between)."""
        state = self.names.get(block.name)
        if state is None or state.block.dns != block.dns:
            return None
        before = {s.id for s in state.specs()}
        state.records.update(resolution.answers)  # a failed type keeps its last good set
        after = {s.id for s in state.specs()}
        state.resolutions += 1
        was_failing, error = state.failing, None
        if resolution.failed:
            error = "; ".join(f"{t}: {e}" for t, e in sorted(resolution.errors.items()))
            state.failures += 1
            state.last_error, state.last_error_at = error, now
        else:
            state.last_success = now
        state.failing = resolution.failed
        return Change(
            name=block.name,
            added=tuple(sorted(after - before)),
            removed=tuple(sorted(before - after)),
            error=error,
            began_failing=resolution.failed and not was_failing,
            recovered=was_failing and not resolution.failed,
        )

    def specs(self) -> tuple[EngineSpec, ...]:
        return tuple(spec for state in self.names.values() for spec in state.specs())


# ---- trio shell ---------------------------------------------------------------------------


def resolve_timeout_s(interval_s: float) -> float:
    """A resolution may take the interval, no less than 0.5 s and no more than 5 s."""
    return min(MAX_RESOLVE_TIMEOUT_S, max(MIN_RESOLVE_TIMEOUT_S, interval_s))


# dnspython (and the HTTP client it loads for DNS over HTTPS: about 6 MiB of resident
# memory in all) is imported where a name is first resolved, so that a router without a
# [[discover]] block never loads it


def make_resolver(settings: DiscoveryConfig, timeout_s: float) -> Resolver:
    """``discovery.nameserver``, or the system's (``/etc/resolv.conf``, read again on each
    round so that a change there is followed); no cache: every round asks."""
    from dns.asyncresolver import Resolver

    if settings.nameserver:
        host, port = parse_nameserver(settings.nameserver)
        resolver = Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    else:
        resolver = Resolver()
    resolver.timeout = resolver.lifetime = timeout_s
    return resolver


def resolver_or_error(settings: DiscoveryConfig, timeout_s: float) -> Resolver | str:
    """``make_resolver``, or why it could not be made (e.g. no nameserver in resolv.conf)."""
    import dns.exception

    try:
        return make_resolver(settings, timeout_s)
    except (dns.exception.DNSException, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def resolve(resolver: Resolver, name: str, timeout_s: float) -> Resolution:
    """Both record types at once, each bounded by ``timeout_s``."""
    import dns.asyncbackend
    import dns.exception
    import dns.resolver

    answers: dict[str, frozenset[str]] = {}
    errors: dict[str, str] = {}
    backend = dns.asyncbackend.get_backend("trio")

    async def one(rdtype: str) -> None:
        with trio.move_on_after(timeout_s + 0.5):  # the resolver's lifetime, and a margin
            try:
                answer = await resolver.resolve(
                    name, rdtype, search=True, lifetime=timeout_s, backend=backend
                )
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                answers[rdtype] = frozenset()  # an answer: the name has none of these
            except dns.exception.Timeout:
                errors[rdtype] = f"no answer within {timeout_s:g}s"
            except (dns.exception.DNSException, OSError, ValueError) as exc:
                errors[rdtype] = f"{type(exc).__name__}: {exc}"
            else:
                answers[rdtype] = frozenset(str(r.address) for r in answer)
            return
        errors[rdtype] = f"no answer within {timeout_s:g}s"

    async with trio.open_nursery() as nursery:
        for rdtype in RECORD_TYPES:
            nursery.start_soon(one, rdtype)
    return Resolution(answers, errors)


async def resolve_once(
    blocks: Iterable[DiscoverBlock], settings: DiscoveryConfig
) -> tuple[tuple[EngineSpec, ...], list[str]]:
    """One round, outside a server (``narwhal check``): the engines every block names now,
    and a line per block saying what it found or why it found nothing."""
    timeout_s = resolve_timeout_s(settings.interval_s)
    resolver = make_resolver(settings, timeout_s)
    specs: list[EngineSpec] = []
    lines: list[str] = []
    for block in blocks:
        resolution = await resolve(resolver, block.dns, timeout_s)
        addresses = sorted(set().union(*resolution.answers.values()))
        found = engine_specs(block, addresses)
        specs.extend(found)
        problem = "; ".join(f"{t}: {e}" for t, e in sorted(resolution.errors.items()))
        lines.append(
            f"discover {block.name} ({block.role}, {block.dns}:{block.port}): "
            f"{len(found)} engine(s)" + (f", {problem}" if problem else "")
        )
    return tuple(specs), lines


class DiscoveryHost(Protocol):
    """What discovery needs from the router (``narwhal.router.service.Router``)."""

    config: FleetConfig
    metrics: Metrics
    events: EngineEvents

    def apply_discovered(self) -> dict[str, list[str]]: ...


class Discovery:
    """The loop; ``state`` holds the last good sets (the router builds its fleet from it)."""

    def __init__(self, router: DiscoveryHost, blocks: Iterable[DiscoverBlock] = ()) -> None:
        self.router = router
        self.state = Discovered(blocks)
        self.rounds = 0
        self._round = trio.Event()

    def view(self) -> dict[str, object]:
        """The ``discovery`` block of ``/narwhal/engines``."""
        settings = self.router.config.discovery
        now = time.time()
        return {
            "interval_s": settings.interval_s,
            "nameserver": settings.nameserver or "system",
            "rounds": self.rounds,
            "names": {name: state.view(now) for name, state in self.state.names.items()},
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """One round before the server reports itself started (the engines found then have
        their first health check under way), then one every ``discovery.interval_s``."""
        await self.resolve_all()
        task_status.started()
        while True:
            await trio.sleep(self.router.config.discovery.interval_s)
            await self.resolve_all()

    async def next_round(self) -> int:
        """Wait for the next round to finish; its number (tests, operators' tooling)."""
        await self._round.wait()
        return self.rounds

    async def resolve_all(self) -> None:
        """Resolve every block at once, then apply what changed."""
        config = self.router.config
        if config.discover:
            timeout = resolve_timeout_s(config.discovery.interval_s)
            results: dict[str, Resolution] = {}
            resolver = resolver_or_error(config.discovery, timeout)
            if isinstance(resolver, str):
                failed = Resolution(errors=dict.fromkeys(RECORD_TYPES, resolver))
                results = {block.name: failed for block in config.discover}
            else:
                async with trio.open_nursery() as nursery:
                    for block in config.discover:
                        nursery.start_soon(self._resolve_into, resolver, block, timeout, results)
            self._apply(config.discover, results)
        self.rounds += 1
        self._round.set()
        self._round = trio.Event()

    @staticmethod
    async def _resolve_into(
        resolver: Resolver,
        block: DiscoverBlock,
        timeout_s: float,
        results: dict[str, Resolution],
    ) -> None:
        try:
            results[block.name] = await resolve(resolver, block.dns, timeout_s)
        except Exception as exc:  # a surprise from the resolver must not end the server
            log.exception("resolving %s (discover %r) failed", block.dns, block.name)
            error = f"{type(exc).__name__}: {exc}"
            results[block.name] = Resolution(errors=dict.fromkeys(RECORD_TYPES, error))

    def _apply(self, blocks: Iterable[DiscoverBlock], results: Mapping[str, Resolution]) -> None:
        now = time.time()
        metrics = self.router.metrics
        changes: list[Change] = []
        for block in blocks:
            change = self.state.observe(block, results[block.name], now)
            if change is None:
                continue  # a reload changed the block while it was being resolved
            changes.append(change)
            state = self.state.names[block.name]
            metrics.discovery_engines.labels(block.name).set(len(state.addresses))
            failures = metrics.discovery_failures.labels(block.name)  # 0 from the first round
            if change.error is not None:
                failures.inc()
            if state.last_success is not None:
                metrics.discovery_last_success.labels(block.name).set(state.last_success)
        if any(change.moved for change in changes):
            self.router.apply_discovered()  # a reload's path: joins after /health, drains
        event = self.router.events.record
        for change in changes:
            state = self.state.names[change.name]
            kept = len(state.addresses)
            if change.moved:
                event(
                    "discovery_changed",
                    None,
                    name=change.name,
                    dns=state.block.dns,
                    added=list(change.added),
                    removed=list(change.removed),
                    engines=kept,
                )
            if change.began_failing:  # once per outage; the metric counts every round
                event("discovery_failed", None, name=change.name, error=change.error, kept=kept)
            if change.recovered:
                event("discovery_recovered", None, name=change.name, engines=kept)
