"""What besides the token ids changes the KV of a vLLM request, as per-block key `extra` bytes.

vLLM's own prefix cache folds the same things into its block hashes (LoRA adapter, multimodal
inputs overlapping the block with their offsets, prompt embeddings, cache salt); the tier keys
must too, or two requests with equal tokens but another adapter or image would share KV. The
cache salt is not here: it selects another namespace altogether (`Namespace.cache_salt`).

- LoRA adapter: its content (adapter_config.json and the SHA-256 of every weight file), so two
  deployments of the same adapter share blocks and a retrained adapter under the same name does
  not. An adapter path that is not a local directory is keyed by its name and path, with a warning.
- Multimodal inputs: per input overlapping tier block [start, end): its identifier (vLLM's
  content hash of the input), its offset relative to `start` and its length.
- Prompt embeddings: the SHA-256 of the block's slice of the embedding tensor (dtype and shape
  included).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Callable

from tierd.errors import TierdError
from tierd.namespace import content_digests

log = logging.getLogger("tierd.connectors.vllm")

_adapter_ids: dict[tuple, bytes] = {}   # vLLM loads an adapter once per id: so is it hashed
_warned: set[str] = set()


def adapter_identity(lora_request) -> bytes:
    """16 bytes naming a LoRA adapter by content (see the module docstring)."""
    path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
    name = str(getattr(lora_request, "lora_name", "") or getattr(lora_request, "name", "") or "")
    known = (name, getattr(lora_request, "lora_int_id", None), path)
    cached = _adapter_ids.get(known)          # no file access per request on the scheduler's path
    if cached is not None:
        return cached
    d = Path(path)
    if path and d.is_dir():
        files = sorted(p for ext in ("*.safetensors", "*.bin", "*.pt") for p in d.glob(ext))
        cfg = d / "adapter_config.json"
        h = hashlib.blake2b(b"tierd-lora-v1\x00", digest_size=16)
        if cfg.exists():
            try:
                canon = json.dumps(json.loads(cfg.read_text()), sort_keys=True, separators=(",", ":"))
            except ValueError as e:
                raise TierdError(f"{cfg}: invalid JSON ({e})") from None
            h.update(b"config\x00" + canon.encode())
        digests = content_digests(files)
        for p in files:
            h.update(p.name.encode() + b"\x00" + bytes.fromhex(digests[p]))
        ident = _adapter_ids[known] = h.digest()
        return ident
    if name not in _warned:
        _warned.add(name)
        log.warning("LoRA adapter %r: %r is not a local directory, so its KV is keyed by name and path, "
                    "not content; give each adapter version its own name", name, path)
    return hashlib.blake2b(b"tierd-lora-name-v1\x00" + name.encode() + b"\x00" + path.encode(),
                           digest_size=16).digest()


def _mm_items(request) -> list[tuple[str, int, int]]:
    items = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        if pos is None or ident is None:
            raise TierdError("a multimodal input without identifier or position cannot be keyed")
        items.append((str(ident), int(pos.offset), int(pos.length)))
    return sorted(items, key=lambda t: t[1])


def _tensor_bytes(t) -> bytes:
    import torch
    t = t.detach().to("cpu").contiguous()
    head = f"{t.dtype}:{tuple(t.shape)}".encode()
    return head + b"\x00" + t.view(torch.uint8).numpy().tobytes()


def block_extra(request, block_tokens: int) -> Callable[[int], bytes | None] | None:
    """`extra(i)` for the tier blocks of `request`, or None when nothing but tokens matters."""
    lora = getattr(request, "lora_request", None)
    lora_id = adapter_identity(lora) if lora is not None else b""
    mm = _mm_items(request)
    embeds = getattr(request, "prompt_embeds", None)
    if not lora_id and not mm and embeds is None:
        return None

    def extra(i: int) -> bytes | None:
        start, end = i * block_tokens, (i + 1) * block_tokens
        parts = []
        if lora_id:
            parts.append(b"lora" + lora_id)
        for ident, off, length in mm:
            if off < end and off + length > start:
                raw = ident.encode()
                parts.append(b"mm" + struct.pack("<qqI", off - start, length, len(raw)) + raw)
        if embeds is not None and start < len(embeds):
            parts.append(b"embeds" + hashlib.sha256(_tensor_bytes(embeds[start:end])).digest())
        return b"".join(parts) or None

    return extra

