"""The Triton paged decode kernel (kernels/triton_decode.py), checked on the CPU under Triton's
interpreter in a process of its own (the interpreter is chosen when Triton's kernels are
defined): against the torch reference over a grid of dtypes, GQA groups, head and block sizes,
context splits and cache layouts; what it declines; its self-check; the dispatcher's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from .daemon import ROOT


def interpreted(tmp_path, module: str, done: str, timeout: int) -> None:
    """Run tests.<module> in a process under Triton's interpreter; it must print `done`."""
    pytest.importorskip("triton", reason="triton is installed by `make venv` (the test extra)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path),
               TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    r = subprocess.run([sys.executable, "-m", f"tests.{module}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert done in r.stdout
    print(r.stdout, file=sys.stderr)


def test_the_triton_decode_kernel_matches_the_reference_under_the_interpreter(tmp_path):
    interpreted(tmp_path, "triton_check", "triton decode: OK", 600)


def test_the_gpu_op_set_and_the_static_decode_step_under_the_interpreter(tmp_path):
    """The engine with what a GPU runs (fused Triton norm, rotary and gate kernels, the Triton
    decode kernel, decode steps through the static buffers a CUDA graph captures) gives the
    torch path's greedy tokens, and one decode step's launches are a constant per layer (at
    most 11, against about 40 for torch's element-wise ops), the same for any batch and
    context: tests/step_check.py, in a process under the interpreter."""
    pytest.importorskip("transformers")
    interpreted(tmp_path, "step_check", "step check: OK", 900)


def test_without_a_gpu_or_the_interpreter_the_triton_kernel_is_never_chosen():
    """Here (no CUDA, no interpreter) the dispatcher says why it does not choose Triton, and
    the engine's CPU path is what runs."""
    import tierd.kernels as K
    from tierd.kernels import cases, reference, triton_decode
    if triton_decode.interpreted():
        pytest.skip("this process runs Triton's interpreter")
    a = cases.decode_inputs("cpu", batch=2, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=40,
                            max_len=60, dtype=torch.float32, seed=1)
    assert "cpu tensors" in (triton_decode.takes(a["q"], a["k_cache"], a["v_cache"]) or "") or \
        triton_decode.triton is None
    d = K.DecodeAttention()
    assert d.choose(a["q"], a["k_cache"], a["v_cache"]) != "triton"
    args = (a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"], 1.0, 1.0)
    torch.testing.assert_close(d(*args, max_seq_len=60), reference.paged_attention_decode(*args),
                               atol=1e-5, rtol=1e-5)
    assert not K.paged_attention_decode_triton.use_kernel(torch.device("cpu"))
    # the GPU self-check's case builds and runs (here with the reference)
    outs = cases.triton_attention_case(torch.device("cpu"), reference.paged_attention_decode)
    assert len(outs) == 4 and all(not o.isnan().any() for o in outs)
