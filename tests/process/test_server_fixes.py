"""The front door changes nothing outside itself: serving the router leaves trio's classes
and hypercorn's module globals as they were, so other trio software in the process (a fake
engine here) runs stock; and the internals it runs against are checked at start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from narwhal.frontdoor import seams
from narwhal.frontdoor.internals_check import InternalsMismatch, mismatches, verify
from tests.support.paths import ROOT


def test_the_installed_libraries_have_the_internals_the_front_door_knows() -> None:
    assert mismatches(seams.DIGESTS, seams.PRESENT) == []


def test_other_internals_refuse_to_start_and_name_what_changed() -> None:
    known = {
        "hypercorn.trio.tcp_server:TCPServer.run": "0" * 16,
        "hypercorn.trio.tcp_server:TCPServer.no_such_method": "0" * 16,
    }
    absent = {"h11.Connection._no_such_attribute": lambda: False}
    with pytest.raises(InternalsMismatch) as caught:
        verify(known, absent)
    message = str(caught.value)
    assert "TCPServer.run: source digest" in message
    assert "TCPServer.no_such_method: cannot be read" in message
    assert "h11.Connection._no_such_attribute: not present" in message


# run in a fresh interpreter: what serving changed would otherwise leak into other tests
PROBE = """
import functools, trio, httpcore
import hypercorn.trio.run as worker, hypercorn.protocol.http_stream as hs
from hypercorn.trio.tcp_server import TCPServer
from narwhal.core.config import EngineSpec, FleetConfig
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.router.serving import serve

before = (
    trio.SocketListener.accept, trio.SocketListener.aclose, worker.TCPServer,
    hs.HTTPStream.app_send, dict(vars(worker)),
)

async def main():
    async with trio.open_nursery() as nursery:
        p = FakeEngine(FakeEngineConfig(role="prefill"))
        d = FakeEngine(FakeEngineConfig(role="decode"))
        p_url = await nursery.start(p.serve)
        d_url = await nursery.start(d.serve)
        fleet = FleetConfig(model="fake-model", engines=(
            EngineSpec(id="p0", url=p_url, role="prefill"),
            EngineSpec(id="d0", url=d_url, role="decode"),
        ))
        url = await nursery.start(functools.partial(serve, fleet, port=0))
        after = (
            trio.SocketListener.accept, trio.SocketListener.aclose, worker.TCPServer,
            hs.HTTPStream.app_send, dict(vars(worker)),
        )
        assert after == before, "serving replaced something of trio's or hypercorn's"
        assert worker.TCPServer is TCPServer
        async with httpcore.AsyncConnectionPool() as http:
            body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 3}'
            routed = await http.request("POST", url + "/v1/completions", content=body,
                                        headers=[("content-type", "application/json")])
            assert routed.status == 200, routed.content
            # the fake engine, a trio server in the same process, is served by stock trio
            # (its listener is trio's own SocketListener, its accept trio's)
            direct = await http.request("GET", d_url + "/health")
            assert direct.status == 200
        nursery.cancel_scope.cancel()
    print("ok")

trio.run(main)
"""


def test_serving_leaves_trio_and_hypercorn_as_they_were() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_every_shape_entry_is_explained_in_the_upstream_notes() -> None:
    """What the front door runs against is written up, entry by entry."""
    notes = (ROOT / "docs" / "upstream.md").read_text()
    for path in seams.DIGESTS:
        assert path.partition(":")[2] in notes, path
    for name in seams.PRESENT:
        assert name in notes, name
