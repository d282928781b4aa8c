"""Run under Triton's interpreter (TRITON_INTERPRET=1, on the CPU) by tests/test_triton.py: the
Triton paged decode kernel against the torch reference over a grid of shapes, its self-check,
and the dispatcher's choice. Prints one line per check and "triton decode: OK" at the end."""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    import tierd.kernels as K
    from tierd.kernels import cases, reference, triton_decode as T

    worst = 0.0
    checked = 0
    cpu = torch.device("cpu")
    smem = T.smem_per_block(cpu)
    subtiled = 0
    # a part of the grid the GPU test runs whole (float32 and float16: the interpreter computes
    # bfloat16 wrongly), every value of each axis, and pages read in tiles smaller than a page
    for i, shape in enumerate(cases.triton_decode_grid((torch.float32, torch.float16), every=11)):
        dtype, heads, kvh, d, bs, splits, layout = shape
        got, want = cases.run_triton_grid_shape("cpu", shape, T.paged_attention_decode, max_len=150, seed=i)
        # (float16: the output's own rounding, half a unit in the last place, and the kernel's
        # float16 probabilities in P V)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        diff = ((got.float() - want.float()).abs() / (tol * (1 + want.float().abs()))).max().item()
        assert got.dtype == dtype and not got.isnan().any(), shape
        assert diff <= 1, f"{shape}: {diff}"
        worst = max(worst, diff)
        checked += 1
        subtiled += T.tiles(d, bs, dtype, smem, heads // kvh)[2] < bs
    assert subtiled, "no shape read a page in several tiles"
    print(f"grid: {checked} shapes ({subtiled} reading pages in several tiles), worst difference "
          f"{worst:.2f} of its tolerance")

    # what it declines, and why (the dispatcher then uses another kernel)
    q = torch.zeros(1, 8, 64)
    c = torch.zeros(4, 16, 2, 64)
    assert "cache" in T.takes(q, c.to(torch.float8_e4m3fn), c.to(torch.float8_e4m3fn))
    assert "block size 8" in T.takes(q, torch.zeros(4, 8, 2, 64), torch.zeros(4, 8, 2, 64))
    assert "head size 512" in T.takes(torch.zeros(1, 8, 512), torch.zeros(4, 16, 2, 512), torch.zeros(4, 16, 2, 512))
    assert T.takes(q, c, c) is None
    print("declines: fp8 caches, block sizes below 16, head sizes past 256")

    # its self-check passes, and the dispatcher chooses it where it takes the inputs
    assert K.paged_attention_decode_triton.use_kernel(torch.device("cpu")), \
        K.paged_attention_decode_triton.status(torch.device("cpu"))
    a = cases.decode_inputs("cpu", batch=2, heads=8, kv_heads=2, head_dim=64, block_size=16, num_blocks=40,
                            max_len=100, dtype=torch.float32, seed=7)
    args = (a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"], 1.0, 1.0)
    assert K.decode_attention.choose(a["q"], a["k_cache"], a["v_cache"]) == "triton"
    got = K.decode_attention(*args, max_seq_len=100)
    torch.testing.assert_close(got, reference.paged_attention_decode(*args), atol=1e-5, rtol=1e-5)
    small = cases.decode_inputs("cpu", batch=2, heads=8, kv_heads=2, head_dim=64, block_size=8, num_blocks=40,
                                max_len=50, dtype=torch.float32, seed=8)
    name = K.decode_attention.choose(small["q"], small["k_cache"], small["v_cache"])
    assert name != "triton", name
    sargs = (small["q"], small["k_cache"], small["v_cache"], small["block_tables"], small["seq_lens"],
             small["scale"], 1.0, 1.0)
    torch.testing.assert_close(K.decode_attention(*sargs, max_seq_len=50),
                               reference.paged_attention_decode(*sargs), atol=1e-5, rtol=1e-5)
    print(f"dispatcher: {K.decode_attention.choices()}")
    fallback_per_shape(K, T, cases, reference)
    print("triton decode: OK")
    return 0


def fallback_per_shape(K, T, cases, reference) -> None:
    """A Triton launch that raises for one shape (here: head size 80, injected at the launch
    boundary) moves that shape alone to the next kernel -- the C kernel, or the engine's
    batched decode -- never to the per-sequence reference; the Triton kernel stays checked and
    chosen for the other shapes; and the engine's static decode step (what a CUDA graph
    captures) keeps running, graphs on."""
    from tierd.engine import LLM, SamplingParams, attention
    from tierd.engine.random_model import write_random_model
    cpu = torch.device("cpu")
    launch, launched = T._launch, []
    failing = {80, 32}       # head sizes whose Triton launch raises (32: the engine's model below)

    def injected(kernel, grid, *args, **kwargs):
        if kwargs.get("D") in failing:
            raise RuntimeError("out of resource: shared memory (injected)")
        launched.append(kwargs.get("D"))
        return launch(kernel, grid, *args, **kwargs)

    T._launch = injected
    try:
        def inputs(d, seed):
            a = cases.decode_inputs("cpu", batch=3, heads=8, kv_heads=2, head_dim=d, block_size=16,
                                    num_blocks=60, max_len=90, dtype=torch.float32, seed=seed)
            return (a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], a["scale"], 1.0, 1.0)
        bad, good = inputs(80, 21), inputs(64, 22)
        out = K.decode_attention(*bad, max_seq_len=90)
        name = K.decode_attention.choose(*bad[:3])
        assert name == "c" or name.startswith("torch: "), name
        # bit for bit what that kernel gives (not the per-sequence reference's loop)
        if name == "c":
            want = K.paged_attention_decode.kernels["cpu"](*bad, max_seq_len=90)
        else:
            want = attention.decode_attention(*bad, max_seq_len=90)
        assert torch.equal(out, want), name
        torch.testing.assert_close(out, reference.paged_attention_decode(*bad), atol=1e-5, rtol=1e-5)
        launched.clear()
        torch.testing.assert_close(K.decode_attention(*good, max_seq_len=90), reference.paged_attention_decode(*good),
                                   atol=1e-5, rtol=1e-5)
        assert K.decode_attention.choose(*good[:3]) == "triton" and set(launched) == {64}, launched
        assert K.paged_attention_decode_triton.status(cpu) == "kernel", K.paged_attention_decode_triton.status(cpu)
        print(f"a Triton launch raising for one shape: that shape runs {name!r}, the others Triton")

        # the engine: decode steps through the static buffers with the model's shape failing in Triton
        tmp = tempfile.mkdtemp()
        d = write_random_model(f"{tmp}/llama", seed=0, num_hidden_layers=1)
        prompts = [[5, 9, 13, 200, 7], list(range(30, 47))]
        params = SamplingParams(temperature=0, max_tokens=4)
        want = LLM(d, kv_cache_bytes="2MiB").generate(prompt_token_ids=prompts, sampling_params=params)
        llm = LLM(d, kv_cache_bytes="2MiB", cuda_graphs=True)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
        stats = llm.graphs.stats()
        assert llm.graphs.enabled and stats["eager_steps"] > 0, stats
        chosen = [v for k, v in K.decode_attention.choices().items() if ", 32) " in k]
        assert chosen and all(v == "c" or v.startswith("torch: ") for v in chosen), K.decode_attention.choices()
        print(f"the engine's static decode step with its shape failing in Triton: {chosen}, graphs {stats['state']}")
    finally:
        T._launch = launch


if __name__ == "__main__":
    sys.exit(main())
