"""narwhal's own binaries as processes: started, announced, stopped by their process id."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

URL = re.compile(r"(http://127\.0\.0\.1:\d+)")


@contextmanager
def running(*args: str, drain: bool = True) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``narwhal ARGS``, wait for the line announcing its URL; SIGTERM it at the end.
    ``drain``: keep reading its stderr (a full pipe would block it), else leave it unread."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    drainer: threading.Thread | None = None
    try:
        assert proc.stderr is not None
        url = None
        for _ in range(50):  # bounded: the announcement is among the first lines
            line = proc.stderr.readline()
            if not line:
                break
            announced = ("fake-engine", "narwhal: serving", "Running on")
            if any(a in line for a in announced) and URL.search(line):
                url = URL.search(line).group(1)  # type: ignore[union-attr]
                # keep draining: a full pipe would block the process (a log line per request)
                if drain:
                    drainer = threading.Thread(target=proc.stderr.read, daemon=True)
                    drainer.start()
                break
        assert url, f"{args[0]} did not start"
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if drainer is not None:
            drainer.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == 0, f"{args[0]} exited with {proc.returncode} on SIGTERM"


def run_narwhal(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``narwhal ARGS`` to completion (bounded), capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "narwhal", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@contextmanager
def fake_fleet(tmp_path: Path, extra: str = "") -> Iterator[Path]:
    """Two fake engines (p0 prefill, d0 decode) as processes, and a fleet file naming them."""
    with (
        running("fake-engine", "--port", "0", "--role", "prefill") as (_, p_url),
        running("fake-engine", "--port", "0", "--role", "decode") as (_, d_url),
    ):
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(
            f'model = "fake-model"\n[[engines]]\nid = "p0"\nurl = "{p_url}"\nrole = "prefill"\n'
            f'[[engines]]\nid = "d0"\nurl = "{d_url}"\nrole = "decode"\n' + extra
        )
        yield fleet
