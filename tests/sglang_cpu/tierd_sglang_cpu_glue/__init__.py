"""Test-only SGLang plugin: runs SGLang's hierarchical cache on a CPU (see ../README.md).

Loaded by SGLang in every one of its processes through the `sglang.srt.plugins` entry point.
Three changes, each one a thing a CUDA build has and a CPU-only machine does not:
- the host KV pool is allocated unpinned (pinning registers memory with the CUDA driver);
- the `direct` I/O backend's device<->host copy, defined by SGLang only for GPUs and NPUs, is a
  torch index copy per layer;
- tensor-parallel groups use no NCCL communicator (gloo only).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tierd_test_sglang_cpu_glue")


def _unpinned(original, self, *args, **kwargs):
    kwargs["pin_memory"] = False
    return original(self, *args, **kwargs)


def _no_nccl(original, *args, **kwargs):
    kwargs["use_pynccl"] = False
    kwargs["use_custom_allreduce"] = False
    return original(*args, **kwargs)


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """dst[dst_indices] = src[src_indices] for each (src, dst) layer pair (token-major rows)."""
    src_indices = src_indices.to(src_layers[0].device)
    dst_indices = dst_indices.to(dst_layers[0].device)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices].to(dst.device)


def plugin() -> None:
    if os.environ.get("TIERD_TEST_SGLANG_CPU_GLUE", "1") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__", _unpinned,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group", _no_nccl,
                          HookType.AROUND)
    import sglang.srt.mem_cache.pool_host.mha as mha
    mha.transfer_kv_direct = transfer_kv_direct
    log.info("tierd test glue: SGLang's host cache on a CPU (unpinned pool, torch copies, no NCCL)")
