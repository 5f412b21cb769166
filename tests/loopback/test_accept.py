"""The accept loop's bursts (``narwhal.frontdoor.listener.BurstListener``): every queued
client is handed out once, in order of arrival, and none is left open when the listener
closes first."""

from __future__ import annotations

import socket

import trio
import trio.testing

from narwhal.frontdoor.listener import BurstListener


def burst_listener() -> tuple[BurstListener, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    sock.setblocking(False)
    return BurstListener(sock), sock.getsockname()[1]


async def connected_clients(port: int, count: int) -> list[socket.socket]:
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    for i, client in enumerate(clients):
        client.sendall(b"%d\n" % i)
    await trio.testing.wait_all_tasks_blocked()
    return clients


async def test_a_burst_of_clients_is_each_accepted_once() -> None:
    listener, port = burst_listener()
    clients = await connected_clients(port, 10)
    seen = []
    with trio.fail_after(5):
        for _ in clients:
            stream = await listener.accept()
            seen.append(await stream.receive_some(16))
            await stream.aclose()
    assert seen == [b"%d\n" % i for i in range(10)]
    await listener.aclose()
    for client in clients:
        client.close()


async def test_clients_queued_when_the_listener_closes_are_closed() -> None:
    listener, port = burst_listener()
    clients = await connected_clients(port, 5)
    first = await listener.accept()  # takes the other four into the burst queue
    await listener.aclose()
    await first.aclose()
    for client in clients:
        client.settimeout(5)
        try:
            data = client.recv(16)
        except ConnectionResetError:  # closed with the client's bytes unread: a reset
            data = b""
        assert data == b""  # closed by the router, not left hanging
        client.close()
