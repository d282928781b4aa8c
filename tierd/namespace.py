"""Namespaces: the identity of one KV layout, and the fingerprint of the model behind it.

A namespace fixes the block layout `[num_layers, 2, block_tokens, num_kv_heads, head_dim]`
(C-contiguous, so one layer's K and V are one contiguous run) and hence the block byte size.
Blocks of two namespaces never mix: the namespace id seeds every key chain and tags every slot.
The model fingerprint covers every byte of the weights (see `model_fingerprint`). This module
reads model directories and never writes to them; it remembers weight files' content digests
in a small cache file (`digest_cache_path`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import keys as _keys
from .errors import NamespaceError

log = logging.getLogger("tierd.namespace")

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
LABEL_MAX = 128
LOUD_HASH_BYTES = 1 << 30     # hashing more than this logs progress
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
    layout: str = ""        # "" = the canonical layout above; else the engine layout the bytes are in
    kv_scales: str = ""     # "" = unit scales (or none: not a quantized dtype); else their digest
    tier_codec: str = ""    # "" = exact on every tier; "fp8" / "int4[:GROUP]": lossy on disk and remote
    attention: str = ""     # "" = every layer keeps every token; else the engine's layer groups
    #                         (sliding windows: which tokens of a block are there, see
    #                         connectors/vllm_groups.py)
    planes: int = 2         # 2: K and V per head; 1: one row per token (MLA's latent: one "head"
    #                         of head_dim = kv_lora_rank + rope dims), [layers, block_tokens, latent]
    layers: str = ""        # "" = every layer of the model; "A-B/N": layers A..B-1 of N (a
    #                         pipeline-parallel stage's), num_layers = B - A
    state: str = ""         # "" = a KV namespace; else a recurrent-state namespace (Mamba, linear
    #                         attention): a block is the state after its last token, one page of
    #                         `state_bytes` per state layer, [num_layers, state_bytes] bytes, in
    #                         the engine's layout and dtypes, which `state` describes
    state_bytes: int = 0
    label: str = field(default="", compare=False)   # a display name (the model's): stats and
    #                         metrics show it beside the id; not part of the identity
    _id: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise NamespaceError("namespace model fingerprint must be a non-empty string")
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise NamespaceError(f"namespace {name} must be a positive integer, got {v!r}")
        if self.layers:
            m = re.fullmatch(r"(\d+)-(\d+)/(\d+)", self.layers)
            if m is None or not int(m[1]) < int(m[2]) <= int(m[3]) or int(m[2]) - int(m[1]) != self.num_layers:
                raise NamespaceError(f"namespace layers {self.layers!r}: 'A-B/N' with A < B <= N and "
                                     f"B - A = num_layers ({self.num_layers})")
        if self.planes not in (1, 2) or isinstance(self.planes, bool):
            raise NamespaceError(f"namespace planes must be 2 (K and V) or 1 (a latent row), got {self.planes!r}")
        if self.planes == 1 and self.num_kv_heads != 1:
            raise NamespaceError("a latent (one-plane) namespace has one KV head: its head_dim is the latent size")
        if bool(self.state) != (isinstance(self.state_bytes, int) and not isinstance(self.state_bytes, bool)
                                and self.state_bytes > 0):
            raise NamespaceError("a state namespace has both a state description and state_bytes > 0; "
                                 f"got state={self.state!r}, state_bytes={self.state_bytes!r}")
        if self.state and self.tier_codec:
            raise NamespaceError("a lossy tier codec would change recurrent state: not for a state namespace")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise NamespaceError(f"tp_rank {self.tp_rank!r} must lie in [0, tp_size={self.tp_size})")
        for name in ("cache_salt", "layout", "kv_scales", "tier_codec", "attention", "layers", "state"):
            if not isinstance(getattr(self, name), str):
                raise NamespaceError(f"namespace {name} must be a string")
        if self.tier_codec:
            from .codec import parse_lossy
            try:
                parse_lossy(self.tier_codec)
            except ValueError as e:
                raise NamespaceError(str(e)) from None
            if self.kv_dtype not in ("float16", "bfloat16", "float32"):
                raise NamespaceError(f"tier codec {self.tier_codec!r} needs a float16, bfloat16 or float32 KV "
                                     f"cache, not {self.kv_dtype}")
        if self.block_bytes > 1 << 40:
            raise NamespaceError(f"namespace block of {self.block_bytes} bytes is absurd; check the shape")
        # Every field length-prefixed: no value (a tenant's cache_salt, say) can end one field
        # and start another, so no two namespaces share an identity string (v1 joined fields
        # with a separator a salt could contain). `attention` joins the fields only when set, so
        # the namespaces of models whose layers all keep every token keep their ids; a sequence
        # of length-prefixed fields is read back one way only, so one more field cannot alias.
        fields = ["tierd-ns-v2", self.model, self.kv_dtype, self.num_layers, self.num_kv_heads,
                  self.head_dim, self.block_tokens, self.tp_rank, self.tp_size, self.cache_salt,
                  self.layout, self.kv_scales, self.tier_codec]
        if self.attention or self.planes != 2:
            fields.append(self.attention)
        if self.planes != 2 or self.layers:
            fields.append(f"planes={self.planes}")
        if self.layers:
            fields.append(f"layers={self.layers}")
        if self.state:
            fields.append(f"state={self.state}")
            fields.append(f"state_bytes={self.state_bytes}")
        ident = b"".join(len(v).to_bytes(4, "little") + v for v in (str(x).encode() for x in fields))
        object.__setattr__(self, "_id", hashlib.blake2b(ident, digest_size=16).digest())

    # -- identity -------------------------------------------------------------------------
    @property
    def id(self) -> bytes:
        """16-byte namespace id: tags every slot; seeds every key chain."""
        return self._id

    @property
    def name(self) -> str:
        """Short printable id used in stats and CLI (`--namespace`)."""
        return self._id.hex()[:16]

    def with_label(self, label: str) -> "Namespace":
        """The same namespace (same id) with display name `label`: printable, at most 128
        characters (longer ones are cut, control characters dropped)."""
        clean = "".join(ch for ch in str(label) if ch.isprintable())[:LABEL_MAX]
        return replace(self, label=clean)

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
        """(num_layers, planes, block_tokens, num_kv_heads, head_dim): planes 2 (K, V), or 1
        (a latent namespace: (num_layers, 1, block_tokens, 1, latent))"""
        return (self.num_layers, self.planes, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        if self.state:      # a state page per block, whatever its length (rounded up)
            return -(-self.block_bytes // self.block_tokens)
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        if self.state:
            return self.num_layers * self.state_bytes
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * self.dtype_bytes * self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_id", None)
        d.pop("label", None)   # not identity: sent beside the description (`labels`)
        for name in ("layout", "kv_scales", "tier_codec", "attention", "layers", "state", "state_bytes"):
            if not d[name]:
                del d[name]
        if d["planes"] == 2:
            del d["planes"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Namespace":
        allowed = {"model", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens",
                   "tp_rank", "tp_size", "cache_salt", "layout", "kv_scales", "tier_codec",
                   "attention", "planes", "layers", "state", "state_bytes"}
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
        fingerprint: str = "full",
        tp_rank: int = 0,
        tp_size: int = 1,
        cache_salt: str = "",
        tier_codec: str = "",
        kv_scales: str = "",
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
            model=model_fingerprint(model_dir, revision=revision, mode=fingerprint),
            kv_dtype=kv_dtype, num_layers=layers, num_kv_heads=kv_heads_per_rank,
            head_dim=head_dim, block_tokens=block_tokens, tp_rank=tp_rank, tp_size=tp_size,
            cache_salt=cache_salt, tier_codec=tier_codec, kv_scales=kv_scales).with_label(model_label(model_dir, cfg))


def salt_digest(salt: str) -> str:
    """How a cache salt is shown (stats, metrics): a digest that tells two salts apart without
    telling what either is."""
    return hashlib.blake2b(salt.encode(), digest_size=6, person=b"tierd-salt").hexdigest() if salt else ""


def shown_description(desc: dict) -> dict:
    """A namespace description as stats show it: its cache salt (a tenant's secret) as a digest."""
    if not desc.get("cache_salt"):
        return dict(desc)
    return {**desc, "cache_salt": "digest:" + salt_digest(desc["cache_salt"])}


def model_label(model_dir: str | os.PathLike, cfg: dict | None = None) -> str:
    """A model's display name: its config's `_name_or_path` (the name it was saved under), else
    the directory's name."""
    name = (cfg or {}).get("_name_or_path")
    return name.rstrip("/") if isinstance(name, str) and name.strip("/ ") else Path(model_dir).resolve().name


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


# -- whole-file content digests -------------------------------------------------------------------
_HEX64 = re.compile(r"[0-9a-f]{64}")
_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def digest_cache_path() -> Path:
    """Where content digests are remembered across processes: $TIERD_DIGEST_CACHE, else
    $XDG_CACHE_HOME/tierd/digests.json (~/.cache/tierd/digests.json)."""
    explicit = os.environ.get("TIERD_DIGEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierd" / "digests.json"


def _stat_key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _load_digest_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember_digests(found: dict[tuple, str]) -> None:
    """Add digests to the cache file (atomic replace; a read-only home only costs a re-hash)."""
    path = digest_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_digest_cache(path)
        data.update({":".join(map(str, k)): v for k, v in found.items()})
        if len(data) > 4096:   # keep the newest entries
            data = dict(list(data.items())[-4096:])
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot remember weight digests in %s (%s): they are recomputed next start", path, e)


def hf_blob_digest(path: Path) -> str | None:
    """The SHA-256 a Hugging Face cache snapshot names this file's blob by, or None where `path`
    is not such a link. A snapshot's files are symlinks to ../../blobs/<sha256 of the content>
    for large (LFS) files; small files are named by a git hash, which is not used here."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _HEX64.fullmatch(target.name):
        return target.name
    return None


def _sha256_file(path: Path, progress: "_Progress") -> str:
    h = hashlib.sha256()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            progress.advance(n)
    return h.hexdigest()


class _Progress:
    """Progress of hashing weights, logged every few seconds when there is a lot to read."""

    def __init__(self, total: int, where: Path):
        self.total, self.done, self.where = total, 0, where
        self.t0 = self.last = time.monotonic()
        self.loud = total >= LOUD_HASH_BYTES
        if self.loud:
            log.warning("hashing %.1f GiB of weights in %s once for the model fingerprint "
                        "(remembered in %s)", total / 2**30, where, digest_cache_path())

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.loud and now - self.last >= 5.0:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            log.warning("model fingerprint: %3.0f%% of %.1f GiB, %.0f MiB/s, about %.0f s left",
                        100 * self.done / self.total, self.total / 2**30, rate / 2**20,
                        (self.total - self.done) / max(rate, 1.0))

    def finish(self) -> None:
        if self.loud:
            log.warning("model fingerprint: hashed %.1f GiB in %.1f s", self.done / 2**30,
                        time.monotonic() - self.t0)


def content_digests(paths: list[Path]) -> dict[Path, str]:
    """SHA-256 of each file's whole content: from a Hugging Face snapshot's blob name where the
    file is one, else remembered by (device, inode, size, mtime), else computed (and then
    remembered). The same bytes give the same digest wherever they are stored."""
    out: dict[Path, str] = {}
    todo: list[tuple[Path, tuple, int]] = []
    seen: dict[tuple, str] = {}
    cache = None
    for p in paths:
        named = hf_blob_digest(p)
        if named is not None:
            out[p] = named
            continue
        st = p.stat()
        key = _stat_key(st)
        with _memo_lock:
            known = _memo.get(key)
        if known is None:
            if cache is None:
                cache = _load_digest_cache(digest_cache_path())
            known = cache.get(":".join(map(str, key)))
        if isinstance(known, str) and _HEX64.fullmatch(known):
            out[p] = seen[key] = known
        else:
            todo.append((p, key, st.st_size))
    if todo:
        progress = _Progress(sum(size for _, _, size in todo), todo[0][0].parent)
        found = {}
        for p, key, _ in todo:
            digest = _sha256_file(p, progress)
            if _stat_key(p.stat()) != key:
                raise NamespaceError(f"{p} changed while it was being hashed; start again once it is written")
            out[p] = found[key] = seen[key] = digest
        progress.finish()
        _remember_digests(found)
    with _memo_lock:
        _memo.update(seen)
    return out


FINGERPRINT_MODES = ("full", "sampled")


def model_fingerprint(model_dir: str | os.PathLike, *, revision: str | None = None,
                      mode: str = "full") -> str:
    """32-hex-digit fingerprint of a model directory.

    Hashes config.json (canonical JSON, volatile keys dropped) and, per weight file in name
    order, its name and the SHA-256 of its whole content (`content_digests`: a Hugging Face
    snapshot's blob names, or computed once and remembered), so any change to any weight byte
    gives another fingerprint. `mode="sampled"` hashes only each file's size, safetensors header
    and 16 samples of 64 KiB: cheap, but a fine-tune that changes other bytes keeps the
    fingerprint — an explicit opt-in for operators who accept that. With an explicit `revision`
    the weights are not read: the operator vouches that the revision names the weights.
    """
    if mode not in FINGERPRINT_MODES:
        raise NamespaceError(f"fingerprint mode {mode!r} is not one of {', '.join(FINGERPRINT_MODES)}")
    d = Path(model_dir)
    if not d.is_dir():
        raise NamespaceError(f"model directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise NamespaceError(f"{d}/config.json not found; a model directory needs a config.json")
    h = hashlib.blake2b(digest_size=16)
    h.update(b"tierd-model-v2\x00")
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
    for p in weights:   # a file that is not safetensors is refused in either mode
        with open(p, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise NamespaceError(f"{p}: truncated safetensors file")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > 100 * 1024 * 1024:
                raise NamespaceError(f"{p}: not a safetensors file (header length {hlen})")
            header = f.read(hlen) if mode == "sampled" else b""
        if mode == "sampled":
            h.update(b"sampled\x00" + p.name.encode() + b"\x00" + struct.pack("<Q", p.stat().st_size) + head + header)
            _sample_file(h, p, 8 + hlen)
    if mode == "sampled":
        for p in others:
            h.update(b"sampled\x00" + p.name.encode() + b"\x00" + struct.pack("<Q", p.stat().st_size))
            _sample_file(h, p, 0)
        return h.hexdigest()
    digests = content_digests(weights + others)
    for p in weights + others:
        h.update(p.name.encode() + b"\x00" + bytes.fromhex(digests[p]))
    return h.hexdigest()
