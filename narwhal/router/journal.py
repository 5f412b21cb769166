"""The request journal: exactly one JSON line per finished request (contract 5, invariant 1),
and one line per engine event (ejection, probe and its outcome, readmission).

The file is written off the request path (contract 8, invariant 9): ``write`` and ``event``
encode the line and put it on a bounded queue, and one writer thread empties the queue
with one unbuffered ``write`` per line, so concurrent workers appending to one file do not
interleave. Neither ever blocks or raises: a line that finds the queue full, or that the
writer cannot write (a full disk, a pipe whose reader left, any ``OSError``), is dropped
and counted (``dropped``, and ``narwhal_journal_dropped_total`` once ``count_drops`` is
wired). A full disk or a stalled pipe therefore costs journal lines, never a request, an
admission slot or the event loop. ``reopen`` makes the writer open the path again before
its next line (logrotate's move, then SIGHUP).

A regular file holds whole lines only: a line the disk took in part (a short write, then
``ENOSPC``) is cut off again (``_append_whole``), so every line of the file parses.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from narwhal.core.records import AttemptLine, Caller, JournalLine, Outcome
from narwhal.lowlevel.line_writer import LineWriter
from narwhal.observe.logs import json_line

__all__ = ["AttemptLine", "Caller", "Journal", "JournalLine", "Outcome"]


log = logging.getLogger("narwhal.journal")
QUEUE_LINES = 4096  # lines waiting for the writer; past this they are dropped and counted
CLOSE_BOUND_S = 2.0  # close() flushes what it can within this, then gives up
WARN_EVERY_S = 60.0  # a failing journal logs its first failure, then at most this often
# O_NONBLOCK: a FIFO with no reader fails at once (ENXIO) instead of hanging the open, and
# a full pipe drops lines instead of stalling the writer; on a regular file it changes nothing
OPEN_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK


class Journal:
    """Append-only; ``path`` None keeps the lines in memory only (``lines``, bounded).

    ``keep``, ``lines``, ``events`` and ``written`` are updated synchronously by the
    caller; only the file is written by the writer thread. Opening ``path`` happens here,
    so a path that cannot be opened fails at start with the ``OSError``.
    """

    def __init__(
        self, path: str | None = None, *, keep: int = 0, queue_lines: int = QUEUE_LINES
    ) -> None:
        self.path = path
        self.keep = keep
        self.lines: list[JournalLine] = []
        self.events: list[dict[str, Any]] = []
        self.written = 0  # request lines (one per finished request); events are apart
        self.dropped = 0  # lines (requests and events) that never reached the file
        self._encode = msgspec.json.Encoder().encode
        self._lock = threading.Lock()  # dropped, the drop counter, warnings, reopen requests
        self._on_drop: Callable[[int], object] | None = None
        self._last_warning: float | None = None
        self._reopen_after: int | None = None  # reopen before the line after this many
        self._closed = False
        # the writer thread's own: the file, its lines so far, a line left in part
        self._fd = -1
        self._taken = 0
        self._torn = False
        self._regular = False
        self._writer: LineWriter[bytes] | None = None
        if path:
            # descriptor kept: the journal's file, used and closed by its writer thread alone
            self._fd = os.open(path, OPEN_FLAGS, 0o644)
            self._regular = _is_regular(self._fd)
            self._writer = LineWriter(
                "narwhal-journal",
                self._write_line,
                maxsize=queue_lines,
                dropped=self._drop,
                finish=self._close_file,
            )

    @property
    def writer_thread(self) -> threading.Thread | None:
        return None if self._writer is None else self._writer.thread

    def write(self, line: JournalLine) -> None:
        self.written += 1
        if self.keep:
            self.lines.append(line)
            del self.lines[: -self.keep]
        if self.path:
            self._put(line)

    def event(self, line: dict[str, Any]) -> None:
        """An engine event (ejection, probe, readmission): its own line, ``"event"`` first."""
        if self.keep:
            self.events.append(line)
            del self.events[: -self.keep]
        if self.path:
            self._put(line)

    def reopen(self) -> None:
        """Open the path again before the next line (after logrotate moved the file).

        Lines queued before this call still go to the file open now. If the path cannot be
        opened, the writer logs it, keeps the file it has and tries again at the next line.
        """
        with self._lock:
            self._reopen_after = 0 if self._writer is None else self._writer.queued

    def count_drops(self, counter: Callable[[int], object]) -> None:
        """Call ``counter(n)`` for every ``n`` lines dropped, those so far included (a
        Prometheus ``Counter.inc``; it may be called from the writer thread)."""
        with self._lock:
            self._on_drop = counter
            if self.dropped:
                with contextlib.suppress(Exception):
                    counter(self.dropped)

    def flush(self, timeout_s: float = CLOSE_BOUND_S) -> bool:
        """Wait (blocking: from a thread, or a test) until every line queued so far is
        written or dropped; False if that did not happen within ``timeout_s``."""
        return self._writer is None or self._writer.flush(timeout_s)

    def close(self, timeout_s: float = CLOSE_BOUND_S) -> None:
        """Write what is queued within ``timeout_s``, then stop the writer and close the
        file. Lines the writer cannot reach by then (a pipe nobody reads) are dropped."""
        self._closed = True
        writer = self._writer
        if writer is not None and not writer.stop(timeout_s):
            log.warning(
                "journal %s: not flushed within %gs at close; what is left is dropped",
                self.path,
                timeout_s,
            )

    # the caller's side

    def _put(self, line: object) -> None:
        if self._closed or self._writer is None:
            self._drop(1)
            return
        try:
            data = json_line(self._encode(line)) + b"\n"  # one line, whatever a client sent
        except Exception as exc:  # a line that cannot be encoded is ours to fix, not fatal
            self._drop(1, f"cannot encode a line: {exc!r}")
            return
        if not self._writer.put(data):
            self._drop(1, "the writer is behind (queue full)")

    def _drop(self, n: int, why: str | None = None) -> None:
        with self._lock:
            self.dropped += n
            if self._on_drop is not None:
                with contextlib.suppress(Exception):
                    self._on_drop(n)
        if why is not None:
            self._warn(f"{why}; lines are dropped and counted")

    def _warn(self, what: str) -> None:
        """Log the first failure, then at most one line per ``WARN_EVERY_S``."""
        with self._lock:
            now = time.monotonic()
            if self._last_warning is not None and now - self._last_warning < WARN_EVERY_S:
                return
            self._last_warning = now
            dropped = self.dropped
        log.warning("journal %s: %s (%d dropped so far)", self.path, what, dropped)

    # the writer thread

    def _write_line(self, data: bytes) -> None:
        self._taken += 1  # lines taken off the queue, in the order they were put
        opened = self._reopen_if_asked(self._fd, self._taken)
        if opened != self._fd:
            self._fd, self._torn, self._regular = opened, False, _is_regular(opened)
        # a line left in part (a pipe, or no cut back): this one starts on a fresh line
        full = b"\n" + data if self._torn else data
        write = _append_whole if self._regular else _write_all
        done, error = write(self._fd, full)
        if error is not None:
            self._drop(1, f"cannot write ({error})")
        if done:
            self._torn = full[done - 1] != 0x0A

    def _close_file(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _reopen_if_asked(self, fd: int, taken: int) -> int:
        with self._lock:
            after = self._reopen_after
            if after is None or taken <= after:
                return fd
            self._reopen_after = None
        assert self.path is not None
        try:
            new = os.open(self.path, OPEN_FLAGS, 0o644)
        except OSError as exc:
            with self._lock:
                if self._reopen_after is None:
                    self._reopen_after = taken  # try again before the next line
            self._warn(f"cannot reopen ({exc}); still writing the file open before")
            return fd
        with contextlib.suppress(OSError):
            os.close(fd)
        return new


def _is_regular(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False


def _write_all(fd: int, data: bytes) -> tuple[int, OSError | None]:
    """(bytes of ``data`` written, the error that stopped the writes, if one did)."""
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError as exc:
        return done, exc
    return done, None


def _append_whole(fd: int, data: bytes) -> tuple[int, OSError | None]:
    """Append ``data`` to a regular file whole or not at all: (bytes of it left in the
    file, the error that stopped the write, if one did).

    Every worker of ``--workers N`` appends to the file through its own descriptor
    (``O_APPEND``), so where this line starts is known only while nobody else appends:
    from reading the file's size to the end of the write, the writer holds an exclusive
    ``flock``, which every narwhal writer of the file takes (one line's write: microseconds,
    in the writer thread, never the event loop). A write that fails after part of the line
    went in (a full disk takes what fits, then says ``ENOSPC``) is cut off by truncating
    back to that size, and only when the file is still exactly that size plus our part: a
    writer that takes no lock (another program) may have appended after our part, and its
    bytes are never cut; our part then stays, and the next line starts on a fresh line.
    On a file system without locks nothing is cut either: a truncate there could cut
    another worker's line.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        return _write_all(fd, data)
    try:
        try:
            start = os.fstat(fd).st_size
        except OSError as exc:
            return 0, exc
        done, error = _write_all(fd, data)
        if error is not None and done and _cut_back(fd, start, start + done):
            done = 0
        return done, error
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)


def _cut_back(fd: int, start: int, end: int) -> bool:
    """Truncate the file back to ``start`` if it ends at ``end`` (nobody wrote after us)."""
    try:
        if os.fstat(fd).st_size != end:
            return False
        os.ftruncate(fd, start)
    except OSError:
        return False
    return True
