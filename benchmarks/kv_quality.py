"""What KV compression costs in quality, memory and speed, beside full-precision (fp32) KV.

For each model (the parity configs' small random models, and the bench model) and each variant
(fp8 with calibrated scales, int4 with two group sizes, StreamingLLM sinks + window, block
eviction at 50% and 25% budgets), on the same prompt:

  mean / max |d logprob|   teacher-forced along the fp32 greedy path (each variant is fed the
                           fp32 run's tokens; d = its logprob of each minus fp32's), beside the
                           fp32 mean negative log-likelihood of those tokens
  argmax agreement         steps where the variant's top token is the fp32 one, of all steps
  KV bytes per token       bytes of KV the request holds at its last step, per token of context
  decode tokens/s          free-running greedy decode of a batch of the same prompts

Random weights: the quality figures are a floor check of the mechanics (a broken quantizer or
mask shows at once), not a task score; a trained model's sensitivity differs.

    python -m benchmarks.kv_quality [--json PATH] [--quick]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from tierd.engine import LLM, SamplingParams
from tierd.engine.random_model import bench_model_dir, write_random_model

from .common import Result, parse_args, report

SMALL = {   # the parity configs of tests/test_engine.py that every variant applies to
    "llama-gqa": dict(architecture="llama"),
    "qwen2-bias": dict(architecture="qwen2"),
    "head-dim-48": dict(architecture="llama", head_dim=48),
}
NOTE = "random weights: quality figures are a floor check of the mechanics, not a task score"


def variants(head_dim: int, context: int) -> dict[str, dict]:
    groups = [g for g in (16, 24, 32, 48, 64) if head_dim % g == 0][-2:]
    out = {"fp8": dict(kv_cache_dtype="fp8")}
    for g in groups:
        out[f"int4 g{g}"] = dict(kv_cache_dtype="int4", int4_group=g, block_size=32)
    out["sinks4+window"] = dict(attention_sinks=4, window=context // 2)
    out["evict 50%"] = dict(kv_budget=context // 2, attention_sinks=4)
    out["evict 25%"] = dict(kv_budget=context // 4, attention_sinks=4)
    return out


def teacher_forced(llm: LLM, prompt: list[int], ref_tokens: list[int]) -> tuple[list[float], list[int], float]:
    """(logprob of each reference token, the variant's top token at each step, KV bytes/token at
    the last step)."""
    params = SamplingParams(temperature=0, max_tokens=len(ref_tokens), logprobs=1, forced_token_ids=ref_tokens,
                            ignore_eos=True)
    rid = llm.add_request(prompt_token_ids=prompt, params=params)
    out, per_token = None, 0.0
    block_bytes = llm.kv_cache_stats()["kv_block_bytes"]
    while llm.has_unfinished_requests():
        seq = llm._seqs.get(rid)
        if seq is not None and seq.num_computed:   # what it holds for the context it has
            per_token = sum(b >= 0 for b in seq.block_table) * block_bytes / seq.num_computed
        for o in llm.step():
            out = o
    lps, tops = [], []
    for t, d in zip(ref_tokens, out.outputs[0].logprobs):
        lps.append(d[t].logprob)
        tops.append(min(d, key=lambda k: d[k].rank))
    return lps, tops, per_token


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == steps for o in outs)
    return len(prompts) * steps / dt


def bench_model(name: str, model_dir: Path, prompt_len: int, steps: int, batch: int) -> list[Result]:
    g = torch.Generator().manual_seed(0)
    ref_llm = LLM(model_dir, kv_cache_bytes="256MiB", max_model_len=prompt_len + steps + 1)
    vocab, hd = ref_llm.config.vocab_size, ref_llm.config.head_dim
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    ref = ref_llm.generate(prompt_token_ids=prompts[0], sampling_params=SamplingParams(
        temperature=0, max_tokens=steps, logprobs=0, ignore_eos=True))[0]
    ref_tokens = ref.outputs[0].token_ids
    ref_lps = [ref.outputs[0].logprobs[i][t].logprob for i, t in enumerate(ref_tokens)]
    nll = -sum(ref_lps) / len(ref_lps)
    ref_bytes = teacher_forced(ref_llm, prompts[0], ref_tokens)[2]
    ref_rate = decode_rate(ref_llm, prompts, steps)
    context = prompt_len + steps
    out = []
    for vname, kw in variants(hd, context).items():
        llm = LLM(model_dir, kv_cache_bytes="256MiB", max_model_len=context + 1, **kw)
        lps, tops, per_token = teacher_forced(llm, prompts[0], ref_tokens)
        diff = [abs(a - b) for a, b in zip(lps, ref_lps)]
        agree = sum(t == r for t, r in zip(tops, ref_tokens)) / len(ref_tokens)
        rate = decode_rate(LLM(model_dir, kv_cache_bytes="256MiB", max_model_len=context + 1, **kw), prompts, steps)
        p = {"model": name, "kv": vname, "prompt": prompt_len, "steps": steps}
        out += [Result("mean |d logprob| vs fp32", p, sum(diff) / len(diff), "nats", "fp32 mean NLL", nll,
                       higher_is_better=False, note=NOTE),
                Result("max |d logprob| vs fp32", p, max(diff), "nats", "fp32 mean NLL", nll,
                       higher_is_better=False, note=NOTE),
                Result("argmax agreement", p, agree, "of steps", "fp32", 1.0, note=NOTE),
                Result("KV bytes per token", p, per_token, "B", "fp32 KV", ref_bytes, higher_is_better=False),
                Result("decode tokens/s", p, rate, "tok/s", f"fp32 KV (batch {batch})", ref_rate)]
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    steps = 32 if args.quick else 128
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="tierd-bench-kvq-") as tmp:
        small = list(SMALL.items())[:1] if args.quick else list(SMALL.items())
        for name, cfg in small:
            d = write_random_model(Path(tmp) / name, seed=1, max_position_embeddings=1024, **cfg)
            results += bench_model(name, d, 160 if args.quick else 256, steps, 4 if args.quick else 8)
        results += bench_model("bench-150M", bench_model_dir(), 160 if args.quick else 256, steps,
                               2 if args.quick else 8)
    report("kv_quality", results, args.json)


if __name__ == "__main__":
    main()
