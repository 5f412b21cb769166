"""A failing journal disk or pipe never fails a request, holds a slot or blocks the loop
(contract 8, invariant 9): lines are dropped and counted instead. Real clock, no sleeps."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from narwhal.core.config import ServingConfig
from narwhal.router.journal import Journal, JournalLine
from tests.support.fleet import MODEL, finish, start_fleet


def _line(n: int, message: str | None = None) -> JournalLine:
    return JournalLine(
        request_id=f"r{n}",
        endpoint="/v1/completions",
        stream=False,
        outcome="completed",
        status=200,
        phase=None,
        message=message,
        attempts=[],
        prefill_s=0.01,
        first_byte_s=0.02,
        tokens=3,
        duration_s=0.03,
    )


def _writer(journal: Journal) -> threading.Thread:
    thread = journal.writer_thread
    assert thread is not None
    return thread


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """A named pipe and its read end (non-blocking, open so writers can open it)."""
    path = str(tmp_path / "journal.fifo")
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        yield path, reader
    finally:
        with contextlib.suppress(OSError):  # the test may have closed it already
            os.close(reader)


def test_a_full_disk_drops_and_counts_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[int] = []
    journal = Journal("/dev/full", keep=100)
    journal.count_drops(counted.append)
    with caplog.at_level(logging.WARNING, logger="narwhal.journal"):
        for n in range(50):
            journal.write(_line(n))
        journal.event({"event": "ejection", "engine": "d0"})
        journal.close()
    assert journal.written == 50
    assert len(journal.lines) == 50
    assert journal.events == [{"event": "ejection", "engine": "d0"}]
    assert journal.dropped == 51
    assert sum(counted) == 51
    warnings = [r for r in caplog.records if r.name == "narwhal.journal"]
    assert len(warnings) == 1  # the first failure, then quiet
    assert "No space left on device" in warnings[0].getMessage()
    journal.write(_line(99))  # after close: still no exception, still counted
    assert journal.dropped == 52


def test_a_pipe_whose_reader_left_drops_and_counts(fifo: tuple[str, int]) -> None:
    path, reader = fifo
    journal = Journal(path)
    os.close(reader)  # the reader goes away: every write is EPIPE
    for n in range(100):
        journal.write(_line(n))
    journal.close()
    assert journal.written == 100
    assert journal.dropped == 100


def test_a_pipe_nobody_reads_never_blocks_write_and_close_is_bounded(
    fifo: tuple[str, int],
) -> None:
    path, reader = fifo
    journal = Journal(path)
    writer = _writer(journal)
    total = 100_000
    started = time.monotonic()
    for n in range(total):
        journal.write(_line(n))
    assert time.monotonic() - started < 10.0  # microseconds each; never waits for the pipe
    assert journal.written == total
    assert journal.dropped >= total - 4096 - 64 * 1024 // 100  # queue and pipe are full
    started = time.monotonic()
    journal.close(timeout_s=0.5)
    assert time.monotonic() - started < 2.0
    # the journal opens with O_NONBLOCK: a full pipe is a dropped line, never a stuck writer;
    # what the pipe holds is still readable, and every line is in it or counted as dropped
    received = b""
    deadline = time.monotonic() + 10.0
    while True:
        assert time.monotonic() < deadline, "the writer never finished"
        if not select.select([reader], [], [], 0.1)[0]:
            continue
        try:
            chunk = os.read(reader, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            break
        received += chunk
    writer.join(5)
    assert not writer.is_alive()
    lines = received.splitlines()
    assert lines[0].startswith(b'{"request_id":"r0",')
    assert len(lines) + journal.dropped == total


def test_reopen_after_logrotate_writes_a_new_file_at_the_old_path(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    rotated = tmp_path / "journal.jsonl.1"
    journal = Journal(str(path))
    journal.write(_line(1))
    os.rename(path, rotated)  # logrotate moves the file, then sends SIGHUP
    journal.reopen()
    journal.write(_line(2))
    journal.event({"event": "probe", "engine": "d0"})
    journal.close()
    assert journal.dropped == 0
    assert rotated.read_text().count("\n") == 1
    assert '"request_id":"r1"' in rotated.read_text()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    assert '"request_id":"r2"' in lines[0]
    assert lines[1] == '{"event":"probe","engine":"d0"}'


def test_reopen_that_cannot_open_keeps_the_old_file(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    journal = Journal(str(tmp_path / "logs" / "journal.jsonl"))
    journal.write(_line(1))
    os.rename(tmp_path / "logs", tmp_path / "moved")  # the directory itself is gone
    journal.reopen()
    journal.write(_line(2))
    journal.close()
    assert journal.dropped == 0
    assert (tmp_path / "moved" / "journal.jsonl").read_text().count("\n") == 2


def test_client_line_separators_stay_inside_one_journal_line(tmp_path: Path) -> None:
    """A client-supplied line separator stays inside its JSON string, one line each."""
    path = tmp_path / "journal.jsonl"
    journal = Journal(str(path))
    journal.write(_line(1, "model 'x\r\n\x1b[31m\x85\u2028y' is not served here"))
    journal.write(_line(2))
    journal.close()
    text = path.read_text()
    assert len(text.splitlines()) == 2  # splitlines also breaks on \x85 and \u2028
    for raw in ("\x1b", "\x85", "\u2028"):
        assert raw not in text


def _dropped_total(metrics: bytes) -> float:
    for line in metrics.decode().splitlines():
        if line.startswith("narwhal_journal_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("narwhal_journal_dropped_total missing")


async def test_a_router_on_a_full_disk_serves_every_request(nursery: trio.Nursery) -> None:
    harness = await start_fleet(
        nursery,
        {"p0": "prefill", "d0": "decode"},
        journal=Journal("/dev/full"),
        serving=ServingConfig(max_inflight=4, graceful_timeout_s=0.5),
    )
    router = harness.router
    assert await trio.to_thread.run_sync(router.journal.flush)
    before = await harness.get("/metrics")
    # the series exists from the start; the engines' "joined" events already hit the disk
    assert _dropped_total(before.body) == 2
    for _ in range(20):
        reply = await harness.post(
            "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        )
        assert reply.status == 200  # a leaked slot would turn these into 429s after 4
        assert reply.json()["usage"]["completion_tokens"] == 3
    for n in range(20):
        if n % 2:
            reply = await harness.get("/no/such/path")
        else:  # journalled as rejected: the journal write is on this path too
            reply = await harness.post(
                "/v1/completions", {"model": "other-model", "prompt": "hi", "max_tokens": 1}
            )
        assert reply.status == 404
    with trio.fail_after(5):
        await router.wait_drained()
    assert router.admission.admitted == 0
    assert await trio.to_thread.run_sync(router.journal.flush)  # the writer has caught up
    counted = _dropped_total((await harness.get("/metrics")).body)
    assert counted == router.journal.dropped >= 20 + 10  # every request line hit the full disk
    await finish(harness)


def test_a_fifo_nobody_has_open_fails_at_start_instead_of_hanging(tmp_path: Path) -> None:
    """A blocking open of a FIFO waits for a reader forever: ``narwhal serve`` hung at start
    with no word. The journal opens without blocking: no reader is an error at once."""
    path = str(tmp_path / "nobody.fifo")
    os.mkfifo(path)
    started = time.monotonic()
    with pytest.raises(OSError, match="No such device or address"):
        Journal(path)
    assert time.monotonic() - started < 1.0


def test_serve_names_a_journal_it_cannot_open(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('model = "m"\n[[engines]]\nid = "e0"\nurl = "http://127.0.0.1:9"\n')
    path = tmp_path / "nobody.fifo"
    os.mkfifo(path)
    for journal in (str(path), str(tmp_path / "no-such-dir" / "journal.jsonl")):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "narwhal",
                "serve",
                "--config",
                str(fleet),
                "--port",
                "0",
                "--journal",
                journal,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 4  # narwhal.process.startup.EXIT_JOURNAL
        assert done.stderr.strip().splitlines()[-1].startswith("narwhal: cannot open the journal")
        assert "Traceback" not in done.stderr
