"""Model and engine configuration for the bundled engine.

Owns reading a Hugging Face config.json (transformers 4.x and 5.x layouts) into a
`ModelConfig`, and refusing architectures the engine cannot run with a clear message. It never
loads weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    torch_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        d = Path(model_dir)
        path = d / "config.json"
        if not d.is_dir():
            raise ConfigError(f"model directory {d} does not exist")
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} not found: a model directory needs config.json and *.safetensors") from None
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} is not a JSON object")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ConfigError(f"{d}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or {}
            rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            if scaling is not None:
                kind = scaling.get("rope_type") or scaling.get("type")
                if kind not in ("llama3", "linear", "default"):
                    raise ConfigError(f"{path}: rope scaling {kind!r} is not supported (llama3, linear)")
                scaling = None if kind == "default" else {**scaling, "rope_type": kind}
            sliding = cfg.get("sliding_window")
            if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
                sliding = None
            eos = cfg.get("eos_token_id")
            gen = d / "generation_config.json"
            if gen.exists():
                try:
                    eos = json.loads(gen.read_text()).get("eos_token_id", eos)
                except ValueError:
                    pass
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            mc = cls(
                architecture=SUPPORTED_ARCHITECTURES[arch],
                vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
                o_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=eos_ids)
        except KeyError as e:
            raise ConfigError(f"{path} lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {e}") from None
        if mc.num_heads % mc.num_kv_heads:
            raise ConfigError(f"{path}: {mc.num_heads} query heads are not a multiple of {mc.num_kv_heads} KV heads")
        return mc
