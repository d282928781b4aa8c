"""Host arenas left behind: what `tierd clean` finds and removes.

A daemon keeps its host arena (`tierd-UID-TAG.host` in `arena_dir`, with its block records
`.host.rec` and `.host.rec.ns`) when it stops, so that the next start on the same socket
re-adopts its blocks (`[host] keep`); an arena moved aside for re-adoption ends in `.old`, and
the shared lookup index (`.index`) of a daemon killed with SIGKILL stays too. On tmpfs each holds
its memory until removed. A daemon that is running holds a shared `flock` on its arena file and
an exclusive one on its records, across mount namespaces (containers sharing the directory)
alike, so a file set is removed only when neither lock is held and no process of this PID
namespace maps or holds any of its files.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_NAME = re.compile(r"^(tierd-(\d+)-([0-9a-f]+))\.(host|host\.old|host\.rec|host\.rec\.ns|host\.rec\.old"
                   r"|host\.rec\.old\.ns|index)$")


@dataclass
class ArenaFiles:
    """The files of one daemon's host arena in one directory."""

    base: str                       # DIR/tierd-UID-TAG
    uid: int
    files: list[Path] = field(default_factory=list)
    live_because: str = ""          # why it is taken for a running daemon's ("" = not running)

    @property
    def bytes(self) -> int:
        """Memory (or disk) the files hold: allocated blocks, not their sizes."""
        total = 0
        for f in self.files:
            try:
                total += os.stat(f).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    @property
    def live(self) -> bool:
        return bool(self.live_because)


def find(dirs: list[str]) -> list[ArenaFiles]:
    """Every daemon's arena file set in `dirs`, each marked live or not."""
    groups: dict[str, ArenaFiles] = {}
    for d in dict.fromkeys(os.path.abspath(x) for x in dirs):
        try:
            names = sorted(os.listdir(d))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        for name in names:
            m = _NAME.match(name)
            if m is None:
                continue
            base = os.path.join(d, m.group(1))
            g = groups.setdefault(base, ArenaFiles(base, int(m.group(2))))
            g.files.append(Path(d, name))
    mapped = _files_in_use()
    for g in groups.values():
        g.live_because = _live(g, mapped)
    return sorted(groups.values(), key=lambda g: g.base)


def remove(group: ArenaFiles) -> list[Path]:
    """Remove a file set that is not live (checked again now); returns what was removed."""
    group.live_because = _live(group, _files_in_use())
    if group.live:
        raise RuntimeError(f"{group.base}: {group.live_because}")
    gone = []
    for f in group.files:
        # each file is removed under an exclusive lock taken on it (and only if the path still
        # names the file locked): a daemon that started on it since the check above holds a
        # shared lock from the file's first instant (tierd.arena), so this cannot remove it
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"{group.base}: {f.name} is locked by a running daemon") from None
            except OSError:
                pass   # a filesystem without flock: the checks above stand
            st, now = os.fstat(fd), os.stat(f)
            if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
                continue   # replaced since: not the file that was checked
            os.unlink(f)
            gone.append(f)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return gone


def _live(g: ArenaFiles, mapped: set[tuple[int, int]]) -> str:
    for f in g.files:
        try:
            st = os.stat(f)
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) in mapped:
            return f"{f.name} is open or mapped by a running process"
        locked = _locked(f)
        if locked:
            return f"{f.name} is {locked}"
    return ""


def _locked(path: Path) -> str:
    """"locked by a running daemon" when some process holds a flock on `path`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"not readable here ({e.strerror}): run as its owner or root"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "locked by a running daemon"
    except OSError:
        return ""
    finally:
        os.close(fd)
    return ""


def _files_in_use() -> set[tuple[int, int]]:
    """(device, inode) of every file a process of this PID namespace maps or holds open."""
    seen: set[tuple[int, int]] = set()
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[4] != "0" and "tierd-" in parts[5]:
                        major, minor = parts[3].split(":")
                        seen.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
        except OSError:
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if "tierd-" in target:
                        st = os.stat(f"/proc/{pid}/fd/{fd}")
                        seen.add((st.st_dev, st.st_ino))
                except OSError:
                    pass
        except OSError:
            pass
    return seen
