"""Logging: one structured line per finished request, engine events, never a secret.

``--log-format json`` writes one JSON object per line (``ts``, ``level``, ``logger``,
``msg`` and the record's fields); ``text`` writes ``key=value`` pairs after the message.
Request lines carry exactly the journal's fields. Nothing here ever sees a header or a
body, so API keys (client or engine) cannot reach a log.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]
requests_log = logging.getLogger("narwhal.requests")
_encode = msgspec.json.Encoder().encode


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return _encode(line).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        text = f"{stamp} {record.levelname.lower()} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            text += " " + " ".join(
                f"{k}={_encode(v).decode() if isinstance(v, (dict, list)) else v}"
                for k, v in fields.items()
                if v is not None
            )
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
