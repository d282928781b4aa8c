"""Generated tokens/s of the bundled engine against transformers `generate`, same model, same
prompts, same run: batch 1, 8 and 32 (goal: >= 2x at batch 32).

The bench model (random weights, about 150M parameters: 8 layers, hidden 1024, 16/4 heads) in
fp32 on the CPU; greedy decoding. Requests have mixed prompt and output lengths (uniform draws,
printed in the params): the engine batches them continuously and stops each at its own length;
transformers pads the prompts (left) and decodes the batch until the longest output is done.
Throughput counts the tokens the requests asked for, on both sides. A uniform batch (equal
lengths, where static batching loses nothing) is reported too.

    python -m benchmarks.engine_throughput [--json PATH] [--quick]
"""

from __future__ import annotations

import time

import torch

from tierd.engine import LLM, SamplingParams
from tierd.engine.random_model import bench_model_dir

from .common import Result, parse_args, report


def requests_for(batch: int, prompt_range: tuple[int, int], out_range: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(prompt_range[0], prompt_range[1] + 1, (batch,), generator=g).tolist()
    olens = torch.randint(out_range[0], out_range[1] + 1, (batch,), generator=g).tolist()
    return [torch.randint(10, 32000, (n,), generator=g).tolist() for n in plens], olens


def run_ours(llm: LLM, prompts, outs: list[int]) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    t0 = time.perf_counter()
    res = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in res] == outs
    return sum(outs) / dt


def run_hf(model, prompts, outs: list[int]) -> float:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    n_new = max(outs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + n_new
    return sum(outs) / dt


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    import transformers
    d = bench_model_dir()
    prompt_range, out_range = ((16, 96), (4, 24)) if args.quick else ((32, 256), (8, 128))
    llm = LLM(d, kv_cache_bytes="1GiB", max_num_seqs=64, max_num_batched_tokens=4096)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    results = []
    warm = requests_for(2, (8, 16), (2, 4), 99)
    run_ours(llm, *warm)
    run_hf(hf, *warm)
    for batch in (1, 8, 32):
        prompts, outs = requests_for(batch, prompt_range, out_range, seed=batch)
        ours, theirs = run_ours(llm, prompts, outs), run_hf(hf, prompts, outs)
        results.append(Result("generated tokens/s", {
            "batch": batch, "prompts": f"{prompt_range[0]}-{prompt_range[1]}",
            "outputs": f"{out_range[0]}-{out_range[1]}", "model": "bench 150M fp32 CPU"},
            ours, "tok/s", "transformers generate tok/s", theirs))
    prompts, outs = requests_for(32, (prompt_range[1] // 2,) * 2, (out_range[1] // 2,) * 2, seed=7)
    results.append(Result("generated tokens/s (uniform batch)", {
        "batch": 32, "prompts": len(prompts[0]), "outputs": outs[0], "model": "bench 150M fp32 CPU"},
        run_ours(llm, prompts, outs), "tok/s", "transformers generate tok/s", run_hf(hf, prompts, outs)))
    report("engine_throughput", results, args.json)


if __name__ == "__main__":
    main()
