"""What besides the token ids changes the KV of a vLLM request, as per-block key `extra` bytes.

vLLM's own prefix cache folds the same things into its block hashes (LoRA adapter, multimodal
inputs overlapping the block with their offsets, prompt embeddings, cache salt); the tier keys
must too, or two requests with equal tokens but another adapter or image would share KV. The
cache salt is not here: it selects another namespace altogether (`Namespace.cache_salt`).

- LoRA adapter: its content (adapter_config.json and the SHA-256 of every weight file;
  `identity.adapter_identity`, shared with the secondary tier), so two deployments of the same
  adapter share blocks and a retrained adapter under the same name does not. An adapter whose
  content cannot be read (not a local directory, files being replaced) declines its request.
- Multimodal inputs: per input overlapping tier block [start, end): its identifier (vLLM's
  content hash of the input), its offset relative to `start` and its length.
- Prompt embeddings: the SHA-256 of the block's slice of the embedding tensor (dtype and shape
  included).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable

from tierd.errors import TierdError

from .identity import adapter_identity

__all__ = ["adapter_identity", "block_extra"]


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

