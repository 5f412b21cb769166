"""What the private seams kept for speed save against the public way (``docs/upstream.md``).

    python bench/seams_cost.py [--rounds 5] [--seconds 0.2]

Two of ``narwhal.frontdoor.seams``'s private names are there because they measure faster
than h11's public API; each is timed both ways, in rounds that interleave the ways, and the
ratio is taken within each round (the median is printed):

- ``framing``: a streamed chunk framed for the client. Private: ``writes_chunks`` (h11's
  ``_writer`` is its chunked writer) and the chunk framed by hand, as ``DirectBody`` does.
  Public: ``h11.Connection.send(h11.Data(...))``, h11's state machine and chunked writer.
- ``reason``: a response head given its reason phrase. Private: ``with_reason``
  (``_parsed=True``: the headers as they were validated). Public: the event made again
  from its headers (``raw_items()``), which h11 validates again.

Both ways give the same bytes (checked before timing). Nothing here opens a socket.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import h11

from narwhal.frontdoor.seams import with_reason, writes_chunks

CHUNK = b"data: " + b"x" * 146 + b"\n\n"  # one SSE token event
# a streamed answer's head as hypercorn hands it to h11 (its own date and server added)
HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-request-id", b"0123456789abcdef"),
    (b"date", b"Thu, 01 Jan 2026 00:00:00 GMT"),
    (b"server", b"hypercorn-h11"),
]


def streaming_connection() -> h11.Connection:
    """A server connection in the middle of a chunked response body."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass
    conn.send(h11.Response(status_code=200, headers=HEADERS))
    return conn


def framing_private(conn: h11.Connection) -> Callable[[], object]:
    def frame() -> object:
        if conn.our_state is h11.SEND_BODY and writes_chunks(conn):
            return b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        return None

    return frame


def framing_public(conn: h11.Connection) -> Callable[[], object]:
    def frame() -> object:
        return conn.send(h11.Data(data=CHUNK))

    return frame


def reason_private(event: h11.Response) -> Callable[[], object]:
    return lambda: with_reason(event, b"OK")


def reason_public(event: h11.Response) -> Callable[[], object]:
    def again() -> object:
        return h11.Response(
            status_code=event.status_code,
            headers=event.headers.raw_items(),
            http_version=event.http_version,
            reason=b"OK",
        )

    return again


def per_call_ns(call: Callable[[], object], seconds: float) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(1000):
            call()
        calls += 1000
    return elapsed / calls * 1e9


def head_bytes(event: object) -> bytes | None:
    """The bytes h11 writes for ``event`` answering a GET."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    return conn.send(event)


def same_bytes() -> None:
    conn = streaming_connection()
    assert framing_private(conn)() == framing_public(conn)()
    head = h11.Response(status_code=200, headers=HEADERS)
    assert head_bytes(reason_private(head)()) == head_bytes(reason_public(head)())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.2, help="per way per round")
    args = parser.parse_args()
    same_bytes()
    conn, head = streaming_connection(), h11.Response(status_code=200, headers=HEADERS)
    ways = {
        "framing": (framing_private(conn), framing_public(conn)),
        "reason": (reason_private(head), reason_public(head)),
    }
    for name, (private, public) in ways.items():
        mine, theirs, ratios = [], [], []
        for _ in range(args.rounds):
            a, b = per_call_ns(private, args.seconds), per_call_ns(public, args.seconds)
            mine.append(a)
            theirs.append(b)
            ratios.append(a / b)
        print(
            f"{name}: private {statistics.median(mine):.0f} ns, public "
            f"{statistics.median(theirs):.0f} ns per call; private/public "
            f"{statistics.median(ratios):.2f}x (rounds: "
            + ", ".join(f"{r:.2f}" for r in ratios)
            + ")"
        )


if __name__ == "__main__":
    main()
