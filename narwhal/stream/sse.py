"""Sans-IO server-sent-events framing: bytes in, data payloads out.

Only what an OpenAI-compatible engine sends matters: ``data:`` lines (joined with a newline
when an event has several), comments (``:`` lines, dropped), other fields (ignored). Lines
end with LF or CRLF. Any split of the same byte stream gives the same payloads.
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSEError(Exception):
    """The byte stream cannot be SSE (an event too large to be a chunk of tokens)."""


class SSEParser:
    __slots__ = ("_buf", "_data", "_size", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = b""
        self._data: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """Consume transport bytes; return the payloads of every event they complete."""
        buf = self._buf + chunk if self._buf else chunk
        events: list[bytes] = []
        start = 0
        find = buf.find
        while (end := find(b"\n", start)) >= 0:
            line = buf[start:end]
            start = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1 else b"\n".join(self._data))
                    self._data = []
                    self._size = 0
                continue
            if line.startswith(b"data:"):
                value = line[6:] if line.startswith(b"data: ") else line[5:]
                self._size += len(value)
                if self._size > self.max_event_bytes:
                    raise SSEError(f"event larger than {self.max_event_bytes} bytes")
                self._data.append(value)
            # comments (":...") and other fields (event, id, retry) carry nothing we route on
        self._buf = buf[start:]
        if len(self._buf) > self.max_event_bytes:
            raise SSEError(f"line longer than {self.max_event_bytes} bytes")
        return events

    @property
    def pending(self) -> bool:
        """True when bytes of an unfinished event are buffered."""
        return bool(self._buf or self._data)


def frame(payload: bytes) -> bytes:
    """One SSE event carrying ``payload`` (which must not contain a newline)."""
    return b"data: " + payload + b"\n\n"


DONE_FRAME = frame(DONE)


def framed_payloads(data: bytes) -> list[bytes]:
    """The payloads of bytes the router framed itself with ``frame`` (one ``data:`` line per
    event). Not a parser of what engines send: that is ``SSEParser``."""
    return [f[6:] for f in data.split(b"\n\n") if f.startswith(b"data: ")]
