"""Where tierd's helper threads run.

A CPU inference engine binds its compute threads to cores (vLLM's and SGLang's CPU workers bind
their OpenMP threads one per core); a thread created afterwards inherits its creator's binding.
tierd's helper threads in such a process (a connector's saver and loader, a client's arena
prefault and hits reporter) would then share the compute thread's core and take their time out of
the forward pass itself. An engine's connector calls `keep_helpers_off_my_cores()` from its
compute thread; helper threads started through `start()` after that run on the process's other
CPUs, where it has any (on a machine whose cores all compute, nothing changes).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

_helper_cpus: frozenset[int] | None = None


def keep_helpers_off_my_cores() -> frozenset[int] | None:
    """Called on a compute thread: helper threads started from now on avoid the CPUs this
    thread is bound to, when it is bound to fewer than all of them. Returns the helpers' CPUs
    (None: unchanged)."""
    global _helper_cpus
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = os.sched_getaffinity(0)
    spare = frozenset(range(os.cpu_count() or 1)) - mine
    _helper_cpus = spare or None    # (the kernel keeps only those the process's cpuset allows)
    return _helper_cpus


def enter_helper() -> None:
    """Move the calling (helper) thread off the compute cores, where an engine keeps helpers
    off them (`start` does this for its threads; a thread pool passes it as its initializer)."""
    cpus = _helper_cpus
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)    # this thread only
        except OSError:
            pass    # none of them allowed here (a cpuset): stay where it was


def start(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start a daemon helper thread running `target(*args)`, off the compute cores."""
    def run() -> None:
        enter_helper()
        target(*args)
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t
