"""``serve --workers N`` with ``[kv_events] mode = "listen"``: the parent binds the address
the engines' publishers connect to, and hands every batch on to every worker.

ZMQ's own forwarder does it (``zmq.devices.ThreadProxy``: an XSUB socket bound where the
engines publish, an XPUB socket bound on a private IPC path that each worker's SUB
connects to; subscriptions travel up, batches down, in a thread of the parent that touches
no Python object of ours). Each worker then reads every batch, as a single router would,
and keeps its own view of the same truth.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import zmq
from zmq.devices import ThreadProxy


def start_relay(listen: str) -> str:
    """Bind ``listen`` and start forwarding; the address workers connect to."""
    directory = tempfile.mkdtemp(prefix="narwhal-kv-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    relay = f"ipc://{Path(directory) / 'events'}"
    proxy = ThreadProxy(zmq.XSUB, zmq.XPUB)  # type: ignore[no-untyped-call]
    proxy.bind_in(listen)
    proxy.bind_out(relay)
    proxy.setsockopt_out(zmq.SNDHWM, 100_000)  # a worker slow to read loses, as a SUB does
    proxy.start()
    return relay
