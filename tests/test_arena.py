"""Slab allocator and shared arena."""

import os

import numpy as np
import pytest

from tierd.arena import SharedArena, SlabAllocator, plan_slabs
from tierd.errors import CapacityError


def test_slots_are_aligned_disjoint_and_within_the_arena():
    a = SlabAllocator(4, 64 * 1024)
    slots = [a.alloc(12288) for _ in range(5)] + [a.alloc(4096) for _ in range(20)]
    assert None not in slots
    spans = sorted((a.offset(s), a.offset(s) + a.slot_bytes_of(s)) for s in slots)
    assert all(lo % 4096 == 0 for lo, _ in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    assert spans[-1][1] <= 4 * 64 * 1024
    assert a.used_bytes == 5 * 12288 + 20 * 4096


def test_full_arena_returns_none_and_freed_slots_are_reused():
    a = SlabAllocator(2, 16384)
    got = [a.alloc(8192) for _ in range(4)]
    assert None not in got and a.alloc(8192) is None
    a.free(got[1])
    assert a.alloc(8192) == got[1]


def test_waste_counts_slab_tails_and_arena_tail():
    a = SlabAllocator(2, 40960, capacity_bytes=2 * 40960 + 1000)
    a.alloc(12288)  # 3 slots of 12288 in 40960: tail 4096
    assert a.waste_bytes() == 1000 + 4096


def test_empty_slab_moves_to_another_class():
    a = SlabAllocator(1, 16384)
    s = a.alloc(8192)
    assert a.alloc(16384) is None
    a.free(s)
    slab = a.empty_slab_elsewhere(16384)
    assert slab == 0
    a.release_slab(slab)
    assert a.alloc(16384) is not None


def test_oversized_slot_is_refused_with_advice():
    a = SlabAllocator(1, 16384)
    with pytest.raises(CapacityError, match="raise the tier's slab_bytes"):
        a.check_slot_bytes(20480, "host tier")


def test_plan_shrinks_slab_to_small_arena():
    assert plan_slabs(40960, 1 << 20, "t") == (1, 40960)
    with pytest.raises(CapacityError):
        plan_slabs(100, 1 << 20, "t")


def test_shared_arena_file_is_private_and_visible_to_another_mapping(tmp_path):
    path = str(tmp_path / "arena")
    arena = SharedArena(1 << 20, path=path)
    try:
        assert os.stat(path).st_mode & 0o077 == 0
        arena.view(8192, 4)[:] = [1, 2, 3, 4]
        with open(path, "rb") as f:
            f.seek(8192)
            assert f.read(4) == bytes([1, 2, 3, 4])
        assert os.path.getsize(path) == 1 << 20
    finally:
        arena.close()
    assert not os.path.exists(path)


def test_memfd_arena_has_exact_size():
    arena = SharedArena(1 << 20)
    try:
        assert os.fstat(arena.fd).st_size == 1 << 20
        assert isinstance(arena.view(0, 16), np.ndarray)
    finally:
        arena.close()
