"""The daemon's directories: the socket's and the arena's, made where missing and refused, in
one line that ends in the fix, where another user could replace or remove what the daemon puts
there. Used by `Daemon` (tierd/server.py) before it makes anything else."""

from __future__ import annotations

import os
import stat

from .errors import ConfigError


def _own_directory(d: str, mode: int, what: str, create_fix: str, fix: str) -> os.stat_result:
    """Make directory `d` (`what`: how messages name it) where it is missing, with `mode`;
    refuse, in one line ending in the fix, one that cannot be made, is no directory, is
    world-writable without the sticky bit (another user could replace what the daemon puts
    there) or that this user may not write. Returns its stat."""
    try:
        os.makedirs(d, mode=mode, exist_ok=True)
        st = os.stat(d)
    except OSError as e:
        raise ConfigError(f"{what} {d}: cannot create it ({e.strerror or e}; uid {os.geteuid()}); {create_fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what} {d} is not a directory; {fix}")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"{what} {d} is world-writable (another user could replace or remove what the daemon "
                          f"puts there); {fix}")
    if not os.access(d, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise ConfigError(f"{what} {d} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}) is "
                          f"not writable by uid {os.geteuid()}; {fix}, or run the daemon as the directory's owner")
    return st


def check_socket_dir(path: str) -> None:
    """Make the socket's directory where it is missing; refuse one this user may not write, one
    other users could write, or one of another user (they could replace the socket and
    impersonate the daemon)."""
    d = os.path.dirname(os.path.abspath(path))
    st = _own_directory(d, 0o755, "socket directory",
                        "create it for the daemon's user (the systemd unit's RuntimeDirectory= makes /run/tierd; "
                        "by hand: install -d -m 0750 -o USER -g tierd DIR), or set socket (--socket) to a path in a "
                        "directory this user may write",
                        "set socket (--socket) to a path in a private directory of this user's own such as /run/tierd")
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(f"socket directory {d} belongs to uid {st.st_uid}, not this user ({os.geteuid()})")



def prepare_arena_dir(path: str) -> None:
    """Make `arena_dir` where it is missing (mode 0750: the daemon's group reads it); refuse one
    other users may write without the sticky bit (they could remove or replace the arena)."""
    fix = ("set arena_dir to a directory on a tmpfs of this user's own (the default: /dev/shm/tierd for the "
           "service, /dev/shm/tierd-UID for a user's own daemon)")
    _own_directory(path, 0o750, "arena_dir", fix, fix)

