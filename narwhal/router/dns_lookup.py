"""dnspython's side of discovery: a resolver on its trio backend, and one bounded
resolution of a name's A and AAAA records. Its own module so that dnspython (and the HTTP
client it loads for DNS over HTTPS, about 10 MiB in all) is imported only by a router or a
``narwhal check`` with a ``[[discover]]`` block (``narwhal.router.discovery`` imports it
when it first resolves)."""

from __future__ import annotations

import dns.asyncbackend
import dns.exception
import dns.resolver
import trio
from dns.asyncresolver import Resolver

from narwhal.config import DiscoveryConfig
from narwhal.config import nameserver_address as parse_nameserver
from narwhal.router.discovery import RECORD_TYPES, Resolution

# what making a resolver or resolving may raise besides a bug (no nameserver in resolv.conf)
RESOLVER_ERRORS = (dns.exception.DNSException, OSError, ValueError)


def make_resolver(settings: DiscoveryConfig, timeout_s: float) -> Resolver:
    """``discovery.nameserver``, or the system's (``/etc/resolv.conf``, read again on each
    round so that a change there is followed); no cache: every round asks."""
    if settings.nameserver:
        host, port = parse_nameserver(settings.nameserver)
        resolver = Resolver(configure=False)
        resolver.nameservers = [host]
        resolver.port = port
    else:
        resolver = Resolver()
    resolver.timeout = resolver.lifetime = timeout_s
    return resolver


async def resolve(resolver: Resolver, name: str, timeout_s: float) -> Resolution:
    """Both record types at once, each bounded by ``timeout_s``."""
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
            except RESOLVER_ERRORS as exc:
                errors[rdtype] = f"{type(exc).__name__}: {exc}"
            else:
                answers[rdtype] = frozenset(str(r.address) for r in answer)
            return
        errors[rdtype] = f"no answer within {timeout_s:g}s"

    async with trio.open_nursery() as nursery:
        for rdtype in RECORD_TYPES:
            nursery.start_soon(one, rdtype)
    return Resolution(answers, errors)
