"""Random-weight model directories for tests, benchmarks and the demo (needs transformers).

Nothing is downloaded: a config is built locally, weights are drawn from a seeded generator
and scaled so that logits are far from flat (greedy decoding then means something), and the
directory is written with safetensors. `bench_model_dir()` builds the shared bench model once
and caches it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# The one bench model of every benchmark and the demo: about 150M parameters.
BENCH_MODEL = dict(architecture="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                   num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                   max_position_embeddings=16384, rope_theta=500000.0, tie_word_embeddings=False)


def write_random_model(path: str | Path, *, architecture: str = "llama", seed: int = 0,
                       weight_std: float = 0.08, max_shard_size: str | None = None, dtype: str = "float32",
                       fill: dict[str, float] | None = None, **config) -> Path:
    """Write a random-weight checkpoint (config.json + *.safetensors) to `path`;
    `max_shard_size` (e.g. "200KB") splits the weights over several files; `dtype` is the
    weights' type on disk; `fill` sets every parameter whose name ends with a key to its value
    (say a linear-attention layer's `A_log`, so that its state decays slowly and matters)."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               # for engines other than the bundled one (vLLM's tests): window + full layers, MoE
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
               "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
               "granite_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
    cfg_name, model_name = classes[architecture]
    defaults = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = getattr(transformers, cfg_name)(**{**defaults, **config})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, weight_std)
            for suffix, value in (fill or {}).items():
                if name.endswith(suffix):
                    p.fill_(value)
    model = model.to(getattr(torch, dtype))
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return path


def bench_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The bench model, built on first use under `cache_dir` (default ~/.cache/tierd)."""
    base = Path(cache_dir or os.environ.get("TIERD_CACHE_DIR") or Path.home() / ".cache" / "tierd")
    d = base / "bench-model-v1"
    if not (d / "config.json").exists() or not list(d.glob("*.safetensors")):
        tmp = base / "bench-model-v1.tmp"
        cfg = {k: v for k, v in BENCH_MODEL.items() if k != "architecture"}
        write_random_model(tmp, architecture=BENCH_MODEL["architecture"], seed=1234, weight_std=0.03, **cfg)
        (tmp / "tierd-bench-model.json").write_text(json.dumps(BENCH_MODEL))
        if d.exists():
            import shutil
            shutil.rmtree(d)
        tmp.rename(d)
    return d


def write_random_lora(path: str | Path, base_model: str | Path, *, rank: int = 8, seed: int = 0,
                      std: float = 0.05, targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> Path:
    """Write a random LoRA adapter for a Llama-family `base_model` in the PEFT file layout
    (adapter_config.json + adapter_model.safetensors). Both A and B are non-zero, so the adapter
    changes the model's outputs — and, through k_proj and v_proj, its KV."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(base_model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    out_dims = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim, "o_proj": hidden}
    in_dims = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden, "o_proj": heads * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dims[t], generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dims[t], rank, generator=g) * std
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "base_model_name_or_path": str(base_model),
        "fan_in_fan_out": False, "inference_mode": True}, indent=1))
    return path
