"""One writer thread behind a bounded queue: what the journal and the logs share.

The event loop never writes a file or a pipe itself (contract 8, invariant 9): a full disk, a
pipe nobody reads or a paused terminal would stall every request. It puts the line on a
bounded queue instead (``put``, which never blocks: a full queue is the caller's drop to
count), and one daemon thread writes the lines in order through the owner's ``write``,
which handles its own errors. ``stop`` gives the thread a bounded time to write what is
queued; a thread stuck in a write past that drops the rest when (if ever) it returns.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
_STOP = object()  # never a line


class LineWriter(Generic[T]):
    def __init__(
        self,
        name: str,
        write: Callable[[T], None],
        *,
        maxsize: int,
        dropped: Callable[[int], None],
        finish: Callable[[], None] = lambda: None,
    ) -> None:
        """``write``: one line, on the writer thread. ``dropped(n)``: ``n`` lines the thread
        gave up on when stopped. ``finish``: run on the thread when it ends (close a file)."""
        self._write = write
        self._dropped = dropped
        self._finish = finish
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max(1, maxsize))
        self.queued = 0  # lines put so far
        self._done = 0  # lines the thread has written (or given up on)
        self._progress = threading.Condition()  # the thread moved _done on
        self._abandoned = False  # stop() ran out of time: the thread drops what is left
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, line: T) -> bool:
        """Queue ``line`` without waiting; False when the queue is full (nothing queued)."""
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            return False
        self.queued += 1
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait (blocking: from a thread, or a test) until every line queued so far is
        written; False if that did not happen within ``timeout_s``."""
        target = self.queued
        deadline = time.monotonic() + timeout_s
        with self._progress:
            while self._done < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._progress.wait(remaining)
        return True

    def stop(self, timeout_s: float) -> bool:
        """Let the thread write what is queued within ``timeout_s``, then end it; False
        when it is still stuck in a write (it drops the rest when the write returns)."""
        if self._stopped:
            return not self.thread.is_alive()
        self._stopped, thread = True, self.thread
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        thread.join(max(0.0, deadline - time.monotonic()))
        if not thread.is_alive():
            return True
        self._abandoned = True
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_STOP)
        return False

    def _run(self) -> None:
        try:
            while (line := self._queue.get()) is not _STOP:
                if self._abandoned:
                    self._dropped(1)
                    break
                self._write(line)  # type: ignore[arg-type]  # only put() queues lines
                with self._progress:
                    self._done += 1
                    self._progress.notify_all()
        finally:
            left = 0
            while True:
                try:
                    left += self._queue.get_nowait() is not _STOP
                except queue.Empty:
                    break
            if left:
                self._dropped(left)
            self._finish()
