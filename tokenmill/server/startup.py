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


def check_port_free(host: str, port: int) -> None:
    """Fail in a moment rather than after the model has loaded: bind host:port the way uvicorn will
    (SO_REUSEADDR, so a port left in TIME_WAIT counts as free), then let it go."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CannotListenError(f"port {port} on {host} is already in use; pass --port") from None
            reason = (e.strerror or str(e)).lower()
            raise CannotListenError(f"cannot listen on {host} port {port}: {reason}; pass --host or --port") from None


def check_listen_address(host: str, port: int, uds: str | None) -> None:
    """check_port_free, or with a Unix socket path (which uvicorn replaces), that no server listens there."""
    if uds is None:
        return check_port_free(host, port)
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(uds)
        except OSError:
            return  # no file, or a socket left behind with nobody listening
    raise CannotListenError(f"a server already listens on the socket {uds}; pass another --uds")
