"""The kernels' table: one `KernelOp` per kernel, and `status()` (the package re-exports them)."""

from __future__ import annotations

import logging
import threading

import torch

from . import cases, native, ops, reference, triton_decode, triton_fused
from .dispatch import KernelOp, close, same_bytes
from .loader import available

log = logging.getLogger("tierd.kernels")

reshape_and_cache = KernelOp("reshape_and_cache", reference.reshape_and_cache, ops.reshape_and_cache,
                             case=cases.reshape_self_check, available=available)
paged_attention_decode = KernelOp("paged_attention_decode", reference.paged_attention_decode,
                                  {"cuda": ops.paged_attention_decode, "cpu": native.paged_attention_decode},
                                  case={"cuda": cases.attention_case, "cpu": cases.cpu_attention_case},
                                  compare=close(atol=1e-3), available={"cuda": available, "cpu": native.available})
# (on the CPU only under Triton's interpreter, TRITON_INTERPRET=1: the tests' way to run it)
paged_attention_decode_triton = KernelOp("paged_attention_decode_triton", reference.paged_attention_decode,
                                         {"cuda": triton_decode.paged_attention_decode,
                                          "cpu": triton_decode.paged_attention_decode},
                                         case=cases.triton_attention_case, compare=close(atol=2e-3),
                                         available={"cuda": triton_decode.available,
                                                    "cpu": lambda: triton_decode.available() and
                                                    triton_decode.interpreted()})
# block copies: CUDA kernels, and on the CPU the C copy (kernels/native.py)
gather_blocks = KernelOp("gather_blocks", reference.gather_blocks,
                         {"cuda": ops.gather_blocks, "cpu": native.gather_blocks},
                         case={"cuda": cases.gather_case, "cpu": cases.cpu_gather_case},
                         available={"cuda": available, "cpu": native.available})
scatter_blocks = KernelOp("scatter_blocks", reference.scatter_blocks,
                          {"cuda": ops.scatter_blocks, "cpu": native.scatter_blocks},
                          case={"cuda": cases.scatter_case, "cpu": cases.cpu_scatter_case},
                          available={"cuda": available, "cpu": native.available})
quantize_fp8 = KernelOp("quantize_fp8", reference.quantize_fp8, ops.quantize_fp8, case=cases.quantize_case,
                        available=available)
dequantize_fp8 = KernelOp("dequantize_fp8", reference.dequantize_fp8, ops.dequantize_fp8,
                          case=cases.dequantize_case, available=available)

paged_attention_int4_decode = KernelOp("paged_attention_int4_decode", reference.paged_attention_int4_decode,
                                       ops.paged_attention_int4_decode, case=cases.int4_case,
                                       compare=close(atol=2e-2, rtol=1e-2), available=available)



def ulps(n: int):
    """Outputs within n units in the last place of their dtype (relative, and absolute near 0):
    fused element-wise kernels sum in another order than torch and may round a value the other way."""
    def cmp(a: torch.Tensor, b: torch.Tensor) -> bool:
        eps = torch.finfo(a.dtype).eps * n
        return a.shape == b.shape and a.dtype == b.dtype and \
            bool(torch.allclose(a.float().cpu(), b.float().cpu(), atol=eps, rtol=eps))
    return cmp


def _fused(name: str, reference_fn, kernel, case):
    # Triton on CUDA, and on the CPU only under its interpreter (the tests' way to run it)
    # checked per dtype: a kernel that rounds differently in one dtype still serves the others
    return KernelOp(name, reference_fn, {"cuda": kernel, "cpu": kernel}, case=case, compare=ulps(4),
                    dtypes=triton_fused.DTYPES, available={"cuda": triton_fused.available,
                               "cpu": lambda: triton_fused.available() and triton_fused.interpreted()})


add_rms_norm = _fused("add_rms_norm", reference.add_rms_norm, triton_fused.add_rms_norm, cases.norm_case)
rotary = _fused("rotary", reference.rotary, triton_fused.rotary, cases.rotary_case)
silu_mul = _fused("silu_mul", reference.silu_mul, triton_fused.silu_mul, cases.silu_mul_case)

OPS = (reshape_and_cache, paged_attention_decode, paged_attention_decode_triton, gather_blocks, scatter_blocks,
       quantize_fp8, dequantize_fp8, paged_attention_int4_decode, add_rms_norm, rotary, silu_mul)


class DecodeAttention:
    """Paged decode attention, chosen per shape: the Triton kernel where it takes the inputs and
    passed its self-check on the device, else the device's own kernel where it passed (CUDA; on
    the CPU the C kernel), else the engine's batched torch decode. Same arguments as
    `paged_attention_decode`. Each choice is logged once per shape and listed by `choices()`.

    A kernel that raises for a shape (a compile that runs out of shared memory, a launch that
    fails) moves that shape alone to the next of these -- the Triton kernel's to the device's
    kernel or the batched decode, the device kernel's to the batched decode -- never to the
    per-sequence reference (which waits on the device and cannot be captured in a CUDA graph),
    and never for other shapes: the kernel stays checked and chosen for them."""

    def __init__(self):
        self._chosen: dict[tuple, str] = {}
        self._failed: dict[tuple, set[str]] = {}     # shape -> kernels that raised for it
        self._lock = threading.Lock()

    @staticmethod
    def _key(q, k_cache, v_cache) -> tuple:
        return (str(q.device), q.dtype, k_cache.dtype, tuple(k_cache.shape[1:]), q.shape[1],
                k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1)

    def choose(self, q, k_cache, v_cache) -> str:
        """"triton", "cuda" (or "c" on the CPU) or "torch: <why>" for these inputs."""
        key = self._key(q, k_cache, v_cache)
        name = self._chosen.get(key)
        if name is None:
            failed = self._failed.get(key, set())
            why = triton_decode.takes(q, k_cache, v_cache)
            if "triton" in failed:
                why = why or "raised for this shape"
            device = "cuda" if q.device.type == "cuda" else "c"
            if why is None and paged_attention_decode_triton.use_kernel(q.device):
                name = "triton"
            elif device not in failed and paged_attention_decode.use_kernel(q.device):
                name = device
            else:
                name = "torch: " + (why or paged_attention_decode_triton.status(q.device))
            with self._lock:
                self._chosen[key] = name
            log.info("tierd decode attention on %s for %s queries, %s cache of %s (block, kv heads, head "
                     "size), %d heads: %s", q.device, q.dtype, k_cache.dtype, tuple(k_cache.shape[1:]),
                     q.shape[1], name if why is None else f"{name} (Triton: {why})")
        return name

    def choices(self) -> dict[str, str]:
        with self._lock:
            return {" ".join(map(str, k[:5])): v for k, v in self._chosen.items()}

    def _drop(self, key: tuple, name: str, e: Exception, quiet: bool = False) -> None:
        """`name` raised for this shape (ValueError, `quiet`: inputs it does not take)."""
        with self._lock:
            self._failed.setdefault(key, set()).add(name)
            self._chosen.pop(key, None)
        (log.info if quiet else log.warning)(
            "tierd decode attention: the %s kernel raised %r for %s; this shape uses the next kernel",
            name, e, " ".join(map(str, key[:5])))

    def __call__(self, q, k_cache, v_cache, *args, **kwargs):
        while True:
            name = self.choose(q, k_cache, v_cache)
            if name == "triton":
                kernel = paged_attention_decode_triton.kernels[q.device.type]
            elif name in ("cuda", "c"):
                kernel = paged_attention_decode.kernels[q.device.type]
            else:
                break
            try:        # (both passed their self-checks on this device: called directly)
                return kernel(q, k_cache, v_cache, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- this shape moves to the next kernel
                self._drop(self._key(q, k_cache, v_cache), name, e, quiet=isinstance(e, ValueError))
        from tierd.engine.attention import decode_attention
        kwargs.pop("version", None)
        kwargs.pop("splits", None)
        if kwargs.get("max_seq_len") is None and len(args) > 1:     # (the batched decode needs it)
            kwargs["max_seq_len"] = int(args[1].max()) if args[1].numel() else 1
        return decode_attention(q, k_cache, v_cache, *args, **kwargs)


decode_attention = DecodeAttention()


def status(device: torch.device | str = "cuda") -> dict[str, str]:
    """op name -> "kernel", "reference: <why>" or "unchecked" for `device`."""
    device = torch.device(device)
    return {op.name: op.status(device) for op in OPS}


__all__ = ["KernelOp", "close", "same_bytes", "available", "status", "reference", "ops", "cases", "native",
           "triton_decode", "decode_attention", "DecodeAttention", *[op.name for op in OPS]]
