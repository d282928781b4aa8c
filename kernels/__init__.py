"""tierd's CUDA kernels (installed as `tierd.kernels`), each with its torch reference.

    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0)
    paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    gather_blocks(k_caches, v_caches, block_ids, slots) / scatter_blocks(...)
    quantize_fp8(x, scale) / dequantize_fp8(x, scale, dtype)
    paged_attention_int4_decode(q, k_q, k_min, k_step, v_q, v_min, v_step, k_own, block_tables,
                                seq_lens, scale)     (the int4 cache of tierd.engine.int4)

Each is a `KernelOp`: on a CUDA device with CuPy it compiles the kernel (NVRTC, once per
architecture), checks it against the reference on random data at first use, and runs it only if
they agree; on CPU, without CuPy, or after a failed check it runs the reference. `status()` says
which runs where.
"""

from __future__ import annotations

if __name__ == "kernels":
    # This folder, imported under its bare name: a checkout's root is on sys.path (`python -c`,
    # pytest). Hugging Face's `kernels` package has that name, and transformers looks for it with
    # importlib.util.find_spec, then its dist-info version, and failing both imports it and takes
    # a module with neither `__version__` nor `__file__` for a namespace package that shadows no
    # real install. So: no file, no submodules, nothing imported (no torch, no tierd, which may
    # not even be installed where the checkout is on the path). tierd's kernels are
    # `tierd.kernels` only.
    del __file__, annotations
    __path__ = []
    __all__: list[str] = []
else:
    from .registry import *  # noqa: F403
    from .registry import OPS, __all__, status  # noqa: F401
