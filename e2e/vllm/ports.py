"""Loopback ports, a plain JSON call and a child in its own process group, for the
real-engine suite and its probes: stdlib only, so that a script run with the vLLM
environment's Python can use it too."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_handed_out: set[int] = set()
_ports = random.Random()


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, never the same one twice.

    A port the kernel hands out for ``bind(0)`` is free only until someone else takes it,
    and two engines starting at once take ephemeral ports too (their own listeners, every
    outgoing connection's local port). In CI one of those was already on the consumer's
    NIXL side-channel port when its listener started: the listener thread died with
    EADDRINUSE and the engine stayed unready. Ports below the ephemeral range are never
    handed out by the kernel on its own, so they cannot collide that way.
    """
    end = min(_ephemeral_start(), 32768)
    if end <= 20000 + 200:
        raise RuntimeError(f"the ephemeral port range starts at {end}: no room below it")
    for _ in range(200):  # bounded: the range holds thousands of ports
        port = _ports.randrange(20000, end)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in 20000-{end}")


def http(
    method: str,
    url: str,
    body: Any = None,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """One JSON request (and ``headers``); (status, body), an HTTP error status included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_in_session(
    argv: list[str], log: Path, env: dict[str, str], cwd: Path
) -> subprocess.Popen[bytes]:
    """``argv`` in its own session (vLLM forks an engine core into its group), its output
    appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
            cwd=cwd,
        )


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM to our own child's group, SIGKILL after ``grace_s``, then to whatever of the
    group outlived its leader (vLLM's engine core)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
