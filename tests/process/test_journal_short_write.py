"""A disk that fills up mid-line leaves no torn line in the journal: the file holds whole
lines only, each one JSON, and what did not fit is counted as dropped (contract 8,
invariants 1 and 9).

A full disk takes what fits of a write, then fails the next with ``ENOSPC``. The file size
limit (``RLIMIT_FSIZE``) does the same to a process, with ``EFBIG``: a write that crosses
it is cut short, the next one fails. It is set in a child process only (``narwhal serve``,
or a small script around ``Journal``), so nothing else of the test run meets it.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import httpcore
import msgspec
import trio

from tests.support.serve_process import MODEL, narwhal_serve, start_engines, write_fleet

LIMIT = 3000  # bytes the journal file may grow to: a few request lines, then one in part


def _limit_file_size() -> None:  # in the child, before exec; Python ignores SIGXFSZ
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def _lines(path: Path) -> list[dict[str, object]]:
    """Every line of the journal, parsed: a torn line fails here."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), f"the file ends mid-line: {raw[-80:]!r}"
    return [json.loads(line) for line in raw.split(b"\n")[:-1]]


# Two journals on one file stand for two workers; each writes 40 lines in turns.
WRITERS = """
import sys
from narwhal.router.journal import Journal, JournalLine

def line(w, n):
    return JournalLine(
        request_id=f"w{w}-r{n}", endpoint="/v1/completions", stream=False,
        outcome="completed", status=200, phase=None, message="x" * (n * 7 % 90),
        attempts=[], prefill_s=0.01, first_byte_s=0.02, tokens=3, duration_s=0.03,
    )

journals = [Journal(sys.argv[1]), Journal(sys.argv[1])]
for n in range(40):
    for w, journal in enumerate(journals):
        journal.write(line(w, n))
        assert journal.flush(5.0)
for journal in journals:
    journal.close()
print(sum(j.dropped for j in journals))
"""


def test_a_short_write_leaves_only_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", WRITERS, str(path)],
        preexec_fn=_limit_file_size,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    dropped = int(done.stdout.strip().splitlines()[-1])
    lines = _lines(path)
    assert 0 < len(lines) < 80
    assert len(lines) + dropped == 80  # every line is in the file or counted, once
    assert path.stat().st_size <= LIMIT
    # the lines that fit after the first cut one went in whole too (shorter ones)
    ids = [str(line["request_id"]) for line in lines]
    assert len(set(ids)) == len(ids)


async def test_a_router_whose_disk_fills_mid_line_keeps_a_journal_of_whole_lines(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    engines = await start_engines(nursery, {"p0": "prefill", "d0": "decode"})
    fleet = write_fleet(tmp_path / "fleet.toml", engines)
    path = tmp_path / "journal.jsonl"
    requests = 20
    body = msgspec.json.encode({"model": MODEL, "prompt": "hello", "max_tokens": 3})
    async with (
        narwhal_serve(
            "--config", str(fleet), "--journal", str(path), preexec_fn=_limit_file_size
        ) as served,
        httpcore.AsyncConnectionPool() as http,
    ):
        for _ in range(requests):
            reply = await http.request("POST", served.url + "/v1/completions", content=body)
            assert reply.status == 200  # a full disk never fails a request
    # stopped (SIGTERM, exit 0): the journal is flushed and closed
    lines = _lines(path)
    requests_written = [line for line in lines if "request_id" in line]
    assert 0 < len(requests_written) < requests
    assert {line["outcome"] for line in requests_written} == {"completed"}
    assert [line["event"] for line in lines if "event" in line] == ["joined", "joined"]
