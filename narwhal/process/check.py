"""``narwhal check --config FILE``: preflight a fleet before it takes traffic (contract 6.3).

Reaches every engine (``/health``, ``/version``, ``/v1/models``), validates the pinned
engine contract when there is one, then moves KV across every role-permitted pair of
distinct engines (each producer to each consumer) with a real one-token prefill and a real
decode. One readable line per engine and per pair, a summary, exit status 0 only when
everything passed.
"""

from __future__ import annotations

import os

from narwhal.core.config import FleetConfig
from narwhal.engines.client import EngineClient
from narwhal.engines.probe import crossed_handoff, identity_problem, probe_prompt
from narwhal.router.discovery import resolve_once


async def check_fleet(
    fleet: FleetConfig, *, leg_timeout_s: float | None = None, lease_from: str | None = None
) -> tuple[list[str], bool]:
    """The report lines, and whether every engine and every transfer passed.
    ``lease_from``: the fleet file that sets ``engine.kv_lease_s`` (None: the default)."""
    timeout = fleet.engine.health_timeout_s
    legs = leg_timeout_s or max(fleet.engine.first_token_timeout_s, 5.0)
    # the engines are spoken to as the router speaks to them: its bearer token, its CA file
    key_env = fleet.engine.api_key_env
    client = EngineClient(
        connect_timeout_s=fleet.engine.connect_timeout_s,
        max_connections=8,
        api_key=os.environ.get(key_env) if key_env else None,
        ca_file=fleet.engine.ca_file,
    )
    lines: list[str] = []
    reachable: dict[str, bool] = {}
    engines = fleet.engines
    if fleet.discover:  # the engines DNS names now, as the router's first round finds them
        found, discovered = await resolve_once(fleet.discover, fleet.discovery)
        engines = (*engines, *found)
        lines += discovered
    try:
        for spec in engines:
            problem = await identity_problem(
                client,
                spec.url,
                model=fleet.model,
                timeout_s=timeout,
                pinned_version=fleet.engine_contract.engine_version
                if fleet.engine_contract
                else None,
            )
            reachable[spec.id] = problem is None
            lines.append(f"{spec.id} ({spec.role}, {spec.url}): " + (problem or "ok"))
        pairs = [
            (p, c)
            for p in engines
            for c in engines
            if p.can_prefill and c.can_decode and p.id != c.id
        ]
        passed = 0
        for producer, consumer in pairs:
            if not (reachable[producer.id] and reachable[consumer.id]):
                lines.append(f"{producer.id} -> {consumer.id} skipped: an engine failed its checks")
                continue
            result = await crossed_handoff(
                client,
                fleet.model,
                producer.url,
                consumer.url,
                leg_timeout_s=legs,
                prompt=probe_prompt(f"{producer.id}-{consumer.id}"),
                max_tokens=4,
            )
            if result.ok:
                passed += 1
                lines.append(
                    f"{producer.id} -> {consumer.id} moved KV, {result.tokens} tokens, "
                    f"first token {result.first_token_s or 0.0:.3f} s"
                )
            else:
                lines.append(
                    f"{producer.id} -> {consumer.id} FAILED on the {result.failed_side}: "
                    f"{result.error}"
                )
    finally:
        await client.aclose()
    engines_ok = sum(reachable.values())
    lines.append(lease_line(fleet, lease_from))
    warning = lease_warning(fleet)
    if warning:
        lines.append(warning)
    if not pairs:
        lines.append("no pair of distinct engines can move KV (need a producer and a consumer)")
    ok = engines_ok == len(engines) and passed == len(pairs) and bool(pairs)
    lines.append(
        f"{'PASS' if ok else 'FAIL'}: {engines_ok}/{len(engines)} engines ok, "
        f"{passed}/{len(pairs)} transfers moved KV"
    )
    return lines, ok


def lease_line(fleet: FleetConfig, lease_from: str | None) -> str:
    """The KV lease the router enforces and where it came from: a lease longer than the
    engines' lets stale reads through silently, so an operator should see which one holds."""
    engine = fleet.engine
    where = (
        f"set in {lease_from}"
        if lease_from is not None
        else "the default, vLLM 0.32's kv_lease_duration default; set it to your engines' "
        "value if they set theirs"
    )
    return (
        f"engine.kv_lease_s = {engine.kv_lease_s:g}s ({where}): no descriptor older than "
        f"{engine.lease_limit_s:g}s is sent to a consumer"
    )


def lease_warning(fleet: FleetConfig) -> str | None:
    """A warning when the engines' KV lease (pinned in ``[engine_contract]``) and the
    router's ``engine.kv_lease_s`` disagree: longer here, a consumer may read blocks the
    producer already freed (vLLM answers with wrong tokens, no error); shorter, handoffs
    the engines would still honour are refused. It warns, it does not fail the check."""
    contract = fleet.engine_contract
    ours = fleet.engine.kv_lease_s
    if contract is None or contract.kv_lease_s is None or contract.kv_lease_s == ours:
        return None
    theirs = contract.kv_lease_s
    risk = (
        "a consumer could read freed KV blocks (wrong tokens, no error)"
        if ours > theirs
        else "handoffs the engines would still honour are refused"
    )
    return (
        f"WARN: engine.kv_lease_s is {ours:g}s but the engines' lease "
        f"(engine_contract.kv_lease_s, VLLM_NIXL_ABORT_REQUEST_TIMEOUT) is {theirs:g}s: {risk}"
    )
