"""The check a server makes of its address before it binds (llamamesh/ports.py): one line naming the
setting at fault, for a port in use and for a host that is no address to listen on."""

from __future__ import annotations

import socket

import pytest

from llamamesh.ports import check_free

pytestmark = pytest.mark.timeout(30)


def test_a_port_in_use_is_refused_naming_its_setting() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        in_use = rf"^LLAMAMESH_GATEWAY_PORT: 127\.0\.0\.1:{port} is in use; choose another port$"
        with pytest.raises(OSError, match=in_use):
            check_free("127.0.0.1", port, "LLAMAMESH_GATEWAY_PORT")
    check_free("127.0.0.1", port, "LLAMAMESH_GATEWAY_PORT")  # free again
    check_free("127.0.0.1", 0, "LLAMAMESH_GATEWAY_PORT")  # any free one: the server picks


@pytest.mark.parametrize("port", [0, 50051])
def test_a_host_that_is_no_address_is_refused_naming_the_host_setting(port: int) -> None:
    with pytest.raises(OSError, match=r"^LLAMAMESH_WORKER_METRICS_HOST: cannot listen on 'bad host!': "):
        check_free("bad host!", port, "LLAMAMESH_WORKER_HEALTH_PORT", host_setting="LLAMAMESH_WORKER_METRICS_HOST")
