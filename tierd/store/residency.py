"""Residency: the store's record of each tier (which block owns each slot, the tier's eviction
order, counters) and allocation with eviction, written once for every tier: where a block's
eviction is chosen. Memory only."""

from __future__ import annotations

from .records import Block

COUNTERS = ("evictions", "demotions", "promotions", "bytes_in", "bytes_out", "corrupt_dropped",
            "admission_rejected", "io_errors")


class Resident:
    """The store's record of one tier: which block owns each of its slots, the tier's eviction
    order, its counters, and how a block's slot, resident children and evictability are read
    (the block fields differ per tier). Allocation with eviction and slab reclaim are written
    once, for every tier, in terms of this record. Memory only; every method is called with
    the store's lock held.

    Collaborators: `blocks`, the store's block index (ikey -> Block: the policy names blocks by
    ikey), and the three readers above. Invariants: `owner[slot]` is the block holding `slot`,
    for every slot a block holds in any state (a staged slot, or a disk slot whose header is
    being erased, has no entry: neither eviction nor a slab's reassignment can take it); the
    policy orders the blocks whose copy here is in place (one being read in or copied into HBM
    joins it once it is there; an orphan has left it).
    """

    __slots__ = ("name", "tier", "owner", "policy", "counters", "blocks", "slot_of", "children_of", "evictable")

    def __init__(self, name: str, policy, blocks: dict[bytes, Block], *, slot_of, children_of, evictable):
        self.name = name
        self.tier = None                       # the Tier (None: not configured)
        self.owner: dict[int, Block] = {}     # slot -> the block holding it
        self.policy = policy                   # eviction order of the blocks resident here
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.blocks = blocks
        self.slot_of, self.children_of, self.evictable = slot_of, children_of, evictable

    def stats(self, extra_waste: int = 0) -> dict:
        u = self.tier.usage()
        u["waste_bytes"] += extra_waste
        u.update(blocks=len(self.owner), **self.counters)
        u["waste_ratio"] = u["waste_bytes"] / max(1, u["capacity_bytes"])
        return u

    def alloc(self, slot_bytes: int, evict, wait=None) -> int | None:
        """(Lock held.) A free slot of `slot_bytes` in this tier: a free slot; else an empty
        slab of another size class given back and taken; else the policy's coldest evictable
        block of that size with no resident descendants evicted (`evict(block)`); else a whole
        slab of another class emptied. When nothing can go, `wait()` may wait for something to
        become evictable (True: try again). None when there is no room."""
        tier = self.tier
        alloc = tier.alloc
        if slot_bytes > alloc.usable_slab_bytes:
            return None
        for _ in range(64 + 2 * len(self.owner)):
            slot = tier.alloc_slot(slot_bytes)
            if slot is not None:
                return slot
            slab = alloc.empty_slab_elsewhere(slot_bytes)
            if slab is not None:
                tier.release_slab(slab)
                continue
            victim = self.victim(slot_bytes)
            if victim is not None:
                evict(victim)
                continue
            if self.evict_slab(slot_bytes, evict):
                continue
            if wait is None or not wait():
                return None
        return None

    def victim(self, slot_bytes: int) -> Block | None:
        """(Lock held.) The policy's coldest evictable block in this tier with no resident
        descendants whose slot is `slot_bytes` (its eviction frees a slot of that size), or None."""
        alloc, blocks = self.tier.alloc, self.blocks
        cls = alloc.classes.get(slot_bytes)
        if cls is None or not cls.slabs:
            return None
        key = self.policy.victim(
            lambda k: self.evictable(blocks[k]) and self.children_of(blocks[k]) == 0
            and alloc.slot_bytes_of(self.slot_of(blocks[k])) == slot_bytes)
        return blocks[key] if key is not None else None

    def evict_slab(self, slot_bytes: int, evict) -> bool:
        """(Lock held.) Empty the slab of another size class that is cheapest to empty (every
        block in it evictable, no slot held by a write or an erase in flight) and give it back
        to the free pool. True on success."""
        alloc = self.tier.alloc
        best, best_used = None, None
        for sb, c in alloc.classes.items():
            if sb == slot_bytes:
                continue
            for slab in c.slabs:
                owned = [self.owner[s] for s in alloc.slots_of_slab(slab) if s in self.owner]
                if len(owned) != alloc.slab_used[slab] or not all(self.evictable(b) for b in owned):
                    continue
                if best is None or len(owned) < best_used:
                    best, best_used = slab, len(owned)
        if best is None:
            return False
        for s in alloc.slots_of_slab(best):
            b = self.owner.get(s)
            if b is not None and self.evictable(b):
                evict(b)     # may release the lock (a host block written down first)
        if alloc.slab_used[best] == 0 and alloc.slab_class[best]:
            self.tier.release_slab(best)
            return True
        return False

    def free(self, slot: int, *, evicted: bool, free: bool = True) -> None:
        """(Lock held.) `slot` no longer belongs to its block; with `free=False` it stays taken
        (its header is erased on disk first)."""
        del self.owner[slot]
        if free:
            self.tier.free_slot(slot)
        if evicted:
            self.counters["evictions"] += 1
