"""Failpoints under the disk tier (`disk.fault_file`, off by default): `FaultInjector` reads a
control file of `op=FAULT` pairs and makes the disk tier's calls fail or hang as a dying disk
would. Its only user is `DiskTier` (tierd/tiers/disk.py and its parts), which asks it before
each write, read, flush and metadata call; fault drills: docs/RELIABILITY.md.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path


class FaultInjector:
    """Failpoints under the disk tier, for fault tests (`disk.fault_file`; off by default).

    The control file holds `op=FAULT` pairs, e.g. `write=EIO read=EIO flush=ENOSPC`, `all=EROFS`,
    or `write=hang:30` (the call blocks for up to 30 s, as a dying disk or a lost NFS server
    would; it returns early, successfully, as soon as the fault is removed). Ops: write, read,
    flush, meta (namespace and checkpoint files). An empty or missing file means no faults. It is
    re-read when its mtime changes, so a test (or an operator rehearsing an incident) flips
    faults on and off while the daemon runs."""

    OPS = ("write", "read", "flush", "meta")

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self._faults: dict[str, tuple[str, float]] = {}

    def _current(self, op: str) -> tuple[str, float] | None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            # the faults before the stamp: an I/O thread that sees the new stamp must also see
            # the new faults (parallel reads check at once)
            self._faults = self._parse() if stamp is not None else {}
            self._stamp = stamp
        return self._faults.get(op) or self._faults.get("all")

    def check(self, op: str) -> None:
        fault = self._current(op)
        if fault is None:
            return
        kind, value = fault
        if kind == "errno":
            raise OSError(int(value), f"{os.strerror(int(value))} (injected by {self.path})")
        end = time.monotonic() + value        # a hang: until it ends or is lifted
        while time.monotonic() < end:
            time.sleep(0.02)
            now = self._current(op)
            if now is None or now[0] != "hang":
                return

    def _parse(self) -> dict[str, tuple[str, float]]:
        faults = {}
        try:
            text = Path(self.path).read_text()
        except OSError:
            return {}
        for item in text.split():
            op, _, name = item.partition("=")
            if op not in self.OPS and op != "all":
                continue
            name = name.strip()
            if name.lower().startswith("hang:"):
                try:
                    faults[op] = ("hang", float(name[5:]))
                except ValueError:
                    pass
                continue
            code = getattr(errno, name.upper(), None)
            if isinstance(code, int):
                faults[op] = ("errno", code)
        return faults
