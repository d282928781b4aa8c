"""The KV cache groups of a vLLM model, as the connector reads, writes and keys them.

vLLM gives every KV cache group (layers that share one kind of attention) block ids of its own,
from one pool; with its hybrid manager on (the connector is `SupportsHMA`), a model of sliding-
window and full-attention layers has a group of each, and layers of different groups alias the
same memory: a block id belongs to one group at a time, so a layer is copied only through its
own group's ids. A sliding-window group frees the blocks that leave the window and hands out the
null block (id 0) in their place.

What a tier block holds (every layer, `[layers, 2, block_tokens, kv_heads, head_dim]` as ever):
- full-attention layers: every token;
- sliding-window layers (window W): at least the tokens from `end - W + 1` to the block's end,
  which are all any later hit reads — a hit of M ≥ end tokens reads, of this block, only tokens
  ≥ M - W + 1. The block is saved in the step that computes its last token, when vLLM still
  holds all of them (it keeps the block of token `n - W + 1` on, n the tokens computed before
  the step); earlier tokens whose blocks are gone are zeros, never another block's bytes.
So a prefix hit of any length serves every group, and a load writes a sliding group's blocks
only where vLLM's table has a real block (the window's tail), skipping its null ones.

The namespace records the structure (`Namespace.attention`): a model cached with the hybrid
manager on keeps windows and zeros where the same model with it off (one full-attention group,
every token kept) has every byte, so the two never share blocks.

MLA keeps every token (a full-attention group whose cache is latent rows: the namespace says so,
`planes=1`). Declined, with the reason logged once: sliding-window or sparse MLA, Mamba and
linear-attention state, chunked-local and other attention kinds, and groups whose block size is
not the engine's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tierd.errors import TierdError

FULL, SLIDING = "full", "sliding"


class Unsupported(TierdError):
    """A KV cache structure the connector does not cache (the reason is the message)."""


def layer_order(name: str) -> tuple:
    """Sort key that orders 'model.layers.10.self_attn.attn' after '...layers.9...'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class Group:
    kind: str                  # FULL or SLIDING
    layers: tuple[int, ...]    # positions in the tier block's layer order
    window: int = 0            # SLIDING: tokens a position attends to, itself included

    @property
    def retained(self) -> int:
        """Tokens before a position whose KV a later step still reads."""
        return self.window - 1 if self.kind == SLIDING else -1


def _kind(spec) -> tuple[str, int]:
    """(kind, window) of one layer's vLLM KV cache spec; Unsupported for the rest."""
    name = type(spec).__name__
    if name == "FullAttentionSpec":
        # with the hybrid manager off, window layers are full-attention groups that keep every
        # token (`sliding_window` set, nothing freed): their bytes are full attention's
        if getattr(spec, "attention_chunk_size", None):
            raise Unsupported("chunked local attention is not supported")
        return FULL, 0
    if name == "SlidingWindowSpec":
        window = int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        if window <= 0:
            raise Unsupported(f"sliding window {spec.sliding_window} is not supported")
        return SLIDING, window
    if name == "MLAAttentionSpec":
        return FULL, 0       # every token kept; its latent rows are the namespace's (planes=1)
    if "MLA" in name:
        raise Unsupported(f"MLA with {name} is not supported")
    if "Mamba" in name:
        raise Unsupported("Mamba and linear-attention state (a hybrid model) is not supported")
    raise Unsupported(f"KV cache spec {name} is not supported")


class KVGroups:
    """The groups of one model, its layers in tier-block order (`names`)."""

    def __init__(self, groups: Sequence[Group], names: Sequence[str]):
        self.groups = list(groups)
        self.names = list(names)
        self.layer_group = [0] * len(self.names)
        for g, grp in enumerate(self.groups):
            for i in grp.layers:
                self.layer_group[i] = g

    @classmethod
    def unknown(cls) -> "KVGroups":
        """One full-attention group whose layers are named by the caches registered later."""
        return cls([Group(FULL, ())], [])

    @classmethod
    def single(cls, names: Sequence[str]) -> "KVGroups":
        names = sorted(names, key=layer_order)
        return cls([Group(FULL, tuple(range(len(names))))], names)

    @classmethod
    def of(cls, kv_cache_config, block_size: int) -> "KVGroups | None":
        """The groups of vLLM's `KVCacheConfig` (None: not known yet, as in tools and tests that
        build the connector without one). Raises Unsupported."""
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if not groups:
            return None
        per_group: list[tuple[str, int, list[str]]] = []
        for gs in groups:
            spec, layers = gs.kv_cache_spec, list(gs.layer_names)
            per_layer = getattr(spec, "kv_cache_specs", None)      # UniformTypeKVCacheSpecs
            kinds = {_kind(per_layer.get(n, spec) if per_layer else spec) for n in layers}
            if len(kinds) != 1:
                raise Unsupported(f"a KV cache group mixes attention kinds {sorted(kinds)}")
            bs = int(getattr(spec, "block_size", block_size))
            if bs != block_size:
                raise Unsupported(f"a KV cache group with {bs}-token blocks beside the engine's {block_size}")
            (kind, window), = kinds
            per_group.append((kind, window, layers))
        names = sorted((n for *_, layers in per_group for n in layers), key=layer_order)
        if len(set(names)) != len(names):
            raise Unsupported("a layer is in two KV cache groups")
        pos = {n: i for i, n in enumerate(names)}
        return cls([Group(kind, tuple(sorted(pos[n] for n in layers)), window)
                    for kind, window, layers in per_group], names)

    # -- identity -------------------------------------------------------------------------------
    @property
    def descriptor(self) -> str:
        """The structure, for the namespace: "" for one full-attention group (the bytes of any
        engine that keeps every token), else each group's kind, window and layers."""
        if len(self.groups) == 1 and self.groups[0].kind == FULL:
            return ""
        parts = []
        for g in self.groups:
            kind = f"{SLIDING}{g.window}" if g.kind == SLIDING else g.kind
            parts.append(f"{kind}:{','.join(map(str, g.layers))}")
        return "vllm-groups-v1/" + ";".join(parts)

    @property
    def sliding(self) -> bool:
        return any(g.kind == SLIDING for g in self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    # -- block ids ------------------------------------------------------------------------------
    def ids(self, table: Sequence[Sequence[int]], first: int, last: int) -> list[list[int]]:
        """Per group, vLLM's blocks `first` .. `last - 1` of a request's block table; -1 where
        a sliding group has the null block (nothing to copy there)."""
        out = []
        for g, grp in enumerate(self.groups):
            row = list(table[g][first:last])
            if grp.kind == SLIDING:
                row = [-1 if b == 0 else b for b in row]
            out.append(row)
        return out

    def complete(self, table: Sequence[Sequence[int]], start: int, end: int, block_size: int) -> bool:
        """Whether the table holds, for every group, what a tier block of tokens [start, end)
        must carry: every token for full attention, those from `end - window + 1` on for a
        sliding window (see the module's docstring)."""
        for g, grp in enumerate(self.groups):
            lo = start if grp.kind == FULL else max(start, end - grp.retained)
            row = table[g]
            first, last = lo // block_size, -(-end // block_size)
            if len(row) < last:
                return False
            if grp.kind == SLIDING and any(b == 0 for b in row[first:last]):
                return False
        return True
