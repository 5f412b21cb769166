"""The fleets and the routers of bench/replay_trace.py: which engines a fleet has, and how
each router starts over them (ours with fleet-file overrides, ``--variant``; vllm-router;
Narwhal 0.7.0), each returning its process and URL."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peers import (
    BENCH_KV_LEASE_S,
    MODEL,
    Proc,
    free_port,
    launch_narwhal07,
    launch_vllm_router,
    peers_bin,
    serve_narwhal,
    wait_http,
)


@dataclass(frozen=True)
class Fleet:
    name: str
    engines: tuple[tuple[str, str], ...]  # (name, role)

    def named(self, *roles: str) -> list[str]:
        return [n for n, r in self.engines if r in roles]


FLEETS = {
    "pd": Fleet("pd", (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))),
    "both": Fleet("both", tuple((f"e{i}", "both") for i in range(4))),
}


# ---- targets ---------------------------------------------------------------------------

Start = Callable[[Fleet, dict[str, str], Path], tuple[Proc, str]]
Sections = dict[str, dict[str, str]]  # fleet-file section -> key -> TOML value

# our fleet file's settings beyond the engines, as bench/placement.py's: the peers have no
# first-token timeout, so ours must not cut what theirs would wait for
BASE: Sections = {
    "serving": {"max_inflight": "20000"},
    "engine": {
        "max_connections": "20000",
        "first_token_timeout_s": "120.0",
        "kv_lease_s": str(BENCH_KV_LEASE_S),
    },
}


def toml_value(text: str) -> str:
    """``text`` as a TOML value: itself when it parses as one, else a quoted string (so
    ``placement.policy=predicted`` works without shell-escaped quotes)."""
    try:
        tomllib.loads(f"x = {text}")
    except tomllib.TOMLDecodeError:
        return json.dumps(text)
    return text


def parse_variant(text: str) -> tuple[str, Sections]:
    """``NAME:SECTION.KEY=VALUE[;SECTION.KEY=VALUE...]`` -> (name, overrides)."""
    name, colon, rest = text.partition(":")
    if not colon or not name.strip():
        raise SystemExit(f"--variant {text!r}: NAME:SECTION.KEY=VALUE[;...]")
    out: Sections = {}
    for setting in filter(None, (s.strip() for s in rest.split(";"))):
        key, eq, value = setting.partition("=")
        section, dot, leaf = key.strip().rpartition(".")
        if not eq or not dot or not section or not leaf:
            raise SystemExit(f"--variant {text!r}: {setting!r} is not SECTION.KEY=VALUE")
        out.setdefault(section, {})[leaf] = toml_value(value.strip())
    return name.strip(), out


def fleet_toml(fleet: Fleet, urls: dict[str, str], overrides: Sections) -> str:
    engines = "".join(
        f'[[engines]]\nid = "{n}"\nurl = "{urls[n]}"\nrole = "{r}"\n' for n, r in fleet.engines
    )
    sections: Sections = {name: dict(keys) for name, keys in BASE.items()}
    for name, keys in overrides.items():
        sections.setdefault(name, {}).update(keys)
    body = "".join(
        f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
        for name, keys in sections.items()
    )
    return f'model = "{MODEL}"\n' + engines + body


def ours(name: str, overrides: Sections) -> Start:
    def start(fleet: Fleet, urls: dict[str, str], tmp: Path) -> tuple[Proc, str]:
        safe = "".join(c if c.isalnum() else "-" for c in name)
        return serve_narwhal(fleet_toml(fleet, urls, overrides), tmp, name=safe)

    return start


def _roles(fleet: Fleet, urls: dict[str, str]) -> tuple[list[str], list[str]]:
    """The peers' producer and consumer lists: an engine of both roles is on each."""
    return (
        [urls[n] for n in fleet.named("prefill", "both")],
        [urls[n] for n in fleet.named("decode", "both")],
    )


def vllm_router(policy: str) -> Start:
    """vllm-router with ``policy``: in P/D mode over a P/D fleet; over engines of both
    roles in its regular mode (it keeps one entry per URL, so an engine listed as both a
    producer and a consumer is only one of them and every request fails), each request
    whole on the engine its policy picks, as it serves engines that are not disaggregated."""

    def start(fleet: Fleet, urls: dict[str, str], tmp: Path) -> tuple[Proc, str]:
        if fleet.named("both"):
            return launch_vllm_router_regular(list(urls.values()), tmp, policy)
        return launch_vllm_router(*_roles(fleet, urls), tmp, ("--policy", policy))

    return start


def launch_vllm_router_regular(workers: list[str], tmp: Path, policy: str) -> tuple[Proc, str]:
    """vllm-router's regular mode, with bench/peers.py's ports and logging."""
    port = free_port()
    proc = Proc(
        [
            str(peers_bin("vllm-router")),
            *("--host", "127.0.0.1", "--port", str(port)),
            "--worker-urls",
            *workers,
            *("--policy", policy),
            # its default metrics port (29000) may be taken, and then it panics at start
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
            *("--log-level", "warning"),
        ],
        tmp / "vllm-router.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc)
    return proc, url


def narwhal07(fleet: Fleet, urls: dict[str, str], tmp: Path) -> tuple[Proc, str]:
    return launch_narwhal07(*_roles(fleet, urls), tmp)


def targets(variants: list[str], chosen: str | None) -> list[tuple[str, Start]]:
    out: list[tuple[str, Start]] = [("narwhal", ours("narwhal", {}))]
    merged: dict[str, Sections] = {}  # a name given twice gathers both's settings
    for text in variants:
        name, settings = parse_variant(text)
        for section, keys in settings.items():
            merged.setdefault(name, {}).setdefault(section, {}).update(keys)
    out += [(name, ours(name, settings)) for name, settings in merged.items()]
    out += [
        ("vllm-router round_robin", vllm_router("round_robin")),
        ("vllm-router cache_aware", vllm_router("cache_aware")),
        ("narwhal-0.7", narwhal07),
    ]
    if chosen:
        wanted = [c.strip() for c in chosen.split(",")]
        out = [t for t in out if t[0] in wanted]
    return out
