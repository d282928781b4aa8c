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
    sliding_window: int | None           # the window of every layer that has one
    torch_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    layer_windows: list[int | None] = field(default_factory=list)   # per layer (None: full attention)

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has it (then blocks out of it can be freed), else None."""
        ws = self.layer_windows or [self.sliding_window] * self.num_layers
        return ws[0] if ws and ws[0] is not None and all(w == ws[0] for w in ws) else None

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
            n_layers = int(cfg["num_hidden_layers"])
            if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
                sliding = None
            sliding = int(sliding) if sliding else None
            windows = layer_windows(cfg, arch, n_layers, sliding, path)
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
                num_layers=n_layers, num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", False)) or arch == "Qwen2ForCausalLM",
                o_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=sliding if any(w is not None for w in windows) else None,
                torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=eos_ids, layer_windows=windows)
        except KeyError as e:
            raise ConfigError(f"{path} lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {e}") from None
        if mc.num_heads % mc.num_kv_heads:
            raise ConfigError(f"{path}: {mc.num_heads} query heads are not a multiple of {mc.num_kv_heads} KV heads")
        return mc


def layer_windows(cfg: dict, arch: str, n_layers: int, window: int | None, path) -> list[int | None]:
    """Which layers attend within the sliding window, as transformers decides: the config's
    `layer_types` where given ("sliding_attention" / "full_attention"); else for Qwen2 the layers
    from `max_window_layers` on (the lower ones attend to everything), and every layer otherwise."""
    if window is None:
        return [None] * n_layers
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise ConfigError(f"{path}: layer_types has {len(types)} entries for {n_layers} layers")
        bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
        if bad:
            raise ConfigError(f"{path}: layer type {bad[0]!r} is not supported (sliding_attention, full_attention)")
        return [window if t == "sliding_attention" else None for t in types]
    if arch == "Qwen2ForCausalLM":
        first = int(cfg.get("max_window_layers", n_layers))
        return [window if i >= first else None for i in range(n_layers)]
    return [window] * n_layers
