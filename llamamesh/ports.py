"""Listening ports: a free one to pick, and whether one asked for is free, checked before a server
binds it so that a taken port stops the process with one line naming its setting."""

from __future__ import annotations

import errno
import socket


def free_port(host: str = "127.0.0.1", preferred: int = 0) -> int:
    """``preferred`` where it is free on ``host``, else a free port."""
    with socket.socket() as s:
        try:
            s.bind((host, preferred))
        except OSError:
            s.bind((host, 0))
        return int(s.getsockname()[1])


def check_free(
    host: str, port: int, setting: str, reuse_port: bool = False, host_setting: str = "LLAMAMESH_GATEWAY_HOST"
) -> None:
    """Raise OSError (one line naming ``setting``) when ``host:port`` cannot be listened on because
    another socket holds it, or naming ``host_setting`` when ``host`` does not resolve.
    ``reuse_port``: the server will share the port (SO_REUSEPORT) with processes of its own, which a
    check that shares it too does not count. Port 0 passes: the server's own bind reports it."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise OSError(f"{host_setting}: cannot listen on {host!r}: {exc.strerror or exc}") from exc
    if not port:
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                s.bind(address)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    why = "in use" if exc.errno == errno.EADDRINUSE else "not allowed"
                    raise OSError(f"{setting}: {host}:{port} is {why}; choose another port") from exc
                return
