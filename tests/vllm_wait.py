"""Waiting for real vLLM processes in tests, with limits that fit a loaded machine and errors that
say what was waited for.

A vLLM engine process starts in ~20 s on an idle 2-core machine; on one shared with other test
runs it can take several times that, and so can each batch. A limit that runs out fails with the
engine's name, what it was doing (the batches it finished, from its output file), how long it
ran, and the last lines of its log; never with a bare timeout.

Limits (seconds; environment variables override them):
- ``TIERD_TEST_VLLM_ENGINE_S`` (1800): one engine process, start-up included;
- ``TIERD_TEST_VLLM_BUDGET_S`` (7200): all engines of tests/test_vllm_engine.py's module fixture
  together (pytest's own timeout for that module is set above it, so it never fires first);
- ``TIERD_TEST_VLLM_SCRIPT_S`` (900): a vLLM check script (conformance, the secondary tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

ENGINE_S = float(os.environ.get("TIERD_TEST_VLLM_ENGINE_S", 1800))
BUDGET_S = float(os.environ.get("TIERD_TEST_VLLM_BUDGET_S", 7200))
SCRIPT_S = float(os.environ.get("TIERD_TEST_VLLM_SCRIPT_S", 900))


class TimeLimit(AssertionError):
    """A vLLM process ran past its limit (an AssertionError, so pytest shows the message)."""


def tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not Path(path).exists():
        return "(no log)"
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


def progress(out: Path | None) -> str:
    """What an engine of tests/vllm_engine.py has done so far, from its output file."""
    if out is None:
        return ""
    try:
        res = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        return "it had not finished starting (no batch done)"
    names = [b["name"] for b in res.get("batches", ())]
    return f"it started in {res.get('startup_s', 0):.0f} s and finished the batches {names}"


class Budget:
    """A deadline shared by several waits (one module fixture's engines)."""

    def __init__(self, seconds: float = BUDGET_S, what: str = "the vLLM engines"):
        self.seconds, self.what = seconds, what
        self.deadline = time.monotonic() + seconds

    def limit(self, own: float) -> tuple[float, str]:
        left = self.deadline - time.monotonic()
        if left < own:
            return max(1.0, left), (f"what is left of the {self.seconds:.0f} s for {self.what} "
                                    "(TIERD_TEST_VLLM_BUDGET_S)")
        return own, None


def wait(proc: subprocess.Popen, what: str, log: Path | None, *, limit_s: float = ENGINE_S,
         limit_name: str = "TIERD_TEST_VLLM_ENGINE_S", out: Path | None = None, budget: Budget | None = None) -> int:
    """Wait for `proc` (described by `what`) to exit; returns its exit status. Past the limit it
    is killed and a TimeLimit says what it was doing."""
    t0 = time.monotonic()
    reason = f"{limit_name}={limit_s:.0f} s"
    if budget is not None:
        limit_s, why = budget.limit(limit_s)
        reason = why or reason
    try:
        return proc.wait(limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        done = progress(out)
        raise TimeLimit(f"{what}: still running after {time.monotonic() - t0:.0f} s, the limit ({reason}); "
                        f"killed. {done + '. ' if done else ''}Last lines of its log ({log}):\n{tail(log)}") from None


def until(check, proc: subprocess.Popen, what: str, log: Path | None, *, limit_s: float = ENGINE_S,
          out: Path | None = None, budget: Budget | None = None, every_s: float = 0.05) -> None:
    """Poll `check()` until it is true, while `proc` runs; a process that exits first, or a limit
    that runs out, fails with what was waited for and the log's last lines."""
    t0 = time.monotonic()
    reason = f"TIERD_TEST_VLLM_ENGINE_S={limit_s:.0f} s"
    if budget is not None:
        limit_s, why = budget.limit(limit_s)
        reason = why or reason
    deadline = t0 + limit_s
    while not check():
        rc = proc.poll()
        if rc is not None:
            raise AssertionError(f"{what}: the engine exited ({rc}) first. {progress(out)}. "
                                 f"Last lines of its log ({log}):\n{tail(log)}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(30)
            raise TimeLimit(f"{what}: not after {time.monotonic() - t0:.0f} s, the limit ({reason}); the engine "
                            f"was killed. {progress(out)}. Last lines of its log ({log}):\n{tail(log)}")
        time.sleep(every_s)


def run_script(cmd: list[str], what: str, *, limit_s: float = SCRIPT_S, **kw) -> subprocess.CompletedProcess:
    """subprocess.run for a vLLM check script, whose limit fails with what it printed last."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, **kw)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise TimeLimit(f"{what}: still running after {limit_s:.0f} s (TIERD_TEST_VLLM_SCRIPT_S); killed. "
                        f"Last output:\n{(out + err)[-4000:]}") from None
