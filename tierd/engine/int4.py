"""INT4 KV cache (`kv_cache_dtype="int4"`): group-wise asymmetric 4-bit keys and values, as
KIVI quantizes them, in paged blocks.

- Values per token: each token's `head_dim` values of a head in groups of `group`, each group
  with a float16 minimum and step (value = min + q * step, q in 0..15).
- Keys per channel: each channel of a head over the block's `block_size` tokens (the group
  along tokens is the block), with a float16 minimum and step per channel. A block's keys are
  quantized when the block fills; until then they wait in full precision in a per-block
  residual (KIVI's full-precision window of recent tokens), which attention reads directly. Only
  partial blocks have a residual, and a partial block belongs to one sequence.
- A query always sees its own block's keys in full precision and earlier blocks' keys
  quantized: a block's per-channel statistics cover tokens after the query, so this is the one
  rule that does not depend on how prompts are chunked or batched (a block completed in this
  step keeps its full-precision keys until the step's attention has run).
- Two values a byte, low nibble first.

Per head and token the cache holds head_dim / 2 bytes of keys and of values, plus 4 bytes per
channel per block (keys) and 4 bytes per group per token (values): about 3.2x smaller than
float16 at head_dim 128 (2.9x at 64) with groups of 32 and blocks of 32.

This is the CPU reference; it never sees files or the store. Metadata in float16 limits
magnitudes to 65504 (larger keys or values are clamped there).
"""

from __future__ import annotations

import torch

F16_MAX = 65504.0


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit asymmetric quantization of `x` along `dim` (the group): (q uint8 in 0..15, min,
    step), min and step float16 with `dim` kept as size 1."""
    xf = x.float().clamp(-F16_MAX, F16_MAX)
    lo = xf.amin(dim=dim, keepdim=True).half()
    hi = xf.amax(dim=dim, keepdim=True)
    step = ((hi - lo.float()) / 15.0).clamp(min=0.0).half()
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    q = torch.round((xf - lo.float()) / safe).clamp(0, 15).to(torch.uint8)
    return q, lo, step


def dequantize(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * step.float() + lo.float()).to(dtype)


def pack(q: torch.Tensor, dim: int) -> torch.Tensor:
    """Two 4-bit values a byte along `dim` (even length): low nibble = even index."""
    dim %= q.dim()
    a, b = q.unflatten(dim, (q.shape[dim] // 2, 2)).unbind(dim + 1)
    return a | (b << 4)


def unpack(p: torch.Tensor, dim: int) -> torch.Tensor:
    dim %= p.dim()
    return torch.stack((p & 0x0F, p >> 4), dim=dim + 1).flatten(dim, dim + 1)


class Int4LayerCache:
    """One layer's int4 K/V cache of `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, group: int,
                 dtype: torch.dtype):
        if head_dim % group or group % 2:
            raise ValueError(f"int4 group {group} must divide head_dim {head_dim} (and be even)")
        if block_size % 2:
            raise ValueError("int4 caches need an even block size")
        self.block_size, self.kv_heads, self.head_dim, self.group, self.dtype = (
            block_size, kv_heads, head_dim, group, dtype)
        nb, bs, h, d = num_blocks, block_size, kv_heads, head_dim
        self.k_q = torch.zeros(nb, bs // 2, h, d, dtype=torch.uint8)         # tokens packed in pairs
        self.k_min = torch.zeros(nb, 1, h, d, dtype=torch.float16)
        self.k_step = torch.zeros(nb, 1, h, d, dtype=torch.float16)
        self.v_q = torch.zeros(nb, bs, h, d // 2, dtype=torch.uint8)         # channels packed in pairs
        self.v_min = torch.zeros(nb, bs, h, d // group, dtype=torch.float16)
        self.v_step = torch.zeros(nb, bs, h, d // group, dtype=torch.float16)
        self.residual: dict[int, torch.Tensor] = {}   # block -> (bs, h, d) keys of a partial block
        self.completed: dict[int, torch.Tensor] = {}  # blocks filled by the last write: their keys

    @staticmethod
    def bytes_per_block(block_size: int, kv_heads: int, head_dim: int, group: int) -> int:
        per_head = block_size * head_dim // 2 * 2 + head_dim * 4 + block_size * (head_dim // group) * 4
        return per_head * kv_heads

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k_q, self.k_min, self.k_step, self.v_q, self.v_min, self.v_step))

    def forget(self, block: int) -> None:
        """A freed block's residual goes (a partial block is never shared)."""
        self.residual.pop(block, None)
        self.completed.pop(block, None)

    # -- writes ---------------------------------------------------------------------------------
    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Cache key/value (T, kv_heads, head_dim) at slots (block * block_size + offset; -1:
        padding). Values are quantized now; keys wait in the block's residual until the block
        fills (writes into a block come in token order)."""
        bs, g = self.block_size, self.group
        self.completed.clear()
        keep = slot_mapping >= 0
        slots, k, v = slot_mapping[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        blocks, offs = slots // bs, slots % bs
        t, h, d = v.shape
        q, lo, step = quantize(v.reshape(t, h, d // g, g), dim=-1)
        self.v_q[blocks, offs] = pack(q.reshape(t, h, d), dim=-1)
        self.v_min[blocks, offs] = lo.squeeze(-1)
        self.v_step[blocks, offs] = step.squeeze(-1)
        for b in torch.unique(blocks).tolist():
            sel = blocks == b
            o = offs[sel]
            res = self.residual.get(b)
            if res is None or int(o.min()) == 0:       # a block's first token starts it afresh
                res = self.residual[b] = torch.zeros(bs, h, d, dtype=self.dtype)
            res[o] = k[sel].to(self.dtype)
            if int(o.max()) == bs - 1:                 # full: quantize its keys per channel
                q, lo, step = quantize(res, dim=0)
                self.k_q[b] = pack(q, dim=0)
                self.k_min[b], self.k_step[b] = lo, step
                self.completed[b] = self.residual.pop(b)

    # -- reads ----------------------------------------------------------------------------------
    def gather(self, table: torch.Tensor, length: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, own_keys, values), each (length, kv_heads, head_dim), of one sequence: keys
        as later blocks' queries see them (full blocks dequantized, a partial block's from its
        residual); own_keys as the block's own queries see them (full precision where still
        held: a partial block, or one filled by the last write); values dequantized."""
        bs, g = self.block_size, self.group
        n = (length + bs - 1) // bs
        ids = table[:n]
        h, d = self.kv_heads, self.head_dim
        k = dequantize(unpack(self.k_q[ids], dim=1), self.k_min[ids], self.k_step[ids], dtype)   # (n, bs, h, d)
        blocks = ids.tolist()
        for i, b in enumerate(blocks):
            res = self.residual.get(b)
            if res is not None:
                k[i] = res.to(dtype)
        own = k
        for i, b in enumerate(blocks):
            done = self.completed.get(b)
            if done is not None:
                if own is k:
                    own = k.clone()
                own[i] = done.to(dtype)
        vq = unpack(self.v_q[ids], dim=-1).reshape(n, bs, h, d // g, g)
        v = dequantize(vq, self.v_min[ids].unsqueeze(-1), self.v_step[ids].unsqueeze(-1), dtype)
        flat = lambda t: t.reshape(n * bs, h, d)[:length]  # noqa: E731
        return flat(k), flat(own), flat(v)
