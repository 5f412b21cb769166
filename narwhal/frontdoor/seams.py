"""Every private name of hypercorn and h11 that the front door touches, in this one module.

The rest of ``narwhal/frontdoor/`` uses these libraries through public names only, and
reaches what has no public seam through the functions and the class below: the announced
size of the request chunk being read (a 413 at once, not after the chunk's bytes), whether
h11 frames the response body in chunks (``DirectBody``'s framing), a status line given its
reason phrase without validating the headers again, and hypercorn's HTTP/1.1 protocol with
its three private hooks under names of ours. ``DIGESTS`` and ``PRESENT`` are what
``narwhal serve`` checks at start (``narwhal.frontdoor.internals_check``): the source digest
of each function or class of theirs that our code overrides, extends, reproduces or relies
on, and the presence of each private attribute or argument read here that no digest covers;
``tests/unit/test_seams.py`` checks that they name every private name this module uses.
``docs/upstream.md`` explains each entry, and why each private one has no public seam.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import h11
from h11._readers import ChunkedReader
from h11._writers import ChunkedWriter
from hypercorn.protocol.h11 import H11Protocol

DIGESTS = {
    # hypercorn's HTTP/1.1 protocol, which ours subclasses (H11Hooks, then Http11Protocol):
    # its can_read, which PipelineWatch wraps, its app, which Http11Protocol wraps to offer
    # the extensions, its h11 connection, which is ours
    "hypercorn.protocol.h11:H11Protocol.__init__": "5acca53c7d41773d",
    # the three hooks H11Hooks names: HTTP/1.1 only; a framing error answered 4xx with the
    # request id; the app's disconnect callback, told before hypercorn's http.disconnect
    "hypercorn.protocol.h11:H11Protocol._check_protocol": "aeddfcf3da9e5d85",
    "hypercorn.protocol.h11:H11Protocol._send_error_response": "41dc5295e47f10cd",
    "hypercorn.protocol.h11:H11Protocol._close_stream": "6250ae85040025b4",
    # where HTTPStream gets the protocol's app (our call_app)
    "hypercorn.protocol.h11:H11Protocol._create_stream": "7170bf28649d95f1",
    # the pipelined-request wait on can_read (and the hooks' callers), can_read set when a
    # response ends, and the keep-alive budget a shutdown spends
    "hypercorn.protocol.h11:H11Protocol._handle_events": "ef9aeffc27380262",
    "hypercorn.protocol.h11:H11Protocol._maybe_recycle": "dba7c077157520be",
    "hypercorn.protocol.h11:H11Protocol.stream_send": "c7ef437818f28b28",
    # the scope whose extensions the front door fills, and the call of the app through the
    # task group (AppTaskGroup); the checks and the framing DirectBody reproduces
    "hypercorn.protocol.http_stream:HTTPStream.handle": "5cc61571acaf1005",
    "hypercorn.protocol.http_stream:HTTPStream.app_send": "6371d58b7f58ae8d",
    "h11._writers:ChunkedWriter.send_data": "a526bf1ca03da915",
    # the chunk being read, whose announced size _bytes_in_chunk holds
    "h11._readers:ChunkedReader": "4d2629eeaaf366b6",
    # what _Http11Connection wraps to give a status line its reason phrase
    "h11._connection:Connection.send_with_data_passthrough": "cc5fc10f82964da6",
}


def _fresh_connection() -> h11.Connection:
    return h11.Connection(h11.SERVER)


def _takes_parsed(event: type[Any]) -> bool:
    return "_parsed" in inspect.signature(event).parameters


# private names read here that no digest above covers: each present as this module reads it
PRESENT: dict[str, Callable[[], bool]] = {
    "h11.Connection._reader": lambda: hasattr(_fresh_connection(), "_reader"),
    "h11.Connection._writer": lambda: hasattr(_fresh_connection(), "_writer"),
    "h11._readers.ChunkedReader._bytes_in_chunk": lambda: hasattr(
        ChunkedReader(), "_bytes_in_chunk"
    ),
    "h11.Response(_parsed)": lambda: _takes_parsed(h11.Response),
    "h11.InformationalResponse(_parsed)": lambda: _takes_parsed(h11.InformationalResponse),
}


def announced_chunk_rest(connection: h11.Connection) -> int | None:
    """The bytes of the request chunk being read that h11 has not handed out yet (as the
    chunk's size line announced them); None when the body is not chunked. h11 has no
    public way to say it."""
    reader = connection._reader
    return reader._bytes_in_chunk if type(reader) is ChunkedReader else None


def writes_chunks(connection: h11.Connection) -> bool:
    """h11 frames the body it is sending now in chunks (not a length, not up to the close,
    nothing for HEAD, 204 or 304). h11 has no public way to say it."""
    return type(connection._writer) is ChunkedWriter


def with_reason(event: Any, reason: bytes) -> Any:
    """``event`` (an ``h11.Response`` or ``h11.InformationalResponse``) with ``reason`` as
    its reason phrase. Its headers were validated when it was made: ``_parsed`` keeps them
    as they are rather than validating them again for every response (``docs/upstream.md``:
    the public way, measured)."""
    return type(event)(
        status_code=event.status_code,
        headers=event.headers,
        http_version=event.http_version,
        reason=reason,
        _parsed=True,
    )


class H11Hooks(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol with its three private hooks under names of ours; by
    default each does what hypercorn's does. ``Http11Protocol`` overrides the named ones."""

    async def _check_protocol(self, event: h11.Request) -> None:
        await self.check_request(event)

    async def _send_error_response(self, status_code: int) -> None:
        await self.answer_malformed(status_code)

    async def _close_stream(self) -> None:
        self.stream_closing()
        await super()._close_stream()

    async def check_request(self, event: h11.Request) -> None:
        """A request's head has arrived, before its stream is made (hypercorn switches to
        HTTP/2 here on an upgrade offer or a prior-knowledge preface)."""
        await super()._check_protocol(event)

    async def answer_malformed(self, status_code: int) -> None:
        """h11 found the request malformed (``status_code`` is its hint); the connection
        closes after this answer."""
        await super()._send_error_response(status_code)

    def stream_closing(self) -> None:
        """The request's stream is about to close (its response ended, or the client
        left), before the app is sent ``http.disconnect``."""
