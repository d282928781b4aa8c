"""What this tierd is: its version (one place: `tierd.__version__`, which pyproject.toml reads)
and, where it is not a tagged release, the commit it was built from.

A wheel made by `make wheel` carries the commit in `tierd/_build_info.py` (written for the build,
never committed); a checkout asks git. A release is a version without a `.dev` part whose commit
carries the tag `vVERSION`."""

from __future__ import annotations

import functools
import os
import subprocess

from . import __version__


@functools.cache
def commit() -> str | None:
    """The commit this code was built from (12 hex digits, `-dirty` with local changes), or
    None where it cannot be told (an installed package that did not record it)."""
    try:
        from ._build_info import COMMIT   # a wheel from `make wheel`
        return COMMIT or None
    except ImportError:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(os.path.dirname(here), ".git")):
        return None
    try:
        r = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=12",
                            "--match", "v[0-9]*", "--exclude", "*"],
                           capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def is_release() -> bool:
    return ".dev" not in __version__ and "+" not in __version__


def version_string() -> str:
    """`0.2.0` for a release; `0.2.0.dev0 (commit 0123456789ab, not a release)` otherwise."""
    if is_release():
        return __version__
    c = commit()
    return f"{__version__} ({'commit ' + c if c else 'commit unknown'}, not a release)"
