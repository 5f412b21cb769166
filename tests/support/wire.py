"""Raw-socket helpers: what a client sends and reads off the wire."""

from __future__ import annotations

import h2.config
import h2.connection
import trio

from narwhal.stream.sse import SSEParser


async def read_answer(stream: trio.SocketStream) -> bytes:
    """One read of what the router answered; empty once the connection is gone."""
    try:
        return await stream.receive_some(65536)
    except trio.BrokenResourceError:
        return b""


def statuses(raw: bytes) -> list[int]:
    """Status codes of every response on the connection, in order."""
    out = []
    for line in raw.split(b"\r\n"):
        if line.startswith(b"HTTP/1.1 "):
            out.append(int(line.split()[1]))
    return out


def request(
    body: bytes, *headers: bytes, path: bytes = b"/v1/completions", close: bool = True
) -> bytes:
    """One request; ``close`` asks the router to close after answering (no idle wait)."""
    head = [b"POST " + path + b" HTTP/1.1", b"host: 127.0.0.1", b"content-type: application/json"]
    if close:
        head.append(b"connection: close")
    return b"\r\n".join([*head, *headers, b"", b""]) + body


async def open_stream_and_vanish(url: str, body: bytes) -> None:
    """Raw HTTP/1.1 over a socket: read until the first SSE event, then close the socket."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body
    await stream.send_all(request)
    parser = SSEParser()  # header and chunk-size lines carry no data field: ignored
    while not parser.feed(await stream.receive_some(65536)):
        pass
    await stream.aclose()


async def serve_once(nursery: trio.Nursery, parts: list[bytes], gates: list[trio.Event]) -> str:
    """A one-connection engine on loopback that answers the first request with ``parts``,
    each after the first once its gate is set, and keeps the connection open after."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    async def answer() -> None:
        async with listener, await listener.accept() as conn:
            await conn.receive_some()
            await conn.send_all(parts[0])
            for part, gate in zip(parts[1:], gates, strict=True):
                await gate.wait()
                await conn.send_all(part)
            await trio.sleep_forever()  # keep-alive: the socket stays open, never readable

    nursery.start_soon(answer)
    port = listener.socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENT = b"data: {}\n\n"
CHUNK = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)


def h2_post(content_length: int, path: str = "/v1/completions") -> h2.connection.H2Connection:
    """A prior-knowledge HTTP/2 client that has sent its preface and a POST's HEADERS
    announcing ``content_length`` bytes (the bytes wait in its ``data_to_send``)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [
        (":method", "POST"),
        (":path", path),
        (":scheme", "http"),
        (":authority", "127.0.0.1"),
        ("content-length", str(content_length)),
    ]
    conn.send_headers(1, headers)
    return conn
