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
`planes=1`).

Mamba and linear-attention layers (`MambaSpec` groups, vLLM's "align" mode, which its prefix
caching turns on) keep no KV per token but one recurrent state per request, valid only after a
block's last token: vLLM keeps the state after token `(j + 1) * block_size` in the group's block
`j` when a step ends exactly there (it splits prefills at block boundaries), and copies it into
the next running block at the start of the next step. Those states go to a state namespace of
their own (`Namespace.state`: a page per state layer, in the engine's layout and dtypes, which
the descriptor records), keyed by the same token prefix as the tier block they end; a hit needs
the KV of every attention layer up to N and the state at N. Tier blocks are then one engine block
(`block_tokens` = the hybrid block size).

Declined, with the reason logged once: sliding-window or sparse MLA, Mamba state without vLLM's
prefix caching (no state is kept at block boundaries), speculative or checkpoint state blocks,
chunked-local and other attention kinds, and groups whose block size is not the engine's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from tierd.errors import TierdError

FULL, SLIDING, STATE = "full", "sliding", "state"


class Unsupported(TierdError):
    """A KV cache structure the connector does not cache (the reason is the message)."""


def layer_order(name: str) -> tuple:
    """Sort key that orders 'model.layers.10.self_attn.attn' after '...layers.9...'."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class Group:
    kind: str                  # FULL, SLIDING or STATE
    layers: tuple[int, ...]    # positions in the tier block's layer order (STATE: in `state_names`)
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
    if name == "MambaSpec":
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise Unsupported(f"Mamba / linear-attention state in vLLM's {mode!r} cache mode keeps no state at "
                              "block boundaries (vLLM's prefix caching turns on its 'align' mode)")
        if getattr(spec, "num_speculative_blocks", 0) or getattr(spec, "num_prefill_checkpoint_blocks", 0):
            raise Unsupported("Mamba state with speculative or prefill-checkpoint blocks is not supported")
        return STATE, 0
    if "Mamba" in name:
        raise Unsupported(f"recurrent state {name} is not supported")
    raise Unsupported(f"KV cache spec {name} is not supported")


class KVGroups:
    """The groups of one model, its layers in tier-block order (`names`)."""

    def __init__(self, groups: Sequence[Group], names: Sequence[str], state_names: Sequence[str] = (),
                 state: str = "", state_bytes: int = 0):
        self.groups = list(groups)                 # vLLM's order: block tables come per group
        self.names = list(names)                   # attention layers, in tier-block order
        self.state_names = list(state_names)       # state layers, in state-block order
        self.state, self.state_bytes = state, state_bytes   # their layout and page bytes
        self.kv = [g for g, grp in enumerate(self.groups) if grp.kind != STATE]
        self.states = [g for g, grp in enumerate(self.groups) if grp.kind == STATE]
        # each attention layer's position among the KV groups (the copies' block ids hold those)
        self.layer_group = [0] * len(self.names)
        for a, g in enumerate(self.kv):
            for i in self.groups[g].layers:
                self.layer_group[i] = a

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
        pages: dict[str, tuple] = {}
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
            if kind == STATE:
                for n in layers:
                    pages[n] = _page(per_layer.get(n, spec) if per_layer else spec)
        names = sorted((n for kind, _, layers in per_group if kind != STATE for n in layers), key=layer_order)
        state_names = sorted(pages, key=layer_order)
        every = names + state_names
        if len(set(every)) != len(every) or len(every) != sum(len(layers) for *_, layers in per_group):
            raise Unsupported("a layer is in two KV cache groups")
        if state_names and not names:
            raise Unsupported("a model of recurrent state alone (no attention layer) is not supported")
        state, state_bytes = "", 0
        if pages:
            kinds = set(pages.values())
            if len(kinds) != 1:
                raise Unsupported(f"state layers of {len(kinds)} different layouts are not supported")
            (state, state_bytes), = kinds
            state = f"{state};{len(state_names)} layers;conv {_conv_layout()}"
        pos = {n: i for i, n in enumerate(names)}
        pos.update({n: i for i, n in enumerate(state_names)})
        return cls([Group(kind, tuple(sorted(pos[n] for n in layers)), window)
                    for kind, window, layers in per_group], names, state_names, state, state_bytes)

    # -- identity -------------------------------------------------------------------------------
    @property
    def descriptor(self) -> str:
        """The structure, for the namespace: "" for one full-attention group (the bytes of any
        engine that keeps every token), else each group's kind, window and layers."""
        if len(self.groups) == 1 and self.groups[0].kind == FULL:
            return ""
        parts = []
        for g in (self.groups[g] for g in self.kv):
            kind = f"{SLIDING}{g.window}" if g.kind == SLIDING else g.kind
            parts.append(f"{kind}:{','.join(map(str, g.layers))}")
        if self.states:     # the attention layers' KV of a model that also keeps recurrent state
            parts.append(f"{STATE}:{len(self.state_names)}")
        return "vllm-groups-v1/" + ";".join(parts)

    @property
    def sliding(self) -> bool:
        return any(g.kind == SLIDING for g in self.groups)

    @property
    def has_state(self) -> bool:
        return bool(self.states)

    def __len__(self) -> int:
        return len(self.groups)

    # -- block ids ------------------------------------------------------------------------------
    def ids(self, table: Sequence[Sequence[int]], first: int, last: int) -> list[list[int]]:
        """Per KV group (`kv`), vLLM's blocks `first` .. `last - 1` of a request's block table;
        -1 where a sliding group has the null block (nothing to copy there)."""
        out = []
        for g in self.kv:
            grp = self.groups[g]
            row = list(table[g][first:last])
            if grp.kind == SLIDING:
                row = [-1 if b == 0 else b for b in row]
            out.append(row)
        return out

    def complete(self, table: Sequence[Sequence[int]], start: int, end: int, block_size: int) -> bool:
        """Whether the table holds, for every group, what a tier block of tokens [start, end)
        must carry: every token for full attention, those from `end - window + 1` on for a
        sliding window (see the module's docstring)."""
        for g in self.kv:
            grp = self.groups[g]
            lo = start if grp.kind == FULL else max(start, end - grp.retained)
            row = table[g]
            first, last = lo // block_size, -(-end // block_size)
            if len(row) < last:
                return False
            if grp.kind == SLIDING and any(b == 0 for b in row[first:last]):
                return False
        return True

    def state_ids(self, table: Sequence[Sequence[int]], index: int) -> list[int] | None:
        """Per state group, vLLM's block `index` of a request's table (the state after token
        `(index + 1) * block_size` where a step ended there); None if a group has none."""
        out = []
        for g in self.states:
            row = table[g]
            if not 0 <= index < len(row) or row[index] <= 0:
                return None
            out.append(int(row[index]))
        return out


def _page(spec) -> tuple[str, int]:
    """(layout description, bytes) of one state layer's page: each state's shape and dtype, in
    the order vLLM lays them out in the page."""
    shapes = tuple(tuple(int(d) for d in s) for s in spec.shapes)
    dtypes = tuple(str(d).removeprefix("torch.") for d in spec.dtypes)
    kind = getattr(getattr(spec, "mamba_type", None), "name", None) or str(getattr(spec, "mamba_type", ""))
    nbytes = sum(math.prod(shape) * dt.itemsize for shape, dt in zip(shapes, spec.dtypes))
    desc = f"{kind}:" + ",".join(f"{dt}{list(shape)}" for shape, dt in zip(shapes, dtypes))
    if getattr(spec, "tp_replicated", False):
        desc += ";replicated"
    return desc, nbytes


def _conv_layout() -> str:
    """vLLM's conv-state layout ("SD" or "DS"), which the shapes alone may not show."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
        return str(get_conv_state_layout())
    except Exception:  # noqa: BLE001 - vLLM absent (drivers): its default
        return "SD"
