"""Residency: the store's record of each tier (which block owns each slot, the tier's eviction
order, counters) and allocation with eviction, written once for every tier. Memory only."""

from __future__ import annotations

from .records import Block

COUNTERS = ("evictions", "demotions", "promotions", "bytes_in", "bytes_out", "corrupt_dropped",
            "admission_rejected", "io_errors")


class Resident:
    """The store's record of one tier: which block owns each of its slots, the tier's eviction
    order, its counters, and how a block's slot, resident children and evictability are read
    (the block fields differ per tier). Allocation with eviction and slab reclaim are written
    once, for every tier, in terms of this record (TieredStore._alloc, _evict_slab)."""

    __slots__ = ("name", "tier", "owner", "policy", "counters", "slot_of", "children_of", "evictable")

    def __init__(self, name: str, policy, *, slot_of, children_of, evictable):
        self.name = name
        self.tier = None                       # the Tier (None: not configured)
        self.owner: dict[int, Block] = {}     # slot -> the block holding it
        self.policy = policy                   # eviction order of the blocks resident here
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.slot_of, self.children_of, self.evictable = slot_of, children_of, evictable

    def stats(self, extra_waste: int = 0) -> dict:
        u = self.tier.usage()
        u["waste_bytes"] += extra_waste
        u.update(blocks=len(self.owner), **self.counters)
        u["waste_ratio"] = u["waste_bytes"] / max(1, u["capacity_bytes"])
        return u


class Residency:
    """Part of `TieredStore` (see its docstring): state and lock are the store's."""

    def _alloc(self, r: Resident, slot_bytes: int, evict, wait=None) -> int | None:
        """(Lock held.) A free slot of `slot_bytes` in `r`'s tier: a free slot; else an empty
        slab of another size class given back and taken; else the policy's coldest evictable
        block of that size with no resident descendants evicted (`evict(block)`); else a whole
        slab of another class emptied. When nothing can go, `wait()` may wait for something to
        become evictable (True: try again). None when there is no room."""
        tier = r.tier
        alloc = tier.alloc
        if slot_bytes > alloc.usable_slab_bytes:
            return None
        blocks = self._blocks
        for _ in range(64 + 2 * len(r.owner)):
            slot = tier.alloc_slot(slot_bytes)
            if slot is not None:
                return slot
            slab = alloc.empty_slab_elsewhere(slot_bytes)
            if slab is not None:
                tier.release_slab(slab)
                continue
            victim = self._victim(r, slot_bytes)
            if victim is not None:
                evict(victim)
                continue
            if self._evict_slab(r, slot_bytes, evict):
                continue
            if wait is None or not wait():
                return None
        return None

    def _victim(self, r: Resident, slot_bytes: int) -> Block | None:
        """(Lock held.) The policy's coldest evictable block in `r`'s tier with no resident
        descendants whose slot is `slot_bytes` (its eviction frees a slot of that size), or None."""
        alloc, blocks = r.tier.alloc, self._blocks
        cls = alloc.classes.get(slot_bytes)
        if cls is None or not cls.slabs:
            return None
        key = r.policy.victim(
            lambda k: r.evictable(blocks[k]) and r.children_of(blocks[k]) == 0
            and alloc.slot_bytes_of(r.slot_of(blocks[k])) == slot_bytes)
        return blocks[key] if key is not None else None

    def _evict_slab(self, r: Resident, slot_bytes: int, evict) -> bool:
        """(Lock held.) Empty the slab of another size class that is cheapest to empty (every
        block in it evictable, no slot held by a write or an erase in flight) and give it back
        to the free pool. True on success."""
        alloc = r.tier.alloc
        best, best_used = None, None
        for sb, c in alloc.classes.items():
            if sb == slot_bytes:
                continue
            for slab in c.slabs:
                owned = [r.owner[s] for s in alloc.slots_of_slab(slab) if s in r.owner]
                if len(owned) != alloc.slab_used[slab] or not all(r.evictable(b) for b in owned):
                    continue
                if best is None or len(owned) < best_used:
                    best, best_used = slab, len(owned)
        if best is None:
            return False
        for s in alloc.slots_of_slab(best):
            b = r.owner.get(s)
            if b is not None and r.evictable(b):
                evict(b)     # may release the lock (a host block written down first)
        if alloc.slab_used[best] == 0 and alloc.slab_class[best]:
            r.tier.release_slab(best)
            return True
        return False

    def _free(self, r: Resident, slot: int, *, evicted: bool, free: bool = True) -> None:
        """(Lock held.) `slot` of `r`'s tier no longer belongs to its block."""
        del r.owner[slot]
        if free:
            r.tier.free_slot(slot)
        if evicted:
            r.counters["evictions"] += 1
