"""Blue/green on one port: once a successor joined, the kernel hands it every new connection.

Without the steering program, Linux hashes each SYN onto either member of the SO_REUSEPORT group, and
a connection queued on the leaving member when it closes is reset (the rare ``Connection reset by
peer`` the CPT rollback test saw). These tests use plain sockets, so they count exactly where each
connection landed.
"""

from __future__ import annotations

import socket

from workloads.serve_http import listen_socket, steer_new_connections_to_newest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect_many(port: int, n: int) -> list[socket.socket]:
    clients = []
    for _ in range(n):
        # A new source port each time: the kernel's hash spreads these over the group's members.
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    return clients


def _queued(listener: socket.socket) -> int:
    listener.setblocking(False)
    n = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return n
        conn.close()
        n += 1


def test_without_steering_connections_spread_over_both_members():
    """The control: the hash alone puts some new connections on the old member (what the fix prevents)."""
    port = _free_port()
    old, new = listen_socket("127.0.0.1", port), listen_socket("127.0.0.1", port)
    clients = _connect_many(port, 64)
    try:
        assert _queued(old) > 0 and _queued(new) > 0
    finally:
        for c in clients + [old, new]:
            c.close()


def test_after_a_join_every_new_connection_goes_to_the_joiner_and_survives_the_old_closing():
    port = _free_port()
    old = listen_socket("127.0.0.1", port)
    new = listen_socket("127.0.0.1", port)
    assert steer_new_connections_to_newest(new)
    clients = _connect_many(port, 64)
    try:
        assert _queued(old) == 0
        assert _queued(new) == 64
        old.close()  # the group now has one member: index 1 is gone, the kernel falls back to its hash
        clients += _connect_many(port, 16)
        assert _queued(new) == 16
        # The next switch: a third server joins and steers the group to itself.
        newer = listen_socket("127.0.0.1", port)
        assert steer_new_connections_to_newest(newer)
        clients += _connect_many(port, 16)
        assert (_queued(new), _queued(newer)) == (0, 16)
        newer.close()
    finally:
        for c in clients + [new]:
            c.close()
