"""Logging: one structured line per finished request, engine events, never a secret.

``--log-format json`` writes one JSON object per line (``ts``, ``level``, ``logger``,
``msg`` and the record's fields); ``text`` writes ``key=value`` pairs after the message.
Request lines carry exactly the journal's fields. Nothing here ever sees a header or a
body, so API keys (client or engine) cannot reach a log.

Values may come from clients (a model name, a message quoting one), so one record is
always one line: the text format writes every control character (C0, DEL, C1) and the
Unicode line separators in the message and in every field as Python writes them in a
repr (backslash-n, backslash-x1b, backslash-x85...); JSON escapes C0 itself, and DEL, C1
and the line separators are written as backslash-u escapes too, so no terminal escape or
line break ever reaches the output raw. Only a traceback the logger appends (ours) spans
lines.

Lines are written by one thread from a bounded queue (``configure``): a stderr that blocks
costs log lines (``narwhal_log_dropped_total``), never the event loop.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from functools import partial
from typing import Any, Literal, TextIO

import msgspec

from narwhal.lowlevel.line_writer import LineWriter

LogFormat = Literal["text", "json"]
QUEUE_RECORDS = 4096  # log lines waiting for the writer; past this they are dropped, counted
STOP_BOUND_S = 2.0  # at exit the writer gets this long to write what is queued
_writer: LineWriter[str] | None = None
_dropped = 0  # log lines dropped since start
_on_drop: Callable[[int], object] | None = None
_drop_lock = threading.Lock()
MAX_VALUE_CHARS = 512  # a logged string's most (``clip``)
requests_log = logging.getLogger("narwhal.requests")
_encode = msgspec.json.Encoder().encode
# the request a record belongs to ({"request_id", "trace_id"}), set by Router.handle while
# tracing is on; trio tasks started inside a request inherit it
log_context: ContextVar[dict[str, str] | None] = ContextVar("narwhal_log_context", default=None)

# what a client could use to forge a line or drive a terminal: C0, DEL, C1, and the
# characters str.splitlines() and some viewers also break lines on
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029]")  # C0 is escaped by msgspec


def _python_escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]  # \n, \r, \t, \x1b, \x85, \u2028


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_text(text: str) -> str:
    """``text`` with every control character and line separator written as an escape."""
    return _UNSAFE.sub(_python_escape, text)


def json_line(encoded: bytes) -> bytes:
    """msgspec's JSON with DEL, C1 and U+2028/U+2029 escaped too (only strings hold them)."""
    if encoded.isascii() and b"\x7f" not in encoded:  # DEL is ASCII, and unsafe
        return encoded
    return _JSON_UNSAFE.sub(_json_escape, encoded.decode()).encode()


def clip(value: Any) -> Any:
    """``value`` with every string longer than ``MAX_VALUE_CHARS`` cut there (and its
    length said), in lists and dicts too: a client's 20,000-character model name, quoted
    by an error message, must not make a line that several workers' writes to one stderr
    pipe interleave (a pipe write is whole only up to PIPE_BUF, 4 KiB)."""
    if isinstance(value, str):
        if len(value) <= MAX_VALUE_CHARS:
            return value
        return f"{value[:MAX_VALUE_CHARS]}...({len(value)} chars)"
    if isinstance(value, dict):
        return {k: clip(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clip(v) for v in value]
    return value


def _fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """The record's fields, after the ids of the request it was logged in (tracing on)."""
    fields = getattr(record, "fields", None)
    fields = clip(fields) if isinstance(fields, dict) else None
    context = log_context.get()
    if context is None:
        return fields
    return {**context, **fields} if fields else dict(context)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": clip(record.getMessage()),
        }
        fields = _fields(record)
        if fields:
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json_line(_encode(line)).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        text = f"{stamp} {record.levelname.lower()} {record.name}: {clip(record.getMessage())}"
        fields = _fields(record)
        if fields:
            text += " " + " ".join(
                f"{k}={_encode(v).decode() if isinstance(v, (dict, list)) else v}"
                for k, v in fields.items()
                if v is not None
            )
        text = escape_text(text)  # one record, one line, whatever a client sent
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _QueuedLines(logging.Handler):
    """Formats a record where it is logged (its request's context is there) and hands the
    line to the writer thread; a full queue drops it and counts it."""

    def __init__(self, writer: LineWriter[str]) -> None:
        super().__init__()
        self.writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        if not self.writer.put(line):
            _count_drops(1)


def _count_drops(n: int) -> None:
    global _dropped
    with _drop_lock:  # the event loop's thread and the writer's both count
        _dropped += n
    if _on_drop is not None:
        with contextlib.suppress(Exception):
            _on_drop(n)


def _write_line(stream: TextIO | None, line: str) -> None:
    """On the writer thread: a line stderr refuses (a broken pipe, a closed or absent
    stderr) is dropped and counted."""
    if stream is None:  # Python's stderr when fd 2 was closed at start (2>&-)
        _count_drops(1)
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        _count_drops(1)


def configure(fmt: LogFormat = "text", level: str = "info") -> None:
    """Log to stderr off the event loop: records are formatted where they are logged and
    written by one thread from a bounded queue, so a stderr that blocks (a pipe nobody
    reads, a paused terminal, a log shipper that fell behind) costs log lines, counted in
    ``narwhal_log_dropped_total``, never a stalled router (as the journal, contract invariant
    9). A second call replaces the first (its thread finishes what it has)."""
    global _writer
    stop()
    _writer = LineWriter(
        "narwhal-log",
        partial(_write_line, sys.stderr),
        maxsize=QUEUE_RECORDS,
        dropped=_count_drops,
    )
    handler = _QueuedLines(_writer)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("narwhal")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def stop() -> None:
    """Let the writer thread write what is queued, within ``STOP_BOUND_S`` (at exit)."""
    global _writer
    writer, _writer = _writer, None
    if writer is not None:
        writer.stop(STOP_BOUND_S)


def count_drops(counter: Callable[[int], object]) -> None:
    """Call ``counter(n)`` for every ``n`` log lines dropped, those so far included (a
    Prometheus ``Counter.inc``)."""
    global _on_drop
    _on_drop = counter
    if _dropped:
        with contextlib.suppress(Exception):
            counter(_dropped)


atexit.register(stop)


def log_request(line: Any) -> None:
    """The finished request, with the journal's fields (a JournalLine)."""
    if requests_log.isEnabledFor(logging.INFO):
        requests_log.info("request", extra={"fields": msgspec.structs.asdict(line)})


def log_event(logger: logging.Logger, level: int, message: str, fields: dict[str, Any]) -> None:
    logger.log(level, message, extra={"fields": fields})


def announce(
    text: str, fields: dict[str, Any], fmt: LogFormat = "text", level: str = "info"
) -> None:
    """A line for the operator on stderr (the router is up, a reload was refused): ``text``
    as it is in text mode, one JSON object in JSON mode, so that mode stays all JSON."""
    if fmt == "json":
        record = {"ts": round(time.time(), 3), "level": level, "logger": "narwhal", "msg": text}
        line = json_line(_encode({**record, **fields})).decode()
    else:
        line = escape_text(text)
    if _writer is None:
        print(line, file=sys.stderr, flush=True)
    elif not _writer.put(line):  # in order with the log's lines, and never blocking either
        _count_drops(1)
