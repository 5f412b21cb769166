"""The router's log goes to stderr off the event loop: a stderr nobody reads (a full pipe,
a paused terminal, a log shipper that fell behind) costs at most log lines, never a
stalled router. Run from outside: the router is a process whose stderr pipe the test
stops reading."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

from tests.conftest import MODEL

URL = re.compile(r"(http://127\.0\.0\.1:\d+)")
REQUESTS = 600  # about 150 KB of request lines: the pipe (64 KiB) fills after about 200


def _read_url(stream: IO[str]) -> str:
    for line in stream:  # bounded by the process: it announces its URL, or exits (EOF)
        if match := URL.search(line):
            return match.group(1)
    raise AssertionError("the process ended without announcing its URL")


@contextmanager
def _started(args: list[str], *, drain: bool) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``narwhal ARGS``; its URL. ``drain``: keep reading its stderr (else the pipe is left
    unread after the URL)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    drainer = threading.Thread(target=proc.stderr.read, daemon=True)  # to EOF: the exit
    try:
        url = _read_url(proc.stderr)
        if drain:
            drainer.start()
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if drainer.is_alive():
            drainer.join(timeout=10)
        proc.stderr.close()


def test_requests_are_served_while_nobody_reads_the_log(tmp_path: Path) -> None:
    with (
        _started(["fake-engine", "--port", "0", "--role", "prefill"], drain=True) as (_, p),
        _started(["fake-engine", "--port", "0", "--role", "decode"], drain=True) as (_, d),
    ):
        fleet = tmp_path / "fleet.toml"
        fleet.write_text(
            f'model = "{MODEL}"\n'
            f'[[engines]]\nid = "p0"\nurl = "{p}"\nrole = "prefill"\n'
            f'[[engines]]\nid = "d0"\nurl = "{d}"\nrole = "decode"\n'
        )
        args = ["serve", "--config", str(fleet), "--port", "0", "--log-level", "info"]
        with _started(args, drain=False) as (router, url):
            body = {"model": MODEL, "prompt": "a line of log each", "max_tokens": 2}
            with httpx.Client(base_url=url, timeout=10.0) as client:
                statuses = [
                    client.post("/v1/completions", json=body).status_code for _ in range(REQUESTS)
                ]
                metrics = client.get("/metrics").text
            assert statuses == [200] * REQUESTS
            # the queue held what the pipe could not: nothing was dropped, and it comes out
            assert "narwhal_log_dropped_total 0.0" in metrics
            router.send_signal(signal.SIGTERM)
            assert router.stderr is not None
            logged = router.stderr.read()  # to the end: the router exits
        assert logged.count("narwhal.requests: request ") == REQUESTS


def test_a_closed_stderr_costs_counted_lines_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started with fd 2 closed (``2>&-``), Python's stderr is None: every line is dropped
    and counted, and the writer thread lives on (it died on the first line once)."""
    import logging

    from narwhal import logs

    counted: list[int] = []
    monkeypatch.setattr(sys, "stderr", None)
    monkeypatch.setattr(logs, "_on_drop", None)
    logger = logging.getLogger("narwhal")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    try:
        logs.configure("text", "info")
        logs.count_drops(counted.append)
        counted.clear()  # the count so far is given at once: only ours are asserted
        for n in range(3):
            logging.getLogger("narwhal.test").warning("line %d", n)
        logs.stop()  # the writer has handled every queued line
        assert sum(counted) == 3
    finally:
        logs.stop()
        logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
