"""systemd's notify protocol (sd_notify): READY, STATUS, WATCHDOG, STOPPING datagrams to
$NOTIFY_SOCKET. Does nothing when not started by systemd; never raises."""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("tierd.sdnotify")


def notify(state: str) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving") to $NOTIFY_SOCKET; True if sent."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", addr, e)
        return False


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC in seconds when the watchdog is meant for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
