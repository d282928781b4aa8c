"""Page-locking a transfer's host arena: registered with the device in chunks of at most
`PIN_CHUNK_BYTES`, on a background thread, so that attaching an engine to an arena of any size
costs its thread no time; and which host ranges the device may read in place.

It never reports memory as registered that is not: a chunk still pending, or one whose
registration failed, is pageable, and copies from it go through a pinned staging buffer. A failed
chunk is logged once with its range and counted in the stats (`pin_failed_chunks`,
`pin_failed_bytes`); `pinned_bytes` and `pin_pending_bytes` say how far registration has come.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
from collections.abc import Callable

import torch

from tierd import threads

log = logging.getLogger("tierd.kernels")

PIN_CHUNK_BYTES = 64 << 30     # one cudaHostRegister call at most this large (about a minute)
PAGE = mmap.PAGESIZE           # chunk boundaries fall on pages: a page is never registered twice

STAT_KEYS = ("pinned_bytes", "pin_pending_bytes", "pin_failed_chunks", "pin_failed_bytes")


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed runtime call made outside torch's
    checks (cudaHostRegister): left set, the next torch call that checks it (an allocation)
    raises it as its own. The runtime is the one this process loaded (torch's), found by name."""
    import ctypes
    import os
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and line.rstrip().endswith(tuple("0123456789o"))}
        for path in sorted(paths):
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 4) | ctypes.RTLD_GLOBAL)
            lib.cudaGetLastError()
    except (OSError, AttributeError):     # no such runtime here (linked into torch): nothing to reset
        pass


def _code(rc) -> int:
    """A runtime call's result as the error code (the binding may return a tuple)."""
    return int(rc[0] if isinstance(rc, tuple) else rc)


def _cuda_error_name(rc) -> str:
    code = _code(rc)
    try:
        return f"{torch.cuda.cudart().cudaGetErrorString(rc)} ({code})"
    except Exception:  # noqa: BLE001 - only the message is at stake
        return f"CUDA error {code}"


# Host ranges this process has page-locked, shared by every transfer in it (two transfers may
# attach the same arena: the CUDA runtime refuses a second registration of a range, and its
# error, left set, would fail the next torch call): ptr -> [size, tag, holders, registering].
# `tag` names the mapping (an arena re-mapped at the same address has other pages behind the
# same range); `registering` is an Event while cudaHostRegister runs (outside the lock: seconds
# per GiB, and another range's registration must not wait for it), None once done.
_PINS: dict[int, list] = {}
_PINS_LOCK = threading.Lock()


class CudaHostPinning:
    """Page-locking through the CUDA runtime (cudaHostRegister / cudaHostUnregister), counted
    per process: a range registered by one transfer is shared by the others that attach it.
    `register` returns False where the runtime refused, with its reason in `last_error`."""

    def __init__(self):
        self.last_error = ""

    def register(self, ptr: int, size: int, tag=None) -> bool:
        cudart = torch.cuda.cudart()
        while True:
            with _PINS_LOCK:
                held = _PINS.get(ptr)
                busy = held[3] if held is not None else None
                if busy is None:
                    if held is not None and held[0] == size and held[1] == tag:
                        held[2] += 1
                        return True
                    if held is not None:
                        # what was registered here is another mapping's: its pages are gone from this range
                        if _code(cudart.cudaHostUnregister(ptr)):
                            _clear_cuda_error()
                        del _PINS[ptr]
                    done = threading.Event()
                    _PINS[ptr] = [size, tag, 0, done]
                    break
            busy.wait()                   # another transfer registers this range now
        rc = cudart.cudaHostRegister(ptr, size, 0)
        if _code(rc):
            _clear_cuda_error()           # the runtime's last error is this thread's
            self.last_error = f"cudaHostRegister: {_cuda_error_name(rc)}"
        with _PINS_LOCK:
            if _code(rc):
                del _PINS[ptr]
            else:
                _PINS[ptr] = [size, tag, 1, None]
        done.set()
        return not _code(rc)

    def unregister(self, ptr: int, tag=None) -> None:
        with _PINS_LOCK:
            held = _PINS.get(ptr)
            if held is None or held[1] != tag or held[3] is not None:
                return                # re-registered since for another mapping: not this holder's
            held[2] -= 1
            if held[2] == 0:
                del _PINS[ptr]
                if _code(torch.cuda.cudart().cudaHostUnregister(ptr)):
                    _clear_cuda_error()


class _Arena:
    """One host range (an arena mapping, or a buffer given to `register_host`) and its chunks:
    [offset, size, state] with state "pending", "registering", "pinned" or "failed"."""

    def __init__(self, ptr: int, size: int, tag, chunk_bytes: int):
        self.ptr, self.size, self.tag = ptr, size, tag
        base = ptr & ~(PAGE - 1)        # boundaries on pages (chunk_bytes is a multiple of one)
        bounds = [ptr, *range(base + chunk_bytes, ptr + size, chunk_bytes), ptr + size]
        self.chunks = [[lo - ptr, hi - lo, "pending"] for lo, hi in zip(bounds, bounds[1:])]
        self.users: set = set()
        self.retired = False

    def overlaps(self, ptr: int, size: int) -> bool:
        return ptr < self.ptr + self.size and self.ptr < ptr + size

    def bytes_in(self, *states: str) -> int:
        return sum(c[1] for c in self.chunks if c[2] in states)


class HostPins:
    """The host ranges one transfer has page-locked, chunk by chunk.

    `lock` is the transfer's: loads decide and queue their copies under it, so a chunk is never
    unregistered between a load's decision to read it in place and its copies being queued;
    `drain()` waits for every queued copy (called before a range is unregistered). Registration
    runs on one background thread, chunk after chunk in the order asked, which exits when
    nothing is pending; `on_thread` runs first in it (the transfer's device made current)."""

    def __init__(self, pinning, lock: threading.Lock, drain: Callable[[], None], stats: dict,
                 chunk_bytes: int | None = None, on_thread: Callable[[], None] | None = None):
        chunk = PIN_CHUNK_BYTES if chunk_bytes is None else int(chunk_bytes)
        self.chunk_bytes = max(PAGE, chunk // PAGE * PAGE)
        self.pinning, self.lock, self.drain, self.stats = pinning, lock, drain, stats
        self._on_thread = on_thread
        self._changed = threading.Condition(lock)       # a chunk settled, or the worker ended
        self._arenas: list[_Arena] = []                 # live ones, in the order they were asked
        self._mapping: dict = {}                        # owner (id of a store) -> (ptr, size, generation)
        self._spans: list[tuple[int, int]] = []         # pinned address ranges, sorted, adjacent merged
        self._starts: list[int] = []
        self._worker: threading.Thread | None = None
        self.failures: list[tuple[int, int, int, str]] = []   # (arena ptr, offset, size, error), as logged
        for k in STAT_KEYS:
            stats.setdefault(k, 0)

    # -- asked by the transfer (with `lock` held) -------------------------------------------------
    def attach(self, owner, ptr: int, size: int, generation=0) -> bool:
        """`owner`'s arena is now (ptr, size) of this generation: its registration is started in
        the background (once per mapping); the old mapping's chunks are unregistered where no
        other owner maps them. Returns False where a chunk of it failed to register."""
        now = (ptr, size, generation)
        old = self._mapping.get(owner)
        if old != now:
            if old is not None:
                self._leave(owner, old[:2])
            self._mapping[owner] = now
            arena = self._open(ptr, size, (owner, generation))
            arena.users.add(owner)
            self._start_worker()
        arena = self._find(ptr, size)
        return arena is not None and not arena.bytes_in("failed")

    def register_now(self, ptr: int, size: int, tag=None) -> bool:
        """Register a range in the caller's thread (chunk by chunk, as the worker would); returns
        once every chunk is settled, whether all are pinned. The lock is held on entry and exit,
        released while the runtime registers."""
        arena = self._open(ptr, size, tag)
        arena.users.add(("register_host", ptr))
        while True:
            chunk = next((c for c in arena.chunks if c[2] == "pending"), None)
            if chunk is None:
                break
            self._register(arena, chunk)
        self._changed.wait_for(lambda: arena.retired or not arena.bytes_in("pending", "registering"))
        return not arena.retired and arena.bytes_in("pinned") == arena.size

    def covers(self, ptr: int, size: int) -> bool:
        """Whether [ptr, ptr + size) lies wholly in registered memory (the device may read it in place)."""
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + size <= self._spans[i][1]

    def settled(self) -> bool:
        return not any(a.bytes_in("pending", "registering") for a in self._arenas)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait (lock held) until no chunk is pending; whether every chunk is pinned."""
        self._changed.wait_for(self.settled, timeout_s)
        return self.settled() and not any(a.bytes_in("failed") for a in self._arenas)

    def release_all(self) -> threading.Thread | None:
        """Unregister everything registered (after the copies queued have run) and forget every
        mapping; returns the worker to join outside the lock (it unregisters a chunk it was
        registering when it comes back)."""
        for arena in list(self._arenas):
            self._retire(arena)
        self._mapping.clear()
        return self._worker

    # -- the ranges ------------------------------------------------------------------------------
    def _find(self, ptr: int, size: int) -> _Arena | None:
        return next((a for a in self._arenas if (a.ptr, a.size) == (ptr, size)), None)

    def _open(self, ptr: int, size: int, tag) -> _Arena:
        """The live arena for this range and tag; any other that overlaps it is another mapping's
        (its pages are gone from these addresses): unregistered."""
        keep = None
        for arena in list(self._arenas):
            if (arena.ptr, arena.size, arena.tag) == (ptr, size, tag):
                keep = arena
            elif arena.overlaps(ptr, size):
                self._retire(arena)
        if keep is None:
            keep = _Arena(ptr, size, tag, self.chunk_bytes)
            self._arenas.append(keep)
            self._count(pin_pending_bytes=size)
        return keep

    def _leave(self, owner, key: tuple[int, int]) -> None:
        arena = self._find(*key)
        if arena is not None:
            arena.users.discard(owner)
            if not arena.users:
                self._retire(arena)

    def _retire(self, arena: _Arena) -> None:
        arena.retired = True
        self._arenas.remove(arena)
        pinned = [c for c in arena.chunks if c[2] == "pinned"]
        self._count(pinned_bytes=-arena.bytes_in("pinned"), pin_pending_bytes=-arena.bytes_in("pending", "registering"),
                    pin_failed_chunks=-sum(c[2] == "failed" for c in arena.chunks),
                    pin_failed_bytes=-arena.bytes_in("failed"))
        if pinned:
            self._spans_changed()        # no load decided from now on reads it in place
            self.drain()                 # no copy queued from the old range may still be running
            for offset, _, _ in pinned:
                self.pinning.unregister(arena.ptr + offset, tag=arena.tag)
        self._changed.notify_all()

    def _spans_changed(self) -> None:
        spans: list[list[int]] = []
        for lo, hi in sorted((a.ptr + c[0], a.ptr + c[0] + c[1])
                             for a in self._arenas for c in a.chunks if c[2] == "pinned"):
            if spans and spans[-1][1] == lo:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi])
        self._spans = [tuple(s) for s in spans]
        self._starts = [s[0] for s in spans]

    def _count(self, **deltas: int) -> None:
        for k, d in deltas.items():
            self.stats[k] = self.stats.get(k, 0) + d

    # -- registration ----------------------------------------------------------------------------
    def _register(self, arena: _Arena, chunk: list) -> None:
        """Register one pending chunk: called with the lock held, released around the runtime's
        call. A chunk of an arena retired meanwhile is unregistered at once, never published."""
        chunk[2] = "registering"
        offset, size = chunk[0], chunk[1]
        ptr = arena.ptr + offset
        self.lock.release()
        try:
            try:
                ok, error = bool(self.pinning.register(ptr, size, tag=arena.tag)), ""
            except Exception as e:  # noqa: BLE001 -- a chunk that fails stays pageable, staged
                ok, error = False, repr(e)
            if not ok and not error:
                error = getattr(self.pinning, "last_error", "") or "refused"
            if ok and arena.retired:
                self.pinning.unregister(ptr, tag=arena.tag)
        finally:
            self.lock.acquire()
        if not arena.retired:
            chunk[2] = "pinned" if ok else "failed"
            self._count(pin_pending_bytes=-size)
            if ok:
                self._count(pinned_bytes=size)
                self._spans_changed()
            else:
                self._count(pin_failed_chunks=1, pin_failed_bytes=size)
                self.failures.append((arena.ptr, offset, size, error))
                log.warning("tierd transfer: page-locking host bytes [%d, %d) of the %d-byte range at %#x "
                            "failed (%s): loads from them are copied through a pinned staging buffer",
                            offset, offset + size, arena.size, arena.ptr, error)
        self._changed.notify_all()

    def _start_worker(self) -> None:
        if self._worker is None and not self.settled():
            self._worker = threads.start(self._run, name="tierd-pin")

    def _run(self) -> None:
        if self._on_thread is not None:
            try:
                self._on_thread()
            except Exception:  # noqa: BLE001 -- registration then reports its own failures
                log.exception("tierd transfer: preparing the page-locking thread failed")
        with self.lock:
            try:
                while True:
                    todo = next(((a, c) for a in self._arenas for c in a.chunks if c[2] == "pending"), None)
                    if todo is None:
                        return
                    self._register(*todo)
            finally:
                self._worker = None
                self._changed.notify_all()
