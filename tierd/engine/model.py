"""The Llama-family transformer over a paged KV cache (torch, CPU path).

Owns the weights (loaded from safetensors with Hugging Face names) and one `forward` over a
packed batch of new tokens. RoPE follows the rotate_half convention of HF checkpoints. It never
allocates KV blocks or decides what to run: the model runner gives it slots and block tables.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..errors import ConfigError
from .attention import (AttentionMetadata, decode_attention, paged_attention, paged_attention_int4,
                        reshape_and_cache, streaming_attention)
from .config import ModelConfig
from .int4 import Int4LayerCache


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s and s["rope_type"] == "linear":
        inv = inv / float(s["factor"])
    elif s and s["rope_type"] == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < hi_wavelen) & ~(wavelen > lo_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


def onednn_linear():
    """(pack, linear) of torch's oneDNN linear over prepacked weights, or None where this torch
    lacks it. A packed weight runs the same fp32 GEMM in oneDNN's blocked layout: 2-4x faster
    than `F.linear` on a CPU for the few-row batches of decoding (benchmarks/engine_throughput)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


PACK_BATCH_HINT = 64    # oneDNN picks its weight layout for this many rows; any number runs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# The element-wise steps of a layer, as the forward runs them in torch (the CPU path, and the
# references of the fused Triton kernels in tierd.kernels, which a GPU runs instead).

def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x); with `residual`: residual += x in place, then rms_norm of the sum."""
    if residual is not None:
        residual.add_(x)
        x = residual
    return rms_norm(x, weight, eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(cos, sin) of RoPE at positions (T,), each (T, 1, head_dim) in `dtype`."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)        # (T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                 # (T, d)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """RoPE of q (T, heads, d) and k (T, kv_heads, d) at positions (T,), in place."""
    cos, sin = rope_tables(positions, inv_freq, q.dtype)
    for x in (q, k):
        x.copy_(x * cos + rotate_half(x) * sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate_up (T, 2 * I) holds gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaModel:
    """Weights and forward of a Llama/Mistral/Qwen2 decoder."""

    def __init__(self, cfg: ModelConfig, model_dir: str | Path, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.w = load_weights(cfg, Path(model_dir), dtype, self.device)
        found = [layer.pop("kv_scales", None) for layer in self.w["layers"]]
        # fp8 KV scales from the checkpoint (every layer, or none)
        self.checkpoint_kv_scales = found if all(s is not None for s in found) else None
        if self.checkpoint_kv_scales is None and any(s is not None for s in found):
            raise ConfigError(f"{model_dir}: KV scales for some layers only")
        self.inv_freq = rope_inv_freq(cfg).to(self.device)
        self._ops = None
        # wall seconds of forward spent writing the cache and in attention (on a CPU: where a
        # step's forward time goes, beside the GEMMs; on a GPU only launches are timed)
        self.attention_seconds = 0.0
        self.scale = cfg.head_dim ** -0.5
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_sizes = [q_out, kv_out, kv_out]
        # Fused projections: fewer, larger GEMMs (same math as the separate ones).
        for layer in self.w["layers"]:
            layer["qkv"] = torch.cat([layer.pop("q"), layer.pop("k"), layer.pop("v")])
            if cfg.qkv_bias:
                layer["qkv_b"] = torch.cat([layer.pop("q_b"), layer.pop("k_b"), layer.pop("v_b")])
            layer["gate_up"] = torch.cat([layer.pop("gate"), layer.pop("up")])
            if cfg.mlp_bias:
                layer["gate_up_b"] = torch.cat([layer.pop("gate_b"), layer.pop("up_b")])
        self._dnn = None
        if self.device.type == "cpu" and dtype == torch.float32:
            self._pack_weights()

    LINEARS = ("qkv", "o", "gate_up", "down")

    def _pack_weights(self) -> None:
        """On a CPU in fp32: every projection and the LM head prepacked for oneDNN (the packed
        copy replaces the plain weight), after a check on each weight shape that it gives
        F.linear's result; where the op is missing or the check fails, plain F.linear."""
        ops = onednn_linear()
        if ops is None:
            return
        pack, linear = ops
        weights = [(layer, n) for layer in self.w["layers"] for n in self.LINEARS] + [(self.w, "lm_head")]
        try:
            packed = [pack(holder[n], PACK_BATCH_HINT) for holder, n in weights]
            g = torch.Generator().manual_seed(0)
            checked = set()
            for (holder, n), p in zip(weights, packed):
                w = holder[n]
                if w.shape in checked:
                    continue
                x = torch.randn(5, w.shape[1], generator=g)
                want = F.linear(x, w)
                if not torch.allclose(linear(x, p, None, "none", [], ""), want, rtol=1e-4,
                                      atol=1e-4 * float(want.abs().max())):
                    return
                checked.add(w.shape)
        except RuntimeError:
            return
        for (holder, n), p in zip(weights, packed):   # the packed copy is the weight now
            holder[n + "_packed"], holder[n] = p, None
        self._dnn = linear

    def linear(self, x: torch.Tensor, holder: dict, name: str) -> torch.Tensor:
        """x @ W^T (+ b) for the weight `name` of `holder` (a layer, or the model's weights)."""
        bias = holder.get(name + "_b")
        if self._dnn is not None:
            return self._dnn(x, holder[name + "_packed"], bias, "none", [], "")
        return F.linear(x, holder[name], bias)

    def ops(self):
        """(reshape_and_cache, decode, add_rms_norm, rotary, silu_mul) for this device:
        tierd.kernels' self-checked kernels where they passed on this device (CUDA: the Triton
        or the CUDA decode kernel, chosen per shape by `tierd.kernels.decode_attention`, and the
        fused Triton norm, rotary and gate kernels; on the CPU the C decode attention), else the
        engine's own torch code (the same arguments). The fused ops are `KernelOp`s everywhere:
        on the CPU they run their torch references, and Triton only under its interpreter (tests)."""
        if self._ops is None:
            import tierd.kernels as K   # not at import time: tierd.kernels imports the engine's references
            if self.device.type == "cuda":
                usable = (K.paged_attention_decode_triton.use_kernel(self.device)
                          | K.paged_attention_decode.use_kernel(self.device))   # (both checked, and said)
                decode = K.decode_attention if usable else None
            elif K.paged_attention_decode_triton.use_kernel(self.device):      # (the interpreter: tests)
                decode = K.decode_attention
            else:
                decode = K.paged_attention_decode if K.paged_attention_decode.use_kernel(self.device) else None
                if decode is not None:
                    kernel = decode

                    def decode(q, k_cache, v_cache, *args, **kwargs):
                        # caches the C kernel does not take (fp8) go to the engine's batched decode,
                        # not to the kernel's per-sequence reference
                        if k_cache.dtype in (torch.float32, torch.bfloat16):
                            return kernel(q, k_cache, v_cache, *args, **kwargs)
                        return decode_attention(q, k_cache, v_cache, *args, **kwargs)
            self._ops = (K.reshape_and_cache if self.device.type == "cuda" else reshape_and_cache, decode,
                         K.add_rms_norm, K.rotary, K.silu_mul)
        return self._ops

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.inv_freq, self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                seqs: list, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_index: torch.Tensor, kv_scales: list[tuple[float, float]] | None = None,
                observe=None, streaming: tuple[int, int] | None = None,
                mass: list | None = None, before_layer=None) -> torch.Tensor:
        """tokens, positions, slot_mapping: (T,). seqs: see paged_attention. kv_scales: per
        layer (k_scale, v_scale) of an fp8 cache (None: 1.0). observe(layer, k, v), if given,
        sees each layer's new keys and values before they are cached (calibration).
        streaming: (attention sinks, window) for StreamingLLM attention. mass: per sequence, a
        tensor per block-table entry that gains each held block's attention mass (block
        eviction: attention reads only held blocks). before_layer(i), if given, runs before layer
        i touches its cache (blocks still loading into it: the connector's per-layer wait). Returns
        logits (len(logits_index), vocab) in float32 for the rows in logits_index."""
        c, w = self.cfg, self.w
        T = tokens.shape[0]
        h = w["embed"][tokens]                                                  # (T, hidden)
        block_size = (kv_caches[0].block_size if isinstance(kv_caches[0], Int4LayerCache)
                      else kv_caches[0][0].shape[1])
        meta = AttentionMetadata(seqs, block_size, self.device)
        cache_op, decode, norm, rotary_, silu_mul_ = self.ops()
        eps, layers = c.rms_norm_eps, w["layers"]
        x = norm(h, layers[0]["in_norm"], eps)
        for i, layer in enumerate(layers):
            qkv = self.linear(x, layer, "qkv")                                 # one GEMM for q, k, v
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            q = q.view(T, c.num_heads, c.head_dim)
            k = k.view(T, c.num_kv_heads, c.head_dim)
            v = v.view(T, c.num_kv_heads, c.head_dim)
            rotary_(q, k, positions, self.inv_freq)                              # in place, in qkv
            if observe is not None:
                observe(i, k, v)
            window = c.layer_windows[i] if c.layer_windows else c.sliding_window
            if before_layer is not None:
                before_layer(i)
            ta = time.perf_counter()
            if isinstance(kv_caches[i], Int4LayerCache):
                kv_caches[i].write(k, v, slot_mapping)
                a = paged_attention_int4(q, kv_caches[i], meta, self.scale, sliding_window=window)
            else:
                k_cache, v_cache = kv_caches[i]
                ks = kv_scales[i] if kv_scales is not None else (1.0, 1.0)
                cache_op(k, v, k_cache, v_cache, slot_mapping, *ks)
                if streaming is not None or mass is not None:
                    sinks, win = streaming if streaming is not None else (0, None)
                    a = streaming_attention(q, k_cache, v_cache, meta, self.scale, sinks, win,
                                            self.inv_freq, *ks, mass=mass)
                else:
                    a = paged_attention(q, k_cache, v_cache, meta, self.scale, *ks, sliding_window=window,
                                        decode=decode, new_kv=(k, v))
            self.attention_seconds += time.perf_counter() - ta
            x = norm(self.linear(a.reshape(T, c.num_heads * c.head_dim), layer, "o"), layer["post_norm"], eps,
                     residual=h)                                                 # h += attention
            x = self._mlp(x, layer, silu_mul_)
            if i + 1 < len(layers):
                x = norm(x, layers[i + 1]["in_norm"], eps, residual=h)          # h += mlp
            else:
                h.add_(x)
        h = norm(h[logits_index], w["norm"], eps)
        return self.linear(h, w, "lm_head").float()

    def _mlp(self, x: torch.Tensor, layer: dict, silu_mul_) -> torch.Tensor:
        return self.linear(silu_mul_(self.linear(x, layer, "gate_up")), layer, "down")

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], kv_scales: list[tuple[float, float]] | None,
                    max_seq_len: int) -> torch.Tensor:
        """One new token for each of B sequences, with every shape fixed by the arguments: tokens,
        positions, slot_mapping, seq_lens (B,) and block_tables (B, max_blocks) on the device
        (a padding row: slot -1, length 1), no sequence longer than max_seq_len. The same
        computation as `forward` for a batch of decodes, with no host work per sequence and no
        wait for the device: what a CUDA graph captures (tierd.engine.graphs). Caches of
        float or fp8 values (not int4), no sliding window, no StreamingLLM. Returns the
        logits (B, vocab) in float32."""
        c, w = self.cfg, self.w
        B = tokens.shape[0]
        cache_op, decode, norm, rotary_, silu_mul_ = self.ops()
        decode = decode or decode_attention
        eps, layers = c.rms_norm_eps, w["layers"]
        h = w["embed"][tokens]
        x = norm(h, layers[0]["in_norm"], eps)
        for i, layer in enumerate(layers):
            q, k, v = self.linear(x, layer, "qkv").split(self.qkv_sizes, dim=-1)
            q = q.view(B, c.num_heads, c.head_dim)
            k = k.view(B, c.num_kv_heads, c.head_dim)
            v = v.view(B, c.num_kv_heads, c.head_dim)
            rotary_(q, k, positions, self.inv_freq)
            k_cache, v_cache = kv_caches[i]
            ks = kv_scales[i] if kv_scales is not None else (1.0, 1.0)
            cache_op(k, v, k_cache, v_cache, slot_mapping, *ks)
            a = decode(q, k_cache, v_cache, block_tables, seq_lens, self.scale, *ks, max_seq_len=max_seq_len)
            x = norm(self.linear(a.reshape(B, c.num_heads * c.head_dim), layer, "o"), layer["post_norm"], eps,
                     residual=h)
            x = self._mlp(x, layer, silu_mul_)
            if i + 1 < len(layers):
                x = norm(x, layers[i + 1]["in_norm"], eps, residual=h)
        x = norm(x, w["norm"], eps, residual=h)
        return self.linear(x, w, "lm_head").float()


def load_weights(cfg: ModelConfig, d: Path, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{d}: no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    tensors[name] = sf.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise ConfigError(f"{f}: cannot read weights ({e})") from None

    def take(name: str, shape: tuple | None = None, required: bool = True):
        t = tensors.get(name)
        if t is None:
            if required:
                raise ConfigError(f"{d}: weight {name} is missing")
            return None
        if shape is not None and tuple(t.shape) != shape:
            raise ConfigError(f"{d}: weight {name} has shape {tuple(t.shape)}, config says {shape}")
        return t.to(device=device, dtype=dtype).contiguous()

    c = cfg
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {"embed": take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),
         "norm": take("model.norm.weight", (c.hidden_size,)), "layers": []}
    lm = take("lm_head.weight", (c.vocab_size, c.hidden_size), required=not c.tie_word_embeddings)
    w["lm_head"] = w["embed"] if lm is None else lm
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        layer = {
            "in_norm": take(p + "input_layernorm.weight", (c.hidden_size,)),
            "post_norm": take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
            "q": take(p + "self_attn.q_proj.weight", (q_out, c.hidden_size)),
            "k": take(p + "self_attn.k_proj.weight", (kv_out, c.hidden_size)),
            "v": take(p + "self_attn.v_proj.weight", (kv_out, c.hidden_size)),
            "o": take(p + "self_attn.o_proj.weight", (c.hidden_size, q_out)),
            "gate": take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
            "up": take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
            "down": take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
        }
        if c.qkv_bias:
            layer["q_b"] = take(p + "self_attn.q_proj.bias", (q_out,))
            layer["k_b"] = take(p + "self_attn.k_proj.bias", (kv_out,))
            layer["v_b"] = take(p + "self_attn.v_proj.bias", (kv_out,))
        if c.o_bias:
            layer["o_b"] = take(p + "self_attn.o_proj.bias", (c.hidden_size,))
        if c.mlp_bias:
            for n in ("gate", "up", "down"):
                layer[n + "_b"] = take(p + f"mlp.{n}_proj.bias")
        # fp8 KV scales a quantized checkpoint carries (vLLM's names; `kv_scale`: one for both)
        ks, vs, both = (tensors.get(p + "self_attn." + n) for n in ("k_scale", "v_scale", "kv_scale"))
        if ks is not None or vs is not None or both is not None:
            k, v = (ks if ks is not None else both), (vs if vs is not None else both)
            if k is None or v is None or k.numel() != 1 or v.numel() != 1:
                raise ConfigError(f"{d}: layer {i} needs one k_scale and one v_scale (per tensor)")
            layer["kv_scales"] = (float(k), float(v))
        w["layers"].append(layer)
    return w
