"""Sans-IO decoder of an HTTP/1.1 chunked body (RFC 9112 section 7.1), for the data legs.

h11 parses a chunked body one chunk at a time through its general event machinery
(``bench/hot_path.py`` measures it); a decode stream is one chunk per token, so the
router spent more on framing than on the tokens. After h11 has parsed the response
head, the transport hands
the body to this decoder instead. It emits chunk data as it arrives (a chunk is never
buffered whole), bounds every line it waits for, and rejects what h11 would reject: a
size that is not plain hex, a chunk not followed by CRLF.
"""

from __future__ import annotations

import re

MAX_LINE = 4096  # a chunk-size line or a trailer line; an engine's garbage must not grow it
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

_SIZE, _DATA, _CRLF, _TRAILERS, _DONE = range(5)


class ChunkedError(Exception):
    """The peer's chunked framing is invalid."""


class ChunkedDecoder:
    __slots__ = ("_buffer", "_remaining", "_state", "leftover")

    def __init__(self) -> None:
        self._buffer = b""
        self._remaining = 0
        self._state = _SIZE
        self.leftover = b""  # bytes after the end of the body (a peer that sent too much)

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> list[bytes]:
        """The body bytes ``data`` completes, in order and none empty; raises ChunkedError
        on bad framing."""
        if self._state == _DONE:
            self.leftover += data
            return []
        buf = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos, end = 0, len(buf)
        while pos < end:
            state = self._state
            if state == _DATA:
                take = min(self._remaining, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._state = _CRLF
            elif state == _CRLF:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ChunkedError("chunk data not followed by CRLF")
                pos += 2
                self._state = _SIZE
            else:
                line_end = buf.find(b"\r\n", pos)
                if line_end < 0:
                    if end - pos > MAX_LINE:
                        raise ChunkedError(f"chunk line longer than {MAX_LINE} bytes")
                    break
                line = buf[pos:line_end]
                pos = line_end + 2
                if state == _SIZE:
                    self._size_line(line)
                elif not line:  # the empty line after the trailers: the end of the body
                    self._state = _DONE
                    self.leftover = buf[pos:]
                    pos = end
        self._buffer = buf[pos:] if self._state != _DONE else b""
        return out

    def _size_line(self, line: bytes) -> None:
        digits = line.split(b";", 1)[0].strip(b" \t")  # chunk extensions are ignored
        if not _HEX.fullmatch(digits):
            raise ChunkedError(f"bad chunk size line {line[:40]!r}")
        size = int(digits, 16)
        if size:
            self._remaining, self._state = size, _DATA
        else:
            self._state = _TRAILERS
