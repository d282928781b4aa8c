"""One engine identity for every integration: what in an engine's settings decides the KV it
computes, and how that becomes a tierd namespace's identity (model, KV dtype and scales, rank,
stage) — for the vLLM connector, the vLLM secondary tier and the SGLang HiCache backend alike,
so no two integrations key one engine differently. It never raises into an engine: what it
cannot key is `Declined`, which an integration turns into one logged line and no caching.

What changes the namespace: the weights by content (`tierd.namespace.model_fingerprint`, or the
operator's explicit revision), load-time quantization that is not the checkpoint's own, model
config overrides that differ from the checkpoint's config, a compute dtype other than the
checkpoint's, random (dummy) weights, the draft model whose layers
the KV pool holds, the KV cache dtype (known dtypes only) and where fp8 scales come from. What
does not: everything else (lengths, batch sizes, memory, scheduling, kernels, served names,
seeds); a setting that changes nothing (an override equal to the checkpoint's value, the
checkpoint's own quantization or dtype named explicitly) changes nothing here either. LoRA
adapters are per request: `adapter_identity` names one by content, for the request's keys.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import logging
import operator
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierd.errors import NamespaceError, TierdError
from tierd.namespace import Namespace, canonical_dtype, content_digests, model_fingerprint, read_model_config

log = logging.getLogger("tierd.connectors.identity")

# load formats that do not read the checkpoint's weights: the KV is another model's
_RANDOM_WEIGHTS = {"dummy"}


class Declined(TierdError):
    """Something that changes KV and that tierd cannot key: the integration (or, for a
    request's adapter, that request) runs as without tierd, with one logged line saying why."""


@dataclass(frozen=True)
class EngineSettings:
    """What an engine was told that decides the KV it computes, in engine-neutral terms
    (`from_vllm` and `from_sglang` read them from each engine's configuration)."""

    model: str                          # the model directory (or a hub name)
    revision: str = ""                  # the operator's explicit model revision: replaces the fingerprint
    fingerprint: str = "full"           # how the weights are hashed (`model_fingerprint`'s mode)
    dtype: Any = "auto"                 # the dtype the engine computes in ("auto": the checkpoint's)
    kv_cache_dtype: Any = "auto"        # the KV cache's dtype ("auto": the compute dtype)
    quantization: str = ""              # load-time weight quantization ("": none or the checkpoint's own)
    quantization_config: Any = None     # its settings, where the engine takes any
    overrides: Any = None               # model config overrides applied at load: a mapping
    config_path: str = ""               # a config read instead of the checkpoint's (vLLM hf_config_path)
    load_format: str = ""
    kv_scales_file: str = ""            # fp8 KV scales from a file (SGLang --quantization-param-path)
    draft: EngineSettings | None = None   # the draft model whose layers the KV pool holds


@dataclass(frozen=True, slots=True)
class Identity:
    """A namespace's identity fields for one engine; `namespace` adds the layout fields."""

    model: str
    kv_dtype: str
    kv_scales: str = ""
    label: str = dataclasses.field(default="", compare=False)   # the model's name as the engine was
    #                                                               given it: for stats, not identity

    def namespace(self, **layout: Any) -> Namespace:
        try:
            return Namespace(model=self.model, kv_dtype=self.kv_dtype, kv_scales=self.kv_scales,
                             **layout).with_label(self.label)
        except NamespaceError as e:
            raise Declined(str(e)) from None


def identify(settings: EngineSettings, *, kv_dtype: Any = None) -> Identity:
    """The identity of an engine with `settings`; `kv_dtype` is the dtype of the KV cache the
    integration sees (a host pool's tensors), where it sees one. `Declined` for what cannot be
    keyed."""
    model = model_identity(settings)
    kv = kv_cache_dtype(settings, actual=kv_dtype)
    return Identity(model=model, kv_dtype=kv, kv_scales=kv_scales(settings, kv), label=engine_label(settings.model))


def engine_label(model: str) -> str:
    """The name an engine's model goes by in stats: a hub name as given, a directory by its name
    (and its parent's, where the name is a snapshot's hash)."""
    m = str(model).rstrip("/")
    if not os.path.isabs(m) and not m.startswith("."):
        return m
    parts = Path(m).parts
    return "/".join(parts[-3:-2] + parts[-1:]) if len(parts) >= 3 and parts[-2] == "snapshots" else parts[-1] if parts else m


# -- the model ---------------------------------------------------------------------------------
def model_identity(settings: EngineSettings) -> str:
    """The namespace's `model`: the weights' identity, with a canonical digest of the load-time
    settings that change KV folded in where there are any (an engine that sets none keeps the
    plain fingerprint, so blocks stored before stay found)."""
    base = weights_identity(settings)
    load = load_settings(settings)
    if not load:
        return base
    canon = json.dumps(load, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.blake2b(b"tierd-engine-v1\x00" + base.encode() + b"\x00" + canon, digest_size=16).hexdigest()


def weights_identity(settings: EngineSettings) -> str:
    """The operator's explicit revision, else the fingerprint of every weight byte of a local
    model directory; `Declined` for a model that is neither (a name alone does not say which
    weights it was)."""
    if settings.revision:
        return str(settings.revision)
    path = str(settings.model or "")
    if not os.path.isdir(path):
        raise Declined(f"model {path!r} is not a local directory, so its weights cannot be fingerprinted; "
                       "name them with a pinned revision (the integration's 'model' option)")
    try:
        return model_fingerprint(path, mode=str(settings.fingerprint or "full"))
    except (NamespaceError, OSError) as e:
        raise Declined(f"cannot fingerprint the model at {path}: {e}") from None


def load_settings(settings: EngineSettings) -> dict[str, Any]:
    """The settings applied at load that change KV, canonical and non-default only ({} when
    the engine runs the checkpoint as it is)."""
    local = os.path.isdir(str(settings.model or ""))
    checkpoint = _checkpoint_config(settings.model) if local else None
    out: dict[str, Any] = {}
    quant = str(settings.quantization or "")
    if quant and not _checkpoints_own_quantization(quant, checkpoint):
        out["quantization"] = quant
    qcfg = _canonical(settings.quantization_config, "the quantization configuration")
    if qcfg not in (None, {}, []):
        out["quantization_config"] = qcfg
    overrides = _changed_overrides(settings.overrides, checkpoint)
    if overrides:
        out["overrides"] = overrides
    if settings.config_path and os.path.realpath(str(settings.config_path)) != os.path.realpath(str(settings.model)):
        out["config"] = _config_digest(str(settings.config_path))
    compute = _compute_dtype(settings.dtype)
    if compute is not None and compute != _checkpoint_dtype(checkpoint):
        out["dtype"] = compute     # (computed in another precision, the same tokens give other KV)
    fmt = str(settings.load_format or "").lower()
    if fmt in _RANDOM_WEIGHTS:
        out["load_format"] = fmt
    if settings.draft is not None:
        out["draft"] = model_identity(settings.draft)
    return out


def _checkpoint_config(model) -> dict[str, Any] | None:
    try:
        return read_model_config(model)
    except NamespaceError:
        return None


def _checkpoints_own_quantization(method: str, checkpoint: dict | None) -> bool:
    """Whether `method` is the quantization the checkpoint declares (or an engine's kernel
    variant of it, e.g. vLLM's "gptq_marlin" for "gptq"): then the fingerprint covers it."""
    qc = (checkpoint or {}).get("quantization_config")
    own = str(qc.get("quant_method") or "").lower() if isinstance(qc, dict) else ""
    m = method.lower().replace("-", "_")
    own = own.replace("-", "_")
    return bool(own) and (m == own or m.startswith(own + "_"))


def _changed_overrides(overrides, checkpoint: dict | None) -> dict[str, Any]:
    """Overrides as a canonical mapping, less those that set what the checkpoint has already."""
    if overrides is None:
        return {}
    if callable(overrides) and not isinstance(overrides, Mapping):
        raise Declined("the model config is overridden by a function (hf_overrides): what it changes cannot be "
                       "keyed; pass the overrides as a mapping")
    canon = _canonical(overrides, "the model config overrides")
    if not isinstance(canon, dict):
        raise Declined(f"model config overrides {overrides!r} are not a mapping")
    have = _canonical(checkpoint or {}, "the checkpoint's config")
    return {k: v for k, v in canon.items() if k not in have or have[k] != v}


def _config_digest(path: str) -> str:
    """A canonical digest of the config.json in `path` (the config the engine reads instead of
    the checkpoint's)."""
    if not os.path.isdir(path):
        raise Declined(f"the model config comes from {path!r}, which is not a local directory: it cannot be keyed")
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise Declined(f"cannot read the model config in {path}: {e}") from None
    canon = json.dumps(_canonical(cfg, "the model config"), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16).hexdigest()


def _compute_dtype(dtype) -> str | None:
    if dtype is None or str(dtype).lower() in ("", "auto"):
        return None
    try:
        return canonical_dtype(dtype)
    except NamespaceError:
        raise Declined(f"the engine computes in {dtype!r}, a dtype tierd does not know") from None


def _checkpoint_dtype(checkpoint: dict | None) -> str | None:
    name = (checkpoint or {}).get("torch_dtype") or (checkpoint or {}).get("dtype")
    try:
        return canonical_dtype(name) if name else None
    except NamespaceError:
        return None


def _canonical(value, what: str):
    """`value` as plain JSON data (mappings with string keys, lists, numbers, strings), so equal
    settings digest alike whatever object carried them; `Declined` for what has no such form."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, enum.Enum):
        return _canonical(value.value, what)
    if isinstance(value, Mapping):
        return {str(k): _canonical(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, what) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v, what) for v in value), key=repr)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _canonical({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, what)
    dump = getattr(value, "model_dump", None) or getattr(value, "to_dict", None)
    if callable(dump):
        return _canonical(dump(), what)
    raise Declined(f"{what} holds a {type(value).__name__}, which cannot be keyed")


# -- the KV dtype and its scales ----------------------------------------------------------------
def kv_cache_dtype(settings: EngineSettings, actual: Any = None) -> str:
    """The KV cache's dtype (not the model's), canonical: a cache dtype tierd does not know —
    packed, block-scaled or per-token-scaled formats (vLLM fp8_inc, fp8_ds_mla, nvfp4_ds_mla,
    turboquant_*; SGLang mxfp8, nvfp4) — is `Declined`. `actual`: the dtype of the tensors the
    integration copies, which must agree where the settings name one."""
    name = settings.kv_cache_dtype
    declared = None
    if name is not None and str(name).lower() not in ("", "auto"):
        try:
            declared = canonical_dtype(name)
        except NamespaceError:
            raise Declined(f"KV cache dtype {str(name)!r} is not one tierd keys "
                           "(float32, float16, bfloat16, fp8 e4m3 or e5m2 with per-tensor scales)") from None
    else:   # the compute dtype's, "auto" the checkpoint's
        declared = _compute_dtype(settings.dtype) or _checkpoint_dtype(_checkpoint_config(settings.model))
    if actual is None:
        if declared is None:
            raise Declined("the KV cache dtype is unknown (neither the cache, the engine nor the checkpoint "
                           "names a dtype)")
        return declared
    try:
        seen = canonical_dtype(actual)
    except NamespaceError:
        raise Declined(f"the KV cache holds {str(actual)!r}, a dtype tierd does not key") from None
    if declared is not None and declared != seen and (name is not None and str(name).lower() not in ("", "auto")):
        raise Declined(f"the KV cache holds {seen} where the engine's settings say {declared}")
    return seen


def kv_scales(settings: EngineSettings, kv_dtype: str) -> str:
    """Where fp8 KV scales come from: "" (unit scales, or not an fp8 cache), "checkpoint" (the
    checkpoint's, covered by its fingerprint) or "file:<digest>" (a scales file's content)."""
    if not kv_dtype.startswith("float8"):
        return ""
    if settings.kv_scales_file:
        try:
            digest = content_digests([Path(settings.kv_scales_file)])[Path(settings.kv_scales_file)]
        except (OSError, NamespaceError) as e:
            raise Declined(f"cannot read the KV scales file {settings.kv_scales_file}: {e}") from None
        return "file:" + digest[:32]
    path = str(settings.model or "")
    if not os.path.isdir(path):
        raise Declined(f"fp8 KV with model {path!r}, which is not a local directory: whether its checkpoint "
                       "carries KV scales cannot be checked; use a local directory")
    try:
        return "checkpoint" if has_checkpoint_kv_scales(path) else ""
    except (OSError, ValueError, struct.error) as e:
        raise Declined(f"cannot read the KV scales of the checkpoint in {path}: {e}") from None


def has_checkpoint_kv_scales(model_dir: str) -> bool:
    """Whether a checkpoint's safetensors carry KV-cache scales (engines then use them for fp8)."""
    for p in Path(model_dir).glob("*.safetensors"):
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names = json.loads(f.read(n))
        if any(k.endswith(("k_scale", "v_scale", "kv_scale")) for k in names):
            return True
    return False


# -- rank and stage -----------------------------------------------------------------------------
def engine_rank(what: str, lookup: Callable[[], Any], size: int) -> int:
    """A worker's place in a group of `size` (its tensor-parallel rank, its pipeline stage) as
    the engine reports it; `Declined` where the engine cannot say. Never a guess: a worker that
    took another rank's namespace would read that rank's head shards or layers."""
    if size <= 1:
        return 0
    try:
        rank = operator.index(lookup())
    except Exception as e:  # noqa: BLE001 - whatever the engine's lookup met: unknown, not rank 0
        raise Declined(f"this worker's {what} (of {size}) is unknown ({type(e).__name__}: {e})") from None
    if not 0 <= rank < size:
        raise Declined(f"this worker's {what} {rank} lies outside [0, {size})")
    return rank


# -- LoRA adapters ------------------------------------------------------------------------------
_adapter_ids: dict[tuple, bytes] = {}   # an engine loads an adapter once per id: so is it hashed


def adapter_identity(lora_request) -> bytes:
    """16 bytes naming a LoRA adapter by content: its adapter_config.json (canonical) and the
    SHA-256 of every weight file, so two deployments of one adapter share blocks and an adapter
    retrained in place does not find its predecessor's. `Declined` where the content cannot be
    read (not a local directory, files being replaced, invalid JSON): that request is not cached."""
    path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
    name = str(getattr(lora_request, "lora_name", "") or getattr(lora_request, "name", "") or "")
    known = (name, getattr(lora_request, "lora_int_id", None), path)
    cached = _adapter_ids.get(known)          # no file access per request on the scheduler's path
    if cached is not None:
        return cached
    d = Path(path)
    if not (path and d.is_dir()):
        raise Declined(f"LoRA adapter {name!r}: {path!r} is not a local directory, so its content cannot be keyed")
    try:
        files = sorted(p for ext in ("*.safetensors", "*.bin", "*.pt") for p in d.glob(ext))
        h = hashlib.blake2b(b"tierd-lora-v1\x00", digest_size=16)
        cfg = d / "adapter_config.json"
        if cfg.exists():
            canon = json.dumps(json.loads(cfg.read_text()), sort_keys=True, separators=(",", ":"))
            h.update(b"config\x00" + canon.encode())
        digests = content_digests(files)
    except (OSError, ValueError) as e:       # (NamespaceError: a file changed while it was hashed)
        raise Declined(f"LoRA adapter {name!r} at {path}: its content cannot be read ({e})") from None
    for p in files:
        h.update(p.name.encode() + b"\x00" + bytes.fromhex(digests[p]))
    ident = _adapter_ids[known] = h.digest()
    return ident


# -- the engines' settings ----------------------------------------------------------------------
def from_vllm(vllm_config, *, revision: str | None = None, fingerprint: str = "full") -> EngineSettings:
    """The settings of a vLLM engine (its `VllmConfig`): model, dtype, `--kv-cache-dtype`,
    `--quantization` (and its `quantization_config`), `hf_overrides`, `hf_config_path`,
    `--load-format` and a speculative draft model."""
    mc, cc = vllm_config.model_config, getattr(vllm_config, "cache_config", None)
    draft = None
    spec = getattr(vllm_config, "speculative_config", None)
    dmc = getattr(spec, "draft_model_config", None) if spec is not None else None
    if dmc is not None:
        # (the draft's own hf_overrides are vLLM's, set per method: the method names them)
        draft = EngineSettings(model=str(dmc.model), dtype=getattr(dmc, "dtype", "auto"),
                               quantization=str(getattr(dmc, "quantization", None) or ""),
                               overrides={"speculative_method": str(getattr(spec, "method", "") or "")})
    load = getattr(vllm_config, "load_config", None)
    return EngineSettings(
        model=str(mc.model), revision=str(revision or ""), fingerprint=fingerprint,
        dtype=getattr(mc, "dtype", "auto"),
        kv_cache_dtype=getattr(cc, "cache_dtype", "auto") if cc is not None else "auto",
        quantization=str(getattr(mc, "quantization", None) or ""),
        quantization_config=getattr(mc, "quantization_config", None),
        overrides=getattr(mc, "hf_overrides", None) or None,
        config_path=str(getattr(mc, "hf_config_path", None) or ""),
        load_format=str(getattr(load, "load_format", "") or ""),
        draft=draft)


SGLANG_DRAFT_FROM_TARGET = ("NEXTN",)   # methods whose draft layers come with the target checkpoint


def from_sglang(server_args, model_name: str | None, *, revision: str | None = None, fingerprint: str = "full",
                draft_layers: int = 0, draft_revision: str | None = None) -> EngineSettings:
    """The settings of an SGLang engine (its `ServerArgs`; None where they are not available:
    then the storage config's model name alone): model path, dtype, `--kv-cache-dtype`,
    `--quantization` / `--modelopt-quant`, `--json-model-override-args`,
    `--quantization-param-path`, `--load-format`, and the draft model when the host pool holds
    `draft_layers` of its layers. A LoRA engine is `Declined`: SGLang names an adapter in its
    page keys by name and path, and its storage API tells a backend neither per page."""
    if server_args is None:
        if draft_layers:
            raise Declined(f"the host pool holds {draft_layers} draft-model layers and SGLang's server "
                           "arguments, which name the draft model, are not available")
        return EngineSettings(model=str(model_name or ""), revision=str(revision or ""), fingerprint=fingerprint)
    sa = server_args
    if getattr(sa, "enable_lora", None) or getattr(sa, "lora_paths", None):
        raise Declined("LoRA: SGLang keys an adapter's pages by its name and path (lora_id), not its content, "
                       "and tells a storage backend no page's adapter; an adapter retrained in place would "
                       "be served its predecessor's KV")
    try:
        overrides = json.loads(getattr(sa, "json_model_override_args", None) or "{}")
    except ValueError as e:
        raise Declined(f"--json-model-override-args is not JSON ({e})") from None
    model = str(getattr(sa, "model_path", None) or model_name or "")
    draft = None
    if draft_layers:
        algo = str(getattr(sa, "speculative_algorithm", None) or "").upper()
        path = getattr(sa, "speculative_draft_model_path", None) or (model if algo in SGLANG_DRAFT_FROM_TARGET else None)
        if not path:
            raise Declined(f"the host pool holds {draft_layers} draft-model layers, but no draft model is named")
        draft = EngineSettings(model=str(path), revision=str(draft_revision or ""), fingerprint=fingerprint,
                               load_format=str(getattr(sa, "speculative_draft_load_format", None)
                                               or getattr(sa, "load_format", "") or ""),
                               overrides={"speculative_algorithm": algo})
    modelopt = getattr(sa, "modelopt_quant", None)
    return EngineSettings(
        model=model, revision=str(revision or ""), fingerprint=fingerprint,
        dtype=getattr(sa, "dtype", "auto"), kv_cache_dtype=getattr(sa, "kv_cache_dtype", "auto"),
        quantization=str(getattr(sa, "quantization", None) or ""),
        quantization_config={"modelopt_quant": modelopt} if modelopt else None,
        overrides=overrides or None, load_format=str(getattr(sa, "load_format", "") or ""),
        kv_scales_file=str(getattr(sa, "quantization_param_path", None) or ""), draft=draft)


__all__ = ["Declined", "EngineSettings", "Identity", "adapter_identity", "engine_rank", "from_sglang", "from_vllm",
           "has_checkpoint_kv_scales", "identify", "kv_cache_dtype", "kv_scales", "load_settings", "model_identity",
           "weights_identity"]
