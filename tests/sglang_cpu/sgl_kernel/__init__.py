"""Test-only stand-in for SGLang's kernel package (see ../README.md).

SGLang imports names from `sgl_kernel` at module load on every platform; on a CPU without AMX the
dense `torch_native` path calls one of them. That one is written in torch below; any other name
resolves to a stub that raises when called, so a test that strays onto a real kernel fails.
"""

from __future__ import annotations

__version__ = "0.0.0+tierd-test-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                  out_cache_loc, pool_len):
    """For request i of the batch: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i] - start[i] entries of out_cache_loc."""
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    at = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def _stub(name):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in the test-only CPU stand-in")
    missing.__name__ = name
    return missing


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _stub(name)

