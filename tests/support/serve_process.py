"""``narwhal serve`` as a process of its own in front of in-process fake engines, for tests
from the wire that need the real command line (its journal file, ``--workers N``, a
resource limit). Real clock on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine

MODEL = "fake-model"
START_BOUND_S = 60.0  # Python processes importing the router on a loaded 2-core machine
STOP_BOUND_S = 30.0
SERVING = re.compile(r"narwhal: serving \S+ on (http://127\.0\.0\.1:\d+)")


async def start_engines(
    nursery: trio.Nursery, roles: dict[str, str], **config: object
) -> dict[str, tuple[str, str]]:
    """One fake engine per ``{id: role}``, served in ``nursery``: ``{id: (url, role)}``."""
    urls = {}
    for eid, role in roles.items():
        engine = FakeEngine(FakeEngineConfig(model=MODEL, role=role, **config))  # type: ignore[arg-type]
        urls[eid] = (await nursery.start(engine.serve), role)
    return urls


def write_fleet(path: Path, engines: dict[str, tuple[str, str]], serving: str = "") -> Path:
    """A TOML fleet file for ``engines``, with ``serving`` as its ``[serving]`` lines."""
    text = f'model = "{MODEL}"\n'
    for eid, (url, role) in engines.items():
        text += f'[[engines]]\nid = "{eid}"\nurl = "{url}"\nrole = "{role}"\n'
    path.write_text(text + "[serving]\ngraceful_timeout_s = 1.0\n" + serving)
    return path


@dataclass
class Served:
    process: trio.Process
    url: str = ""
    lines: list[str] = field(default_factory=list)  # its stderr, line by line


@asynccontextmanager
async def narwhal_serve(
    *args: str, preexec_fn: Callable[[], object] | None = None
) -> AsyncIterator[Served]:
    """``narwhal serve --port 0 ARGS`` until it announces its URL; its stderr is read all
    along (a full pipe would stall it). SIGTERM at the end, and it must exit 0."""
    command = [sys.executable, "-m", "narwhal", "serve", "--port", "0", *args]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=preexec_fn
    )
    served = Served(process)
    announced = trio.Event()

    async def read_stderr() -> None:
        assert process.stderr is not None
        buffer = b""
        async for chunk in process.stderr:
            *lines, buffer = (buffer + chunk).split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                served.lines.append(text)
                if not served.url and (match := SERVING.search(text)):
                    served.url = match.group(1)
                    announced.set()
        announced.set()  # it ended without announcing: the caller's check says so

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stderr)
            with trio.fail_after(START_BOUND_S):
                await announced.wait()
            assert served.url, "narwhal serve did not start:\n" + "\n".join(served.lines)
            yield served
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
            with trio.fail_after(STOP_BOUND_S):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(5):
                await process.wait()
    assert process.returncode == 0, "\n".join(served.lines[-20:])
