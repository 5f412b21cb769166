"""Log injection: a client-supplied value never forges a log line nor writes a raw terminal
escape (contract 8, invariant 9). One record is one line, in text and in JSON."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from narwhal.observe.logs import JsonFormatter, TextFormatter, log_request, requests_log
from narwhal.router.journal import AttemptLine, JournalLine

FORGED = "\r\nFAKE 2026-01-01T00:00:00 info narwhal.requests: forged outcome=completed"
HOSTILE = [FORGED, "\x1b[31mred\x1b[0m", "a\x85b", "a\u2028b\u2029c", "\x00\x07\x7f\x9b", "t\tab"]
# raw: C0 (CR, LF, TAB, ESC included), DEL, C1, and the Unicode line separators
UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _record(msg: str, *args: Any, fields: dict[str, Any] | None = None) -> logging.LogRecord:
    record = logging.LogRecord("narwhal.requests", logging.INFO, __file__, 1, msg, args, None)
    if fields is not None:
        record.fields = fields
    return record


def _one_safe_line(text: str) -> None:
    assert UNSAFE.search(text) is None, repr(text)
    assert len(text.splitlines()) == 1, repr(text)


def test_text_fields_are_escaped() -> None:
    fields: dict[str, Any] = {f"f{n}": value for n, value in enumerate(HOSTILE)}
    fields["nested"] = {"model": FORGED, "list": ["\x1b[2J", "\x85"]}
    out = TextFormatter().format(_record("request", fields=fields))
    _one_safe_line(out)
    assert "f0=\\r\\nFAKE 2026" in out  # readable, as a Python repr writes it
    assert "f1=\\x1b[31mred\\x1b[0m" in out
    assert "f2=a\\x85b" in out
    assert "f3=a\\u2028b\\u2029c" in out
    assert "f4=\\x00\\x07\\x7f\\x9b" in out
    assert "f5=t\\tab" in out


def test_text_message_and_its_arguments_are_escaped() -> None:
    out = TextFormatter().format(_record("model %s is not served here" + FORGED, "x\n\x1b[31m"))
    _one_safe_line(out)
    assert "model x\\n\\x1b[31m is not served here\\r\\nFAKE" in out


def test_text_keeps_our_own_traceback_below_one_escaped_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed for %s", FORGED)
        record.exc_info = sys.exc_info()
    first, *traceback = TextFormatter().format(record).split("\n")
    _one_safe_line(first)
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: boom"


def test_json_is_one_object_per_line_with_every_value_intact() -> None:
    fields: dict[str, Any] = {f"f{n}": value for n, value in enumerate(HOSTILE)}
    fields["nested"] = {"model": FORGED, "list": ["\x1b[2J", "\x85"]}
    out = JsonFormatter().format(_record("msg %s" + FORGED, "\x1b[31m\x85", fields=fields))
    _one_safe_line(out)
    decoded = json.loads(out)
    assert decoded["msg"] == "msg \x1b[31m\x85" + FORGED
    assert {k: decoded[k] for k in fields} == fields


def test_a_request_line_with_a_hostile_message_is_one_log_line() -> None:
    line = JournalLine(
        request_id="abc",
        endpoint="/v1/completions",
        stream=False,
        outcome="rejected",
        status=404,
        phase="admission",
        message=f"model '{FORGED}\x1b[31m' is not served here",
        attempts=[AttemptLine(1, error="\x85\u2028" + FORGED)],
        prefill_s=None,
        first_byte_s=None,
        tokens=0,
        duration_s=0.0,
    )
    for formatter in (TextFormatter(), JsonFormatter()):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(formatter)
        requests_log.addHandler(handler)
        level = requests_log.level
        requests_log.setLevel(logging.INFO)
        try:
            log_request(line)
        finally:
            requests_log.removeHandler(handler)
            requests_log.setLevel(level)
        written = stream.getvalue()
        assert written.endswith("\n")
        _one_safe_line(written[:-1])


@given(st.text(), st.text())
def test_any_text_is_one_safe_line(message: str, value: str) -> None:
    record = _record("%s", message, fields={"model": value, "attempts": [{"error": value}]})
    _one_safe_line(TextFormatter().format(record))
    out = JsonFormatter().format(record)
    _one_safe_line(out)
    assert json.loads(out)["model"] == value


def test_a_huge_client_value_is_clipped_so_a_line_stays_whole_in_a_pipe() -> None:
    """Several workers write one stderr pipe, and a pipe write is whole only up to
    PIPE_BUF (4 KiB): a 20,000-character model name quoted in a message and in a field is
    cut, with its length said, and the line stays one valid object under 4 KiB."""
    huge = "m" * 20_000
    fields = {"message": f"model {huge!r} not found", "attempts": [{"error": huge}]}
    for formatter in (JsonFormatter(), TextFormatter()):
        out = formatter.format(_record("request for %s", huge, fields=fields))
        _one_safe_line(out)
        assert len(out.encode()) < 4096
        assert "(20000 chars)" in out
    decoded = json.loads(JsonFormatter().format(_record("x", fields={"message": huge})))
    assert decoded["message"].startswith("m" * 512)
