"""The router's log goes to stderr off the event loop: a stderr nobody reads (a full pipe,
a paused terminal, a log shipper that fell behind) costs at most log lines, never a
stalled router. Run from outside: the router is a process whose stderr pipe the test
stops reading."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import httpx
import pytest

from narwhal.observe import logs
from tests.support.fleet import MODEL
from tests.support.processes import fake_fleet, running

REQUESTS = 600  # about 150 KB of request lines: the pipe (64 KiB) fills after about 200


def test_requests_are_served_while_nobody_reads_the_log(tmp_path: Path) -> None:
    with fake_fleet(tmp_path) as fleet:
        args = ["serve", "--config", str(fleet), "--port", "0", "--log-level", "info"]
        with running(*args, drain=False) as (router, url):
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
