"""Kernel or reference: each op runs its CUDA kernel only on devices where the kernel has
matched its torch reference on random data; everywhere else, and after any failure, the
reference runs. A wrong kernel therefore costs speed, never a wrong result.

At the first call on a device, `KernelOp` runs its self-check: the op's `case` builds the same
random inputs twice (fixed seed), runs the reference on one copy and the kernel on the other,
and compares the outputs (bit-exact for cache ops, within a tolerance for attention). A
mismatch, or an exception from compiling or launching, logs one warning and pins the device to
the reference. A kernel that raises later falls back the same way for that call and after.

An op made with `dtypes` is checked, and pinned, per device and dtype (of its first tensor
argument): its case builds only that dtype's inputs, so a kernel that rounds differently in one
dtype (the fused norm's rsqrt in float32, say) still serves the others.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("tierd.kernels")

# case(device, fn) -> output tensors of running fn on freshly made (seeded) inputs on device
Case = Callable[[torch.device, Callable], Sequence[torch.Tensor]]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


def close(atol: float, rtol: float = 0.0) -> Callable[[torch.Tensor, torch.Tensor], bool]:
    def cmp(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(torch.allclose(a.float().cpu(), b.float().cpu(), atol=atol, rtol=rtol))
    return cmp


def _dtype_of(args, kwargs) -> torch.dtype | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.dtype
    return None


def _device_of(args, kwargs) -> torch.device | None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return a[0].device
    return None


class KernelOp:
    """One op with a reference, optional kernels for some device types, and a self-check.

    `kernel`, `available` and `case` are each one callable for every type in `devices`, or a
    dict by device type ("cuda": the CUDA kernel through NVRTC, "cpu": C built here).
    `dtypes`: checked per dtype (see the module's docstring); the case is then called as
    case(device, fn, dtype)."""

    def __init__(self, name: str, reference: Callable, kernel: Callable | dict | None = None, *,
                 case: Case | dict | None = None,
                 compare: Callable[[torch.Tensor, torch.Tensor], bool] = same_bytes,
                 devices: tuple[str, ...] = ("cuda",), available: Callable[[], bool] | dict = lambda: True,
                 dtypes: tuple[torch.dtype, ...] | None = None):
        self.name = name
        self.reference = reference
        if isinstance(kernel, dict):
            self.kernels = dict(kernel)
        else:
            self.kernels = {d: kernel for d in devices} if kernel is not None else {}
        self.available = available if isinstance(available, dict) else dict.fromkeys(self.kernels, available)
        self.cases = case if isinstance(case, dict) else dict.fromkeys(self.kernels, case)
        self.compare = compare
        self.dtypes = dtypes
        self._state: dict[str, str] = {}      # device (and dtype) -> "kernel" or "reference: why"
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        device = _device_of(args, kwargs)
        dtype = _dtype_of(args, kwargs) if self.dtypes else None
        if device is not None and self.use_kernel(device, dtype):
            try:
                return self.kernels[device.type](*args, **kwargs)
            except ValueError:
                pass  # an input the kernel does not take (layout, dtype): the reference does
            except Exception as e:  # noqa: BLE001 -- any kernel failure means the reference
                self._pin(device, f"raised {e!r}", dtype)
        return self.reference(*args, **kwargs)

    @staticmethod
    def _key(device: torch.device, dtype: torch.dtype | None) -> str:
        return str(device) if dtype is None else f"{device} {str(dtype).removeprefix('torch.')}"

    def status(self, device: torch.device, dtype: torch.dtype | None = None) -> str:
        """"kernel", "reference: <why>" or "unchecked"; for an op checked per dtype without
        `dtype`: "kernel" where every checked dtype runs it, else each dtype's state."""
        if not self.dtypes or dtype is not None:
            return self._state.get(self._key(device, dtype), "unchecked")
        states = {d: self._state[self._key(device, d)] for d in self.dtypes if self._key(device, d) in self._state}
        if not states:
            return "unchecked"
        if all(v == "kernel" for v in states.values()):
            return "kernel"
        return "; ".join(f"{str(d).removeprefix('torch.')}: {v}" for d, v in states.items())

    def use_kernel(self, device: torch.device, dtype: torch.dtype | None = None) -> bool:
        """Whether the kernel runs on `device` (checked at the first ask); for an op checked per
        dtype, for `dtype` (None: for every one of its dtypes)."""
        if device.type not in self.kernels:
            return False
        if self.dtypes and dtype is None:
            return all([self.use_kernel(device, d) for d in self.dtypes])
        if self.dtypes and dtype not in self.dtypes:
            return False
        key = self._key(device, dtype)
        state = self._state.get(key)
        if state is None:
            with self._lock:
                state = self._state.get(key)
                if state is None:
                    state = self._state[key] = self._self_check(device, dtype)
        return state == "kernel"

    def _self_check(self, device: torch.device, dtype: torch.dtype | None = None) -> str:
        kernel, case = self.kernels[device.type], self.cases.get(device.type)
        if case is not None and dtype is not None:
            case = functools.partial(case, dtype=dtype)
        where = device if dtype is None else f"{device} ({str(dtype).removeprefix('torch.')})"
        if not self.available.get(device.type, lambda: True)():
            return "reference: CUDA or CuPy not available" if device.type == "cuda" else \
                f"reference: no {device.type} kernel here"
        if case is None:
            return "reference: no self-check case"
        try:
            want = case(device, self.reference)
            got = case(device, kernel)
            for i, (w, g) in enumerate(zip(want, got, strict=True)):
                if not self.compare(w, g):
                    diff = (w.float().cpu() - g.float().cpu()).abs().nan_to_num(nan=float("inf")).max().item() \
                        if w.shape == g.shape else f"shape {tuple(g.shape)} != {tuple(w.shape)}"
                    raise AssertionError(f"output {i} differs from the reference (max abs diff {diff})")
        except Exception as e:  # noqa: BLE001
            why = f"reference: self-check failed: {e}"
            log.warning("tierd kernel %s on %s failed its self-check (%s); using the torch reference",
                        self.name, where, e)
            return why
        log.info("tierd kernel %s on %s passed its self-check", self.name, where)
        return "kernel"

    def _pin(self, device: torch.device, why: str, dtype: torch.dtype | None = None) -> None:
        with self._lock:
            self._state[self._key(device, dtype)] = f"reference: {why}"
        log.warning("tierd kernel %s on %s %s; using the torch reference from now on", self.name,
                    device if dtype is None else f"{device} ({str(dtype).removeprefix('torch.')})", why)
