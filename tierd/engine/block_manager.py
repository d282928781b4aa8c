"""The paged KV cache's block manager: allocation, reference counts and prefix caching.

Invariants (each kept by the method beside it):
- a block is in `free` iff its ref_count is 0; freed blocks keep their key and stay hit-able
  until `allocate` reuses them (LRU: the front of `free` goes first);
- a sequence frees its blocks tail first, so a chain's tail is evicted before its head;
- `cached` maps a key to the one block holding it; only full blocks have keys, from
  `tierd.keys` (the same function that names tier blocks).
"""

from __future__ import annotations

from collections import OrderedDict

from ..keys import extend_keys
from .sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "key")

    def __init__(self, bid: int):
        self.id, self.ref_count, self.key = bid, 0, None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, root_key: bytes, prefix_caching: bool = True,
                 on_free=None):
        self.on_free = on_free        # called with a block id whose last reference went
        self.block_size = block_size
        self.root_key = root_key
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.hits = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _keys(self, seq: Sequence, upto_blocks: int) -> list[bytes]:
        """seq.block_keys extended to the first `upto_blocks` full blocks."""
        return extend_keys(seq.block_keys, self.root_key, seq.token_ids, self.block_size, upto_blocks)

    def admit(self, seq: Sequence) -> int:
        """Give a new (or preempted) sequence the cached blocks of its longest cached prefix;
        returns the tokens they cover. At least one token is always left to compute (its
        logits are needed)."""
        if not self.prefix_caching:
            return 0
        full = (seq.num_tokens - 1) // self.block_size
        keys = self._keys(seq, full)
        for key in keys[:full]:
            bid = self.cached.get(key)
            if bid is None:
                break
            b = self.blocks[bid]
            if b.ref_count == 0:
                del self.free[bid]
            b.ref_count += 1
            seq.block_table.append(bid)
        n = len(seq.block_table) * self.block_size
        seq.num_computed = n
        self.hits += len(seq.block_table)
        return n

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        need = self.blocks_needed(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return
        # one loop over the free list (a host hit allocates its blocks at once: 32 for 512 tokens)
        free, blocks, cached, table = self.free, self.blocks, self.cached, seq.block_table
        for _ in range(need):
            bid, _ = free.popitem(last=False)
            b = blocks[bid]
            if b.key is not None:                 # evict it from the prefix cache
                if cached.get(b.key) == bid:
                    del cached[b.key]
                b.key = None
            b.ref_count = 1
            table.append(bid)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks that the last step filled, so later requests can hit them."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.block_size
        keys = self._keys(seq, full)
        for i in range(full):
            if seq.block_table[i] < 0:
                continue
            b = self.blocks[seq.block_table[i]]
            if b.key is None and keys[i] not in self.cached:
                b.key = keys[i]
                self.cached[keys[i]] = b.id

    def free_before(self, seq: Sequence, first_needed_pos: int, keep_first: int = 0) -> int:
        """Sliding window: free the blocks that hold only positions before `first_needed_pos`,
        which no later query can attend to, except the first `keep_first` blocks (attention
        sinks); their table entries become -1. Returns blocks freed."""
        return sum(self.free_entry(seq, i)
                   for i in range(keep_first, min(first_needed_pos // self.block_size, len(seq.block_table))))

    def free_entry(self, seq: Sequence, i: int) -> bool:
        """Drop the sequence's block-table entry `i` (out of its window, or evicted); the entry
        becomes -1. Returns whether it held a block."""
        bid = seq.block_table[i]
        if bid < 0:
            return False
        self._unref(bid)
        seq.block_table[i] = -1
        return True

    def free_seq(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):   # tail first: evicted before the head
            if bid >= 0:
                self._unref(bid)
        seq.block_table = []

    def _unref(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref_count -= 1
        if b.ref_count == 0:
            self.free[bid] = None
            if self.on_free is not None:
                self.on_free(bid)
