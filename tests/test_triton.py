"""The Triton paged decode kernel (kernels/triton_decode.py), checked on the CPU under Triton's
interpreter in a process of its own (the interpreter is chosen when Triton's kernels are
defined): against the torch reference over a grid of dtypes, GQA groups, head and block sizes,
context splits and cache layouts; what it declines; its self-check; the dispatcher's choice."""

from __future__ import annotations

import itertools
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


@pytest.mark.slow   # a minute of Triton's interpreter (make test runs it; make test-fast does not)
def test_the_triton_decode_kernel_matches_the_reference_under_the_interpreter(tmp_path):
    interpreted(tmp_path, "triton_check", "triton decode: OK", 600)


@pytest.mark.slow   # a minute of Triton's interpreter (make test runs it; make test-fast does not)
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


# -- the GPU path's risks, checked on the CPU -------------------------------------------------------
@pytest.mark.parametrize("smem", [48 * 1024, 101376, 166912, 232448])
def test_triton_decode_tiles_are_bounded_by_the_shared_memory(smem):
    """The Triton decode's tiles for (head size, block size, dtype, GQA group) fit the shared
    memory given: a page is read in the largest power-of-two tiles of tokens that fit (all of it
    where it fits), never fewer than 16 tokens; where even those do not fit, the kernel declines
    (None) and the dispatcher uses another."""
    from tierd.kernels import triton_decode as T
    for d, bs, dtype, group in itertools.product((64, 80, 128, 256), (16, 32, 64, 128, 256),
                                                 (torch.float32, torch.float16, torch.bfloat16), (1, 4, 8)):
        got = T.tiles(d, bs, dtype, smem, group)
        esize = torch.empty((), dtype=dtype).element_size()
        block_h, block_d = max(16, T._pow2(group)), max(16, T._pow2(d))
        if got is None:
            assert T.smem_needed(block_h, block_d, 16, esize, 1) > smem
            continue
        bh, bd, bn, stages = got
        assert (bh, bd) == (block_h, block_d) and stages in (1, 2)
        assert 16 <= bn <= bs and bs % bn == 0 and bn & (bn - 1) == 0
        assert T.smem_needed(bh, bd, bn, esize, stages) <= smem
        # the largest that fits: a page whole where it fits, else twice the tile would not
        if bn < bs:
            assert T.smem_needed(bh, bd, 2 * bn, esize, stages) > smem
        if stages == 1:
            assert T.smem_needed(bh, bd, 16, esize, 2) > smem
    # a float32 page of 128 tokens of head size 256 (512 KiB as whole tiles) is read in parts,
    # or (48 KiB, no device's opt-in maximum since Volta) not at all
    big = T.tiles(256, 128, torch.float32, smem)
    assert big is None if smem < 64 * 1024 else big[2] < 128
    # a float16 page of 16 tokens of head size 64 is read whole on any device
    assert T.tiles(64, 16, torch.float16, smem)[2] == 16


def test_tiles_grow_with_the_shared_memory():
    from tierd.kernels import triton_decode as T
    sizes = [40 * 1024, 64 * 1024, 101376, 232448]
    tiles = [T.tiles(128, 128, torch.float32, s, 4) for s in sizes]
    assert tiles[0] is not None and [t[2] * t[3] for t in tiles] == sorted(t[2] * t[3] for t in tiles)
    assert tiles[0][2] < tiles[-1][2]
    assert T.tiles(256, 16, torch.float32, 8 * 1024, 8) is None       # does not fit at all


def test_triton_decode_does_not_specialise_on_what_changes_per_step():
    """Arguments that vary from step to step (pages per context span, the block tables' width,
    the spans' strides, the number of spans) are in the kernels' do_not_specialize lists: Triton
    would otherwise compile a variant for a value of 1 and for multiples of 16 of each, while
    serving."""
    from tierd.kernels import triton_decode as T
    if T.triton is None or T.interpreted():
        pytest.skip("needs Triton's compiler front end (not its interpreter)")
    for kernel, varying in ((T._decode_split, T.SPLIT_VARYING), (T._decode_merge, T.MERGE_VARYING)):
        names = [p.name for p in kernel.params]
        assert set(varying) <= set(names), set(varying) - set(names)
        assert {p.name for p in kernel.params if p.do_not_specialize} == set(varying)
    assert {"pages_per_split", "stride_tb"} <= set(T.SPLIT_VARYING) and "n_splits" in T.MERGE_VARYING
    # and nothing else a step changes is an argument: the batch is the grid, lengths are a tensor
    assert "seq_len" not in {p.name for p in T._decode_split.params}


def test_the_fused_norm_uses_rsqrt_and_its_kernels_are_checked_per_dtype(caplog):
    """The fused RMSNorm computes tl.rsqrt (as torch.rsqrt), and the fused ops are self-checked
    per dtype: a kernel that rounds differently in float32 alone serves float16 still, float32
    runs the reference."""
    import inspect

    from tierd.kernels import KernelOp, cases, reference, triton_fused
    from tierd.kernels.registry import ulps
    if triton_fused.triton is not None:
        src = inspect.getsource(triton_fused)
        assert "tl.rsqrt(" in src and "1.0 / tl.sqrt" not in src
    calls = []

    def off_in_float32(x, weight, eps, residual=None):    # a stand-in kernel: float32 off by 1%
        calls.append(x.dtype)
        out = reference.add_rms_norm(x, weight, eps, residual)
        return out * 1.01 if x.dtype == torch.float32 else out

    op = KernelOp("norm", reference.add_rms_norm, off_in_float32, case=cases.norm_case, compare=ulps(4),
                  devices=("cpu",), dtypes=(torch.float16, torch.float32))
    cpu = torch.device("cpu")
    x, w = torch.randn(3, 96), torch.ones(96)
    torch.testing.assert_close(op(x, w, 1e-5), reference.add_rms_norm(x, w, 1e-5))
    assert op.status(cpu, torch.float32).startswith("reference: self-check failed")
    assert op.status(cpu, torch.float16) == "unchecked"        # checked at its first use
    h = x.half()
    calls.clear()
    assert torch.equal(op(h, w.half(), 1e-5), reference.add_rms_norm(h, w.half(), 1e-5))
    assert op.status(cpu, torch.float16) == "kernel" and calls[-1] == torch.float16   # the kernel served it
    assert not op.use_kernel(cpu) and "float32: reference" in op.status(cpu)
    # the registry's fused ops are made so
    import tierd.kernels as K
    assert all(o.dtypes == triton_fused.DTYPES for o in (K.add_rms_norm, K.rotary, K.silu_mul))


def test_graph_buckets_share_one_logits_buffer_and_are_captured_off_the_serving_path(tmp_path):
    """Every bucket's step writes its logits into one buffer (rows 0..B-1): no bucket keeps
    logits of its own. A step whose bucket has no graph yet captures nothing: it runs the
    forward (None) and queues the bucket for `capture_pending` (the engine's idle time), and
    graphs stay on."""
    from tierd.engine import LLM
    from tierd.engine.graphs import DecodeGraphs
    from tierd.engine.random_model import write_random_model
    d = write_random_model(tmp_path / "llama", seed=0, num_hidden_layers=1)
    llm = LLM(d, kv_cache_bytes="2MiB", cuda_graphs=True, max_num_seqs=4)
    g = llm.graphs
    step = ([3], [4], [-1], [[0, 1]], [5])
    a = g.run(*step)
    b = g.run([3, 4, 5], [4, 6, 2], [-1] * 3, [[0, 1], [2], [3]], [5, 7, 3])
    assert g.bucket(1, 5) != g.bucket(3, 7)
    assert a.data_ptr() == b.data_ptr() == g.logits_buffer().data_ptr()
    assert g.logits_buffer().shape == (4, llm.config.vocab_size) and g.eager_steps == 2
    # the same step's logits through the forward
    seqs = [(0, 1, 5, torch.tensor([0, 1])), (1, 1, 7, torch.tensor([2])), (2, 1, 3, torch.tensor([3]))]
    want = llm.model.forward(torch.tensor([3, 4, 5]), torch.tensor([4, 6, 2]), torch.tensor([-1, -1, -1]), seqs,
                             llm.kv_caches, torch.arange(3), llm.kv_scales)
    torch.testing.assert_close(b, want, atol=1e-4, rtol=1e-4)
    # with capture (what CUDA runs): a step never captures; its bucket waits for idle time
    cap = DecodeGraphs(llm.model, llm.kv_caches, llm.kv_scales, block_size=llm.block_size, max_num_seqs=4,
                       max_model_len=llm.max_model_len, capture=True)
    assert cap.run(*step) is None
    assert cap.pending == {cap.bucket(1, 5)} and cap.enabled and cap.stats()["graphs"] == 0, cap.stats()
    assert cap.run(*step) is None and len(cap.pending) == 1
    # the engine captures them when idle (here, where CUDA graphs cannot be made, that turns them off)
    llm.graphs = cap
    llm.step()
    assert not cap.pending and cap.stats()["graphs"] == 0


def test_the_fused_sdpa_reference_is_the_fused_kernel_over_4d_tensors_without_a_mask():
    """benchmarks/gpu_kernels.py's peer: torch's SDPA over dense KV in (B, heads, 1, d) and
    (B, kv_heads, ctx, d), no mask (every sequence at the full context), through the fused
    kernel (on the CPU its flash kernel; on CUDA only fused backends may run), equal to the
    paged reference."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tierd.kernels import cases, reference

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append((func.overloadpacket.__name__, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    for heads, kvh in ((8, 2), (4, 4)):
        a = cases.decode_inputs("cpu", batch=3, heads=heads, kv_heads=kvh, head_dim=64, block_size=16,
                                num_blocks=40, max_len=70, dtype=torch.float32, full=True)
        assert (a["seq_lens"] == 70).all()
        k, v = reference.dense_kv(a["k_cache"], a["v_cache"], a["block_tables"], 70)
        assert k.shape == (3, kvh, 70, 64) and k.is_contiguous() and not k.isnan().any()
        with Seen() as seen:
            got = reference.fused_sdpa_decode(a["q"], k, v, a["scale"])
        attn = [c for c in seen.calls if "attention" in c[0]]
        assert [c[0] for c in attn] == ["_scaled_dot_product_flash_attention_for_cpu"], attn
        _, args, kwargs = attn[0]
        assert all(t.dim() == 4 for t in args[:3]) and args[0].shape == (3, heads, 1, 64)
        assert "attn_mask" not in kwargs and not kwargs.get("is_causal") and len(args) == 3
        want = reference.paged_attention_decode(a["q"], a["k_cache"], a["v_cache"], a["block_tables"],
                                                a["seq_lens"], a["scale"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_triton_decode_over_a_grid_of_shapes(dtype):
    """The Triton decode kernel on the GPU over the grid of shapes (tiles bounded by this
    device's shared memory: head size 256 with pages of 128 tokens included), against the
    reference; each shape compiles and runs (no fallback here: the kernel itself)."""
    from tierd.kernels import cases, triton_decode as T
    if not T.available():
        pytest.skip("triton is not installed")
    dev = torch.device("cuda")
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    shapes = cases.triton_decode_grid((dtype,), every=3)
    for i, shape in enumerate(shapes):
        _, heads, kvh, d, bs, _, _ = shape
        assert T.tiles(d, bs, dtype, T.smem_per_block(dev), heads // kvh) is not None, shape
        got, want = cases.run_triton_grid_shape(dev, shape, T.paged_attention_decode, max_len=700, seed=i)
        diff = ((got.float() - want.float()).abs() / (tol * (1 + want.float().abs()))).max().item()
        assert got.dtype == dtype and not got.isnan().any() and diff <= 1, (shape, diff)
    torch.cuda.synchronize()
