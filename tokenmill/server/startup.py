"""What `tokenmill serve` checks and sets before anything heavy loads: the port it will listen on, and SIGTERM.
Light to import (the server's own dependencies load later, while the engine core starts)."""

from __future__ import annotations

import errno
import socket


class CannotListenError(OSError):
    """host:port cannot be had (taken, not this machine's address, a privileged port): a message for the user."""


def exit_on_signal(signum: int, frame) -> None:
    """SIGTERM unwinds like Ctrl-C (SystemExit), so that the engine core is stopped on the way out."""
    raise SystemExit(128 + signum)


def bind_port(host: str, port: int) -> socket.socket:
    """host:port bound now the way uvicorn binds it (SO_REUSEADDR, so a port left in TIME_WAIT counts as free), for
    uvicorn to listen on later: a taken port fails in a moment rather than after the model has loaded, and the
    engine's processes, which bind ports of their own while it loads, cannot take it meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise CannotListenError(f"port {port} on {host} is already in use; pass --port") from None
        reason = (e.strerror or str(e)).lower()
        raise CannotListenError(f"cannot listen on {host} port {port}: {reason}; pass --host or --port") from None
    return sock


def claim_listen_address(host: str, port: int, uds: str | None) -> socket.socket | None:
    """The TCP port bound (bind_port); or with a Unix socket path (which uvicorn replaces when it starts), None once
    no server is found listening there."""
    if uds is None:
        return bind_port(host, port)
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(uds)
        except OSError:
            return None  # no file, or a socket left behind with nobody listening
    raise CannotListenError(f"a server already listens on the socket {uds}; pass another --uds")
