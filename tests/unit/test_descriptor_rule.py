"""No descriptor number crosses a checkpoint anywhere in ``narwhal/`` (docs/architecture.md,
"Descriptors"): read from the source by ``tests.support.descriptor_rule``, which is shown
here to find each shape that once let a read loop take another socket's bytes."""

from __future__ import annotations

import pytest

from tests.support.descriptor_rule import breaches, package_breaches
from tests.support.paths import ROOT


def test_no_descriptor_number_crosses_a_checkpoint_in_the_package() -> None:
    assert [str(b) for b in package_breaches(ROOT / "narwhal")] == []


# the shapes the rule was written against, as the front door and the engine transport had
# them: a helper handed the number, a read loop that kept it, a connection that stored it
SHAPES = {
    "handed": """
async def read_when_ready(fd, size):
    while True:
        await wait_readable(fd)
        return os.read(fd, size)
""",
    "passed": """
async def read_socket(self, socket):
    while True:
        if socket.fileno() < 0:
            break
        data = await read_when_ready(socket.fileno(), 65536)
""",
    "held": """
async def next_chunked(self, conn):
    fd = conn.socket.fileno()
    while True:
        data = await something_else()
        os.read(fd, 100)
""",
    "kept": """
class Connection:
    def __init__(self, stream):
        self.fd = self.poll_fd = stream.socket.fileno()
""",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_rule_finds_each_shape(shape: str) -> None:
    assert shape in {b.shape for b in breaches(SHAPES[shape])}


def test_a_number_taken_afresh_after_each_wait_passes() -> None:
    source = """
async def read_when_ready(sock, size):
    while True:
        await wait_readable(sock)
        fd = sock.fileno()
        if fd < 0:
            raise Closed
        return os.read(fd, size)
"""
    assert breaches(source) == []


def test_a_number_read_on_the_next_turn_of_a_loop_is_held() -> None:
    source = """
async def loop(sock):
    fd = sock.fileno()
    while True:
        os.read(fd, 1)
        await wait_readable(sock)
"""
    assert [b.shape for b in breaches(source)] == ["held"]


def test_trios_own_wait_may_take_the_number() -> None:
    """trio's wait ends at ``notify_closing``, before the number is freed."""
    source = """
async def recv(sock):
    await trio.lowlevel.wait_readable(sock.getsockopt(zmq.FD))
"""
    assert breaches(source) == []


def test_a_line_that_says_why_it_keeps_a_number_passes() -> None:
    source = """
class Entry:
    def __init__(self, fd):
        # descriptor kept: ended by before_close before any close
        self.fd = fd
"""
    assert breaches(source) == []
    assert [b.shape for b in breaches(source.replace("# descriptor kept:", "#"))] == ["kept"]
