"""Generated tokens/s of the bundled engine against transformers `generate` and vLLM's CPU engine,
same model, same prompts, same run: batch 1, 8 and 32 (goals: >= 2x transformers on the mixed
batch of 32, >= 1x on the uniform one; the ratio to vLLM printed with where the time goes).

The bench model (random weights, about 150M parameters: 8 layers, hidden 1024, 16/4 heads) in
fp32 on the CPU; greedy decoding. Requests have mixed prompt and output lengths (uniform draws,
printed in the params): the engine batches them continuously and stops each at its own length;
transformers pads the prompts (left) and decodes the batch until the longest output is done.
Throughput counts the tokens the requests asked for, on every side. A uniform batch (equal
lengths, where static batching loses nothing) is reported too.

vLLM (its CPU build, `make vllm-env`; skipped with a note where the environment is missing) runs
the same requests in one engine process (tests/vllm_engine.py: fp32, eager mode, its prefix cache
off, every core for its worker, the same batch limits), each batch after a warm-up batch; its
time is the `generate` call's wall time. The bundled engine's time per step phase (scheduling,
building the inputs, the forward pass with its cache writes and attention apart, sampling and
bookkeeping) is printed beside it, to show where the difference goes.

    python -m benchmarks.engine_throughput [--json PATH] [--quick]
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

from tierd.engine import LLM, SamplingParams
from tierd.engine.random_model import bench_model_dir

from .common import Result, engine_python, parse_args, report, run_engine_process

MAX_SEQS, MAX_BATCHED = 64, 4096


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


def run_ours_phases(llm: LLM, prompts, outs: list[int]) -> tuple[float, dict]:
    """run_ours, and the seconds of each step phase it took."""
    before = dict(llm.phase_seconds, attention=llm.model.attention_seconds)
    rate = run_ours(llm, prompts, outs)
    after = dict(llm.phase_seconds, attention=llm.model.attention_seconds)
    return rate, {k: after[k] - before[k] for k in after}


def run_vllm(model_dir: Path, cases: list[tuple[str, list, list[int]]]) -> dict[str, float] | None:
    """Generated tokens/s of vLLM's CPU engine per case (one engine process for all of them), or
    None without the vLLM environment."""
    try:
        py = engine_python(".venv-vllm", "TEST_VLLM_PYTHON", "vllm-env")
    except SystemExit as e:
        print(f"vLLM not run: {e}")
        return None
    work = Path(tempfile.mkdtemp(prefix="tierd-bench-vllm-"))
    warm = requests_for(2, (8, 16), (2, 4), 99)

    def batch(name, prompts, outs):
        return {"name": name, "prompts": [{"tokens": p, "max_tokens": n, "ignore_eos": True}
                                          for p, n in zip(prompts, outs)]}
    batches = []
    for name, prompts, outs in cases:
        batches += [batch(f"warm-{name}", *warm), batch(name, prompts, outs)]
    spec = {"model": str(model_dir), "batches": batches,
            "engine": {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": MAX_BATCHED, "max_model_len": 2048,
                       "enable_prefix_caching": False}}
    # every core for the model's worker (the scheduler shares them), as the bundled engine has
    run = run_engine_process(py, "tests.vllm_engine", work, "vllm-throughput", spec,
                             {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING"})
    out = {}
    for (name, _, outs), b in zip(cases, [b for b in run["batches"] if not b["name"].startswith("warm-")]):
        got = [len(o["tokens"]) for o in b["outputs"]]
        if got != outs:
            raise SystemExit(f"vLLM generated {got} tokens for {outs}")
        out[name] = sum(outs) / b["wall_s"]
    shutil.rmtree(work, ignore_errors=True)
    return out


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
    cases = [(f"batch {b}", *requests_for(b, prompt_range, out_range, seed=b)) for b in (1, 8, 32)]
    cases.append(("uniform batch 32", *requests_for(32, (prompt_range[1] // 2,) * 2, (out_range[1] // 2,) * 2,
                                                    seed=7)))
    vllm = run_vllm(d, cases)      # first, in its own process, while this one is still idle
    llm = LLM(d, kv_cache_bytes="1GiB", max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_BATCHED)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    results = []
    warm = requests_for(2, (8, 16), (2, 4), 99)
    run_ours(llm, *warm)
    run_hf(hf, *warm)
    phases = {}
    for name, prompts, outs in cases:
        ours, phases[name] = run_ours_phases(llm, prompts, outs)
        theirs = run_hf(hf, prompts, outs)
        uniform = name.startswith("uniform")
        params = {"batch": len(prompts), "prompts": len(prompts[0]) if uniform else f"{prompt_range[0]}-{prompt_range[1]}",
                  "outputs": outs[0] if uniform else f"{out_range[0]}-{out_range[1]}", "model": "bench 150M fp32 CPU"}
        label = "generated tokens/s (uniform batch)" if uniform else "generated tokens/s"
        goal = "goal >= 1x" if uniform else ("goal >= 2x" if len(prompts) == 32 else "")
        results.append(Result(label, params, ours, "tok/s", "transformers generate tok/s", theirs, note=goal))
        if vllm is not None:
            results.append(Result(f"{label} vs vLLM", params, ours, "tok/s", "vLLM CPU engine tok/s", vllm[name],
                                  note="the bundled engine's step phases: printed below"))
    for r in results:       # the step phases go with each result (in the JSON; the table below)
        if r.name.endswith("vs vLLM") or vllm is None:
            r.params = dict(r.params)   # not the transformers result's dict
            key = "uniform batch 32" if "uniform" in r.name else f"batch {r.params['batch']}"
            r.params["phases_s"] = {k: round(v, 3) for k, v in phases[key].items()}
    report("engine_throughput", results, args.json)
    print("\nwhere the bundled engine's time goes (seconds per phase of its steps):")
    for name, ph in phases.items():
        total = sum(v for k, v in ph.items() if k != "attention")
        print(f"  {name:18s} total {total:7.3f} s: schedule {ph['schedule']:.3f}, inputs {ph['inputs']:.3f}, "
              f"forward {ph['forward']:.3f} (cache writes + attention {ph['attention']:.3f}, "
              f"GEMMs and the rest {ph['forward'] - ph['attention']:.3f}), sample {ph['sample']:.3f}")



if __name__ == "__main__":
    main()
