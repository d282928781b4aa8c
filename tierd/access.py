"""Why this process may not reach a path, in words: the second half of permission errors.

Shared by the client (a socket or arena it cannot open) and the command line (a config file or
directory it cannot read). Reads modes only; changes nothing.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path


def modes(path: str, want: int = os.W_OK) -> str:
    """`DIR (mode 0750, group tierd)`: the first of `path`'s directories that this process may
    not pass, or `path` itself where it may not use it as `want` (os.W_OK, os.R_OK), with its
    mode and group; the path alone when none can be told."""
    here = Path(path).absolute()
    eff = os.access in os.supports_effective_ids
    for p in [*reversed(here.parents), here]:
        if os.access(p, want if p == here else os.X_OK, effective_ids=eff):
            continue
        try:
            st = os.stat(p)
        except OSError:
            break
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return f"{p} (mode {stat.S_IMODE(st.st_mode):04o}, group {group})"
    return str(here)


def who() -> str:
    """`uid 1000 (groups 1000, 27)`: this process's effective identity."""
    return (f"uid {os.geteuid()} (groups "
            f"{', '.join(str(g) for g in sorted(set(os.getgroups()) | {os.getegid()}))})")


def not_admitted(path: str, want: int = os.W_OK) -> str:
    """A path (or a directory on its way) whose mode keeps this process out, and the fix."""
    return (f"{modes(path, want)} does not admit {who()}: add this user to the daemon's group "
            "(`usermod -aG tierd USER`, then a new login; a pod's supplementalGroups)")
