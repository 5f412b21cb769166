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
"""

from __future__ import annotations

import logging
import re
import sys
import time
from contextvars import ContextVar
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
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


def _fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """The record's fields, after the ids of the request it was logged in (tracing on)."""
    fields = getattr(record, "fields", None)
    if not isinstance(fields, dict):
        fields = None
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
            "msg": record.getMessage(),
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
        text = f"{stamp} {record.levelname.lower()} {record.name}: {record.getMessage()}"
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


def configure(fmt: LogFormat = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("narwhal")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def log_request(line: Any) -> None:
    """The finished request, with the journal's fields (a JournalLine)."""
    if requests_log.isEnabledFor(logging.INFO):
        requests_log.info("request", extra={"fields": msgspec.structs.asdict(line)})


def log_event(logger: logging.Logger, level: int, message: str, fields: dict[str, Any]) -> None:
    logger.log(level, message, extra={"fields": fields})


def announce(text: str, fields: dict[str, Any], fmt: LogFormat = "text") -> None:
    """A line for the operator on stderr (the router is up, a reload was refused): ``text``
    as it is in text mode, one JSON object in JSON mode, so that mode stays all JSON."""
    if fmt == "json":
        record = {"ts": round(time.time(), 3), "level": "info", "logger": "narwhal", "msg": text}
        line = json_line(_encode({**record, **fields})).decode()
    else:
        line = escape_text(text)
    print(line, file=sys.stderr, flush=True)
