"""tierd's CUDA kernels (installed as `tierd.kernels`), each with its torch reference.

    reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0)
    paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)
    paged_attention_decode_triton(...)   (the same in Triton: split-KV, GQA-grouped; triton_decode.py)
    decode_attention(...)                (chooses per shape: Triton, the CUDA kernel or torch)
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
    # pytest). The name is Hugging Face's `kernels` package (transformers depends on it from
    # 5.25 and imports it while importing itself), so this folder must never stand in for it:
    # where that package is installed further down sys.path, it is loaded in this module's place
    # (an import returns what sys.modules holds once the module has run); where it is not, this
    # is an empty module with no file and no submodules, which transformers takes for a
    # namespace package that shadows no real install. Nothing of tierd's is imported here (tierd
    # may not even be installed where the checkout is on the path): its kernels are
    # `tierd.kernels` only.
    def _the_installed_kernels() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
        rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != checkout]
        spec = importlib.machinery.PathFinder.find_spec("kernels", rest)
        if spec is None or not spec.has_location or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        spec.loader.exec_module(module)

    _the_installed_kernels()
    del _the_installed_kernels, __file__, annotations
    __path__ = []
    __all__: list[str] = []
else:
    from .registry import *  # noqa: F403
    from .registry import OPS, __all__, status  # noqa: F401
