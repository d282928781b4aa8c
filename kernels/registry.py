"""The kernels' table: one `KernelOp` per kernel, and `status()` (the package re-exports them)."""

from __future__ import annotations

import torch

from . import cases, native, ops, reference
from .dispatch import KernelOp, close, same_bytes
from .loader import available

reshape_and_cache = KernelOp("reshape_and_cache", reference.reshape_and_cache, ops.reshape_and_cache,
                             case=cases.reshape_self_check, available=available)
paged_attention_decode = KernelOp("paged_attention_decode", reference.paged_attention_decode,
                                  {"cuda": ops.paged_attention_decode, "cpu": native.paged_attention_decode},
                                  case={"cuda": cases.attention_case, "cpu": cases.cpu_attention_case},
                                  compare=close(atol=1e-3), available={"cuda": available, "cpu": native.available})
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

OPS = (reshape_and_cache, paged_attention_decode, gather_blocks, scatter_blocks, quantize_fp8, dequantize_fp8,
       paged_attention_int4_decode)


def status(device: torch.device | str = "cuda") -> dict[str, str]:
    """op name -> "kernel", "reference: <why>" or "unchecked" for `device`."""
    device = torch.device(device)
    return {op.name: op.status(device) for op in OPS}


__all__ = ["KernelOp", "close", "same_bytes", "available", "status", "reference", "ops", "cases", "native",
           *[op.name for op in OPS]]
