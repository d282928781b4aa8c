"""Compile the CUDA sources with NVRTC through CuPy, once per device architecture, and launch
kernels on the current torch stream with torch tensors.

Nothing here runs without CUDA and CuPy; `available()` says whether both are present. The
sources include "common.cuh", which is inlined here so that NVRTC needs no include path of ours.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("tierd.kernels")

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("reshape_and_cache.cu", "paged_attention.cu", "gather_scatter.cu", "fp8.cu", "int4_attention.cu")
_INCLUDE = '#include "common.cuh"'

_lock = threading.Lock()
_modules: dict[tuple[str, str], object] = {}


def source_text(name: str) -> str:
    """A kernel source with common.cuh inlined (what NVRTC compiles)."""
    text = (KERNEL_DIR / name).read_text()
    common = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once", "")
    return text.replace(_INCLUDE, common)


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


def arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _options() -> tuple[str, ...]:
    opts = ["-std=c++17"]
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda_fp8.h").exists():
            opts.append(f"-I{Path(root) / 'include'}")
            break
    return tuple(opts)


def function(device: torch.device, source: str, name: str):
    """The CuPy kernel `name` from `source`, compiled for `device`'s architecture (cached)."""
    import cupy
    key = (arch(device), source)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            with cupy.cuda.Device(device.index or 0):
                mod = cupy.RawModule(code=source_text(source), options=_options(), backend="nvrtc")
                mod.compile()
            _modules[key] = mod
            log.info("compiled %s for %s", source, key[0])
    with cupy.cuda.Device(device.index or 0):
        return mod.get_function(name)


def launch(device: torch.device, source: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on torch's current stream of `device`. Pointers go as np.uint64, ints as np.int32 /
    np.int64, floats as np.float32 (see `ptr`, `i32`, `i64`, `f32`)."""
    import cupy
    fn = function(device, source, name)
    if shared_mem > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = shared_mem
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device.index or 0)
    with cupy.cuda.Device(device.index or 0), stream:   # RawKernel launches on CuPy's current stream
        fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


i32, i64, f32 = np.int32, np.int64, np.float32
