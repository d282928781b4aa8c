"""KV compression in the bundled engine: the int4 cache (KIVI-style groups, full-precision
residual of a partial block) stays within its stated error, keeps the engine's own guarantees
(batching, preemption and prefix hits give the outputs of a request run alone), frees what it
holds, and stays close to full precision."""

import pytest
import torch

pytest.importorskip("transformers")

from tierd.engine import LLM, SamplingParams  # noqa: E402
from tierd.engine.int4 import Int4LayerCache, pack, unpack  # noqa: E402
from tierd.engine.random_model import write_random_model  # noqa: E402
from tierd.errors import ConfigError  # noqa: E402

from .test_engine import teacher_forced  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("m") / "llama", seed=2, head_dim=64)


def lps(out):
    c = out.outputs[0]
    return [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def test_nibbles_pack_and_unpack_along_any_axis():
    q = torch.randint(0, 16, (6, 4, 8), dtype=torch.uint8)
    for dim in (0, 1, 2, -1):
        p = pack(q, dim)
        assert p.shape[dim] == q.shape[dim] // 2 and torch.equal(unpack(p, dim), q)
    assert pack(torch.tensor([[1, 15]], dtype=torch.uint8), -1).item() == 0xF1    # low nibble first


@pytest.mark.parametrize("group", [16, 32, 64])
def test_int4_cache_round_trip_within_half_a_step(group):
    torch.manual_seed(group)
    bs, h, d = 16, 2, 64
    c = Int4LayerCache(6, bs, h, d, group, torch.float32)
    n = 3 * bs + 5                                   # three full blocks and a partial one
    k = torch.randn(n, h, d) * torch.rand(1, h, d) * 4 + torch.randn(1, h, d)
    v = torch.randn(n, h, d) * 3
    table = torch.tensor([4, 1, 5, 0])
    slots = (table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(4))[:n]
    for lo, hi in ((0, 7), (7, 30), (30, n)):       # in token order, in uneven chunks (prefill + decode)
        c.write(k[lo:hi], v[lo:hi], slots[lo:hi])
    gk, own, gv = c.gather(table, n, torch.float32)
    assert torch.equal(own[bs:], k[bs:])             # blocks 2 and 3 were filled by the last write
    assert torch.equal(own[:bs], gk[:bs])
    full = 3 * bs
    kb = k[:full].reshape(3, bs, h, d)              # keys: per channel over a block's tokens
    kstep = (kb.amax(1, keepdim=True) - kb.amin(1, keepdim=True)) / 15
    assert ((gk[:full].reshape(3, bs, h, d) - kb).abs() <= kstep / 2 * 1.01 + 2e-3 * kb.abs()).all()
    assert torch.equal(gk[full:], k[full:])           # the partial block's keys wait in full precision
    vg = v.reshape(n, h, d // group, group)          # values: per token over groups of channels
    vstep = (vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / 15
    assert ((gv.reshape(n, h, d // group, group) - vg).abs() <= vstep / 2 * 1.01 + 2e-3 * vg.abs()).all()
    assert len(c.residual) == 1 and sorted(c.completed) == [1, 5]
    for b in (0, 1, 5):
        c.forget(b)
    assert not c.residual and not c.completed


def test_int4_kv_is_smaller_and_close_to_full_precision(model_dir):
    """Teacher-forced along the full-precision greedy path: the int4 logprob of each reference
    token stays within 0.3 (mean 0.15), and the argmax agrees at >= 12 of 16 steps."""
    prompt = list(range(20, 100))
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
    ref_llm = LLM(model_dir, kv_cache_bytes="4MiB")
    ref = ref_llm.generate(prompt_token_ids=prompt, sampling_params=greedy)[0]
    toks, ref_lps = ref.outputs[0].token_ids, lps(ref)
    q = LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int4", block_size=32)
    fp16_bytes = q.config.num_layers * 2 * q.config.num_kv_heads * q.config.head_dim * 2 * 32
    assert q.kv_cache_stats()["kv_block_bytes"] < fp16_bytes / 2.5     # vs the same block in fp16
    diffs, agree = teacher_forced(q, prompt, toks, ref_lps)
    assert max(diffs) < 0.3 and sum(diffs) / 16 < 0.15 and agree >= 12, (diffs, agree)
    assert max(diffs) > 0                            # it is quantized


def test_int4_batching_preemption_and_prefix_hits_give_the_alone_outputs(model_dir):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 90, (8,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    alone = LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int4", enable_prefix_caching=False)
    ref = [alone.generate(prompt_token_ids=p, sampling_params=params)[0] for p in prompts]
    per_block = alone.kv_cache_stats()["kv_block_bytes"]
    small = LLM(model_dir, kv_cache_bytes=14 * per_block, kv_cache_dtype="int4", max_num_batched_tokens=64,
                enable_prefix_caching=False)
    outs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert small.kv_cache_stats()["preemptions"] > 0
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(lps(a), lps(b))) < 1e-4
    assert all(not c.residual for c in small.kv_caches)       # every partial block's residual freed
    cached = LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int4")
    cold = cached.generate(prompt_token_ids=prompts[0] * 2, sampling_params=params)[0]
    warm = cached.generate(prompt_token_ids=prompts[0] * 2, sampling_params=params)[0]
    assert warm.num_cached_tokens > 0 and warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert max(abs(x - y) for x, y in zip(lps(warm), lps(cold))) < 1e-4


def test_int4_refuses_what_it_cannot_do(model_dir):
    with pytest.raises(ConfigError, match="int4_group 48"):
        LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int4", int4_group=48)
    with pytest.raises(ConfigError, match="kv_store with an int4"):
        LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int4", kv_store="embedded://")
    with pytest.raises(ConfigError, match="'int4'"):
        LLM(model_dir, kv_cache_bytes="4MiB", kv_cache_dtype="int2")


# -- StreamingLLM -----------------------------------------------------------------------------------
def test_streaming_attention_is_attention_over_sinks_and_window_at_their_cache_positions():
    """Against the paper's formulation, built naively: keep the first S and the last W tokens,
    give them positions 0..S+W-1 in that order, rope keys and query there, attend. tierd caches
    keys roped at their own positions and moves only the sinks (by rotating the query)."""
    from tierd.engine.attention import AttentionMetadata, prefill_attention, rotate, streaming_attention
    torch.manual_seed(0)
    S, W, bs, h, kvh, d, ctx, n = 3, 20, 8, 4, 2, 16, 71, 5            # 5 queries: positions 66..70
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    q_raw, k_raw, v = torch.randn(n, h, d), torch.randn(ctx, kvh, d), torch.randn(ctx, kvh, d)
    nb = (ctx + bs - 1) // bs
    table = torch.arange(nb)
    table[1:(ctx - n - W) // bs] = -1                                 # the middle was freed
    k_cache, v_cache = torch.zeros(nb, bs, kvh, d), torch.zeros(nb, bs, kvh, d)
    k_cache.view(-1, kvh, d)[:ctx] = rotate(k_raw, torch.arange(ctx), inv_freq)
    v_cache.view(-1, kvh, d)[:ctx] = v
    qpos = torch.arange(ctx - n, ctx)
    meta = AttentionMetadata([(0, n, ctx, table)], bs)
    got = streaming_attention(rotate(q_raw, qpos, inv_freq), k_cache, v_cache, meta, d ** -0.5, S, W, inv_freq)
    for i, p in enumerate(qpos.tolist()):
        kept = list(range(S)) + list(range(max(S, p - W + 1), p + 1))
        cache_pos = torch.arange(len(kept))
        k = rotate(k_raw[kept], cache_pos, inv_freq)
        q = rotate(q_raw[i:i + 1], cache_pos[-1:], inv_freq)
        want = prefill_attention(q, k, v[kept], len(kept) - 1, d ** -0.5)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-4)


def test_streaming_llm_generates_4x_the_context_in_fixed_kv(tmp_path):
    d = write_random_model(tmp_path / "short", seed=4, max_position_embeddings=128)
    prompt = list(range(3, 23))
    plain = LLM(d, kv_cache_bytes="4MiB")
    stream = LLM(d, kv_cache_bytes="4MiB", attention_sinks=4, window=32, block_size=16)
    g = SamplingParams(temperature=0, max_tokens=14, logprobs=0)      # within sinks + window: unchanged
    a, b = (x.generate(prompt_token_ids=prompt, sampling_params=g)[0] for x in (plain, stream))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert max(abs(x - y) for x, y in zip(lps(a), lps(b))) < 1e-4
    with pytest.raises(ConfigError, match="exceeds the model's context"):
        plain.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=512))
    stream.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0.8, seed=3, max_tokens=4 * 128))
    peak, outs = 0, []
    while stream.has_unfinished_requests():
        outs += stream.step()
        peak = max(peak, stream.kv_cache_stats()["blocks_allocated"])
    toks = outs[0].outputs[0].token_ids
    assert len(toks) == 512 and outs[0].outputs[0].finish_reason == "length"
    assert peak <= 1 + 32 // 16 + 1                 # the sinks' block, the window's, the one being written
    assert len(set(toks[-128:])) > 16                # still generating, not stuck on one token
    assert stream.namespace.id != plain.namespace.id
    with pytest.raises(ConfigError, match="exceed the model's context"):
        LLM(d, kv_cache_bytes="4MiB", attention_sinks=4, window=128)
    with pytest.raises(ConfigError, match="needs window"):
        LLM(d, kv_cache_bytes="4MiB", attention_sinks=4)


# -- block eviction under a KV budget -------------------------------------------------------------
def test_eviction_frees_the_blocks_with_the_least_attention_mass_never_sinks_or_the_last(model_dir):
    from tierd.engine.sequence import Sequence
    llm = LLM(model_dir, kv_cache_bytes="4MiB", block_size=16, kv_budget=64, attention_sinks=4)
    seq = Sequence("s", None, list(range(100)), SamplingParams())
    llm.block_manager.allocate(seq, 100)                       # 7 blocks, over a budget of 4
    free_before = llm.block_manager.num_free
    table = list(seq.block_table)
    mass = torch.tensor([0.0, 5.0, 0.5, 9.0, 0.1, 7.0, 0.0], dtype=torch.float64)
    llm._evict(seq, 1, mass)
    # 7 held, budget 4: three go, lowest mean mass first among blocks 1..5 (0: sinks, 6: last)
    assert [i for i, b in enumerate(seq.block_table) if b < 0] == [1, 2, 4]
    assert seq.block_table[0] == table[0] and seq.block_table[6] == table[6]
    assert llm.block_manager.num_free == free_before + 3
    llm._evict(seq, 1, torch.zeros(7, dtype=torch.float64))   # within budget now: nothing more
    assert sum(b >= 0 for b in seq.block_table) == 4
    with pytest.raises(ConfigError, match="fewer blocks"):
        LLM(model_dir, kv_cache_bytes="4MiB", block_size=16, kv_budget=32, attention_sinks=20)


def test_eviction_keeps_every_sequence_within_its_budget_and_changes_nothing_below_it(model_dir):
    prompt = list(range(3, 131))                               # 8 blocks of 16
    g = SamplingParams(temperature=0, max_tokens=40, logprobs=0)
    ref = LLM(model_dir, kv_cache_bytes="4MiB").generate(prompt_token_ids=prompt, sampling_params=g)[0]
    roomy = LLM(model_dir, kv_cache_bytes="4MiB", kv_budget=512)
    same = roomy.generate(prompt_token_ids=prompt, sampling_params=g)[0]
    assert same.outputs[0].token_ids == ref.outputs[0].token_ids and roomy.kv_cache_stats()["evicted_blocks"] == 0
    llm = LLM(model_dir, kv_cache_bytes="4MiB", kv_budget=64, attention_sinks=4)
    for p in (prompt, prompt[:90]):
        llm.add_request(prompt_token_ids=p, params=g)
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
        for seq in llm.scheduler.running:
            assert sum(b >= 0 for b in seq.block_table) <= 4
            assert seq.block_table[0] >= 0 and seq.block_table[-1] >= 0
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.kv_cache_stats()["evicted_blocks"] > 0
    assert llm.namespace.id != roomy.namespace.id
