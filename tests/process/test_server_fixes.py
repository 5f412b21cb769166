"""The changes to hypercorn, h11 and trio are applied explicitly, after a check that every
function they replace or copy is the one they were written against."""

from __future__ import annotations

import pytest

from narwhal import client_connection, hypercorn_fixes, trio_accept
from narwhal.shapes import ShapeMismatch, mismatches, verify


def test_the_installed_libraries_are_the_shapes_the_fixes_know() -> None:
    known = {**client_connection.SHAPES, **hypercorn_fixes.SHAPES, **trio_accept.SHAPES}
    assert mismatches(known) == []


def test_another_shape_refuses_to_start_and_names_what_changed() -> None:
    known = {
        "hypercorn.trio.tcp_server:TCPServer.run": "0" * 16,
        "hypercorn.trio.tcp_server:TCPServer.no_such_method": "0" * 16,
    }
    with pytest.raises(ShapeMismatch) as caught:
        verify(known)
    message = str(caught.value)
    assert "TCPServer.run: source digest" in message
    assert "TCPServer.no_such_method: cannot be read" in message
    assert "pins" in message


def test_importing_the_server_changes_nothing() -> None:
    """Applying the fixes is an explicit step of serving (``install_server_fixes``)."""
    import subprocess
    import sys

    probe = (
        "import hypercorn.trio.run as w, trio, narwhal.server;"
        "from hypercorn.trio.tcp_server import TCPServer;"
        "from hypercorn.protocol.http_stream import HTTPStream;"
        "assert w.TCPServer is TCPServer;"
        "assert not getattr(HTTPStream.app_send, '_narwhal_patched', False);"
        "assert not getattr(trio.SocketListener.accept, '_narwhal_patched', False);"
        "narwhal.server.install_server_fixes();"
        "assert w.TCPServer is not TCPServer;"
        "assert getattr(trio.SocketListener.accept, '_narwhal_patched', False)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
