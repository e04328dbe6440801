"""The tests' port picker (tests/redisproc.free_port): a server is handed its port before it binds
it, so the port must not be one the kernel may meanwhile give to an outgoing connection, nor one
already handed to another server."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.redisproc import PORT_FLOOR, free_port

pytestmark = pytest.mark.timeout(30)


def test_ports_are_distinct_bindable_and_below_the_kernels_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_FLOOR <= p < low for p in ports), (low, min(ports), max(ports))
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out() -> None:
    listeners = []
    try:
        for _ in range(200):
            s = socket.socket()
            listeners.append(s)
            s.bind(("127.0.0.1", free_port()))
            s.listen()
        taken = {s.getsockname()[1] for s in listeners}
        assert not taken & {free_port() for _ in range(500)}
    finally:
        for s in listeners:
            s.close()
