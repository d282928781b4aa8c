"""Namespaces: the identity of one KV layout, and the fingerprint of the model behind it.

A namespace fixes the block layout `[num_layers, 2, block_tokens, num_kv_heads, head_dim]`
(C-contiguous, so one layer's K and V are one contiguous run) and hence the block byte size.
Blocks of two namespaces never mix: the namespace id seeds every key chain and tags every slot.
This module reads model directories but never writes anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import keys as _keys
from .errors import NamespaceError

# Canonical dtype name -> bytes per element. Aliases map onto these names.
DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "fp16": "float16", "half": "float16", "float16": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2",
}
DEFAULT_BLOCK_TOKENS = 256
FINGERPRINT_SAMPLES = 16
FINGERPRINT_SAMPLE_BYTES = 64 * 1024
# config.json keys that change without the weights changing.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "use_cache"}


def canonical_dtype(name: Any) -> str:
    """`"fp16"`, `"torch.float16"`, `torch.float16` -> `"float16"`."""
    s = str(name).lower().removeprefix("torch.")
    if s not in _DTYPE_ALIASES:
        raise NamespaceError(
            f"unsupported KV dtype {name!r}; use one of {', '.join(sorted(DTYPE_BYTES))}")
    return _DTYPE_ALIASES[s]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Identity of a KV layout. `model` is a model fingerprint (hex) or an explicit revision."""

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""
    _id: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise NamespaceError("namespace model fingerprint must be a non-empty string")
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise NamespaceError(f"namespace {name} must be a positive integer, got {v!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise NamespaceError(f"tp_rank {self.tp_rank!r} must lie in [0, tp_size={self.tp_size})")
        if not isinstance(self.cache_salt, str):
            raise NamespaceError("cache_salt must be a string")
        if self.block_bytes > 1 << 40:
            raise NamespaceError(f"namespace block of {self.block_bytes} bytes is absurd; check the shape")
        ident = "\x1f".join(str(x) for x in (
            "tierd-ns-v1", self.model, self.kv_dtype, self.num_layers, self.num_kv_heads,
            self.head_dim, self.block_tokens, self.tp_rank, self.tp_size, self.cache_salt))
        object.__setattr__(self, "_id", hashlib.blake2b(ident.encode(), digest_size=16).digest())

    # -- identity -------------------------------------------------------------------------
    @property
    def id(self) -> bytes:
        """16-byte namespace id: tags every slot; seeds every key chain."""
        return self._id

    @property
    def name(self) -> str:
        """Short printable id used in stats and CLI (`--namespace`)."""
        return self._id.hex()[:16]

    @property
    def root_key(self) -> bytes:
        return _keys.root_key(self._id)

    def block_keys(self, token_ids, *, parent: bytes | None = None, extra=None) -> list[bytes]:
        """Keys of the full blocks of `token_ids` in this namespace."""
        return _keys.block_keys(self.root_key, token_ids, self.block_tokens, parent=parent, extra=extra)

    # -- layout ---------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, block_tokens, num_kv_heads, head_dim)"""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_id", None)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Namespace":
        allowed = {"model", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens",
                   "tp_rank", "tp_size", "cache_salt"}
        unknown = set(d) - allowed
        if unknown:
            raise NamespaceError(f"unknown namespace fields: {', '.join(sorted(unknown))}")
        try:
            return cls(**d)
        except TypeError as e:
            raise NamespaceError(f"incomplete namespace description: {e}") from None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | os.PathLike,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        kv_dtype: str = "auto",
        revision: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        cache_salt: str = "",
    ) -> "Namespace":
        """The namespace of a Hugging Face model directory (config.json + weights)."""
        cfg = read_model_config(model_dir)
        layers = _cfg_int(cfg, "num_hidden_layers", model_dir)
        heads = _cfg_int(cfg, "num_attention_heads", model_dir)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or _cfg_int(cfg, "hidden_size", model_dir) // heads)
        if kv_dtype == "auto":
            kv_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
        # Tensor parallelism splits KV heads across ranks; fewer heads than ranks replicate.
        kv_heads_per_rank = max(1, kv_heads // tp_size)
        return cls(
            model=model_fingerprint(model_dir, revision=revision),
            kv_dtype=kv_dtype, num_layers=layers, num_kv_heads=kv_heads_per_rank,
            head_dim=head_dim, block_tokens=block_tokens, tp_rank=tp_rank, tp_size=tp_size,
            cache_salt=cache_salt)


def _cfg_int(cfg: dict, key: str, model_dir) -> int:
    v = cfg.get(key)
    if not isinstance(v, int) or v <= 0:
        raise NamespaceError(f"{model_dir}/config.json: {key} is missing or not a positive integer")
    return v


def read_model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model directory; for multimodal configs, the text model's part."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise NamespaceError(f"{path} not found; a model directory needs a config.json") from None
    except (OSError, ValueError) as e:
        raise NamespaceError(f"{path}: cannot read ({e})") from None
    if not isinstance(cfg, dict):
        raise NamespaceError(f"{path}: not a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    return cfg


def _config_digest(model_dir: Path) -> bytes:
    cfg = json.loads((model_dir / "config.json").read_text())
    if isinstance(cfg, dict):
        cfg = {k: v for k, v in cfg.items() if k not in _VOLATILE_CONFIG_KEYS}
    canon = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16).digest()


def _sample_file(h: "hashlib._Hash", path: Path, data_start: int) -> None:
    """Feed `h` with FINGERPRINT_SAMPLES chunks at evenly spaced offsets of [data_start, size)."""
    size = path.stat().st_size
    span = size - data_start
    with open(path, "rb") as f:
        if span <= FINGERPRINT_SAMPLES * FINGERPRINT_SAMPLE_BYTES:
            f.seek(data_start)
            h.update(f.read())
            return
        step = (span - FINGERPRINT_SAMPLE_BYTES) // (FINGERPRINT_SAMPLES - 1)
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(data_start + i * step)
            h.update(f.read(FINGERPRINT_SAMPLE_BYTES))


def model_fingerprint(model_dir: str | os.PathLike, *, revision: str | None = None) -> str:
    """32-hex-digit fingerprint of a model directory.

    Hashes config.json (canonical JSON, volatile keys dropped) and, per weight file in name
    order, its name, size, safetensors header and 16 samples of 64 KiB at evenly spaced offsets:
    cheap at start-up, the same on every host, and different for a fine-tune with identical
    shapes. With an explicit `revision` the weights are not read.
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise NamespaceError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise NamespaceError(f"{d}/config.json not found; a model directory needs a config.json")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"tierd-model-v1\x00")
    try:
        h.update(_config_digest(d))
    except ValueError as e:
        raise NamespaceError(f"{d}/config.json: invalid JSON ({e})") from None
    if revision is not None:
        h.update(b"revision\x00" + str(revision).encode())
        return h.hexdigest()
    weights = sorted(d.glob("*.safetensors"))
    others = sorted(p for ext in ("*.bin", "*.pt", "*.pth", "*.gguf") for p in d.glob(ext))
    if not weights and not others:
        raise NamespaceError(
            f"{d}: no weight files (*.safetensors, *.bin) to fingerprint; pass revision= to name the model")
    for p in weights:
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise NamespaceError(f"{p}: truncated safetensors file")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > 100 * 1024 * 1024:
                raise NamespaceError(f"{p}: not a safetensors file (header length {hlen})")
            header = f.read(hlen)
        h.update(p.name.encode() + b"\x00" + struct.pack("<Q", p.stat().st_size) + head + header)
        _sample_file(h, p, 8 + hlen)
    for p in others:
        h.update(p.name.encode() + b"\x00" + struct.pack("<Q", p.stat().st_size))
        _sample_file(h, p, 0)
    return h.hexdigest()
