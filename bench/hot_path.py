"""Per-token cost of the relay's sans-IO steps, without sockets (issue: benchmarks).

    python bench/hot_path.py [--reads 20000]

One engine read at 50 ms between tokens carries one chunk holding one SSE event; at no
delay a read carries many. For both shapes this times what the router does to a read
before it writes to the client: chunked decoding, SSE parsing, decoding each payload and
telling its kind (``kind_of``), framing. Reported in microseconds per token; compare runs
on one machine.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from narwhal.fake_engine.generation import VOCAB
from narwhal.stream.chunked import ChunkedDecoder
from narwhal.stream.events import kind_of, parse_payload
from narwhal.stream.sse import SSEParser, frame

TEMPLATE = (
    b'{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764450000,'
    b'"model":"fake-model","choices":[{"index":0,"text":%s,"logprobs":null,'
    b'"finish_reason":null,"stop_reason":null}],"usage":null}'
)


def token_events(count: int) -> list[bytes]:
    return [
        b"data: " + TEMPLATE % msgspec.json.encode(VOCAB[i % len(VOCAB)]) + b"\n\n"
        for i in range(count)
    ]


def chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)


def relay_cost(reads: list[bytes]) -> float:
    """Seconds spent on ``reads`` by the relay's sans-IO steps."""
    decoder, parser = ChunkedDecoder(), SSEParser()
    start = time.perf_counter()
    for data in reads:
        for part in decoder.feed(data):
            out = []
            for payload in parser.feed(part):
                kind_of(parse_payload(payload))
                out.append(frame(payload))
            b"".join(out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reads", type=int, default=20000)
    args = parser.parse_args()
    events = token_events(64)
    shapes = {
        "one token a read (50 ms between tokens)": [chunked([e]) for e in events],
        "16 tokens a read (no delay)": [chunked(events[i : i + 16]) for i in range(0, 64, 16)],
    }
    for name, per_stream in shapes.items():
        tokens_per_read = 64 / len(per_stream)
        rounds = max(1, args.reads // len(per_stream))
        best = min(relay_cost(per_stream * rounds) for _ in range(5))
        tokens = rounds * 64
        print(f"{name:42} {best / tokens * 1e6:6.2f} us/token ({tokens_per_read:g} tokens/read)")


if __name__ == "__main__":
    main()
