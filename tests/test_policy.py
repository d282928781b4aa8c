"""Eviction policies: order, pins, scan resistance; admission."""

import pytest

from tierd.policy import POLICIES, AdmissionFilter, LRUPolicy, S3FIFOPolicy


def drain(policy, can=lambda k: True, n=None):
    out = []
    while len(policy) and (n is None or len(out) < n):
        k = policy.victim(can)
        if k is None:
            break
        policy.remove(k, evicted=True)
        out.append(k)
    return out


def test_lru_evicts_least_recently_used_first():
    p = LRUPolicy()
    for k in range(5):
        p.insert(k)
    p.hit(0)
    p.hit(2)
    assert drain(p) == [1, 3, 4, 0, 2]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pinned_keys_are_skipped_not_lost(name):
    p = POLICIES[name]()
    for k in range(10):
        p.insert(k)
    pinned = {0, 1, 2}
    evicted = drain(p, lambda k: k not in pinned)
    assert set(evicted) == set(range(3, 10))
    assert len(p) == 3 and p.victim(lambda k: k not in pinned) is None
    assert set(drain(p)) == pinned


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_forgets_a_key(name):
    p = POLICIES[name]()
    for k in range(4):
        p.insert(k)
    p.remove(2)
    assert 2 not in p and sorted(drain(p)) == [0, 1, 3]


def test_s3fifo_resists_a_scan_that_lru_does_not():
    """A hot working set hit repeatedly, then a one-pass scan of cold keys three times the
    cache size: S3-FIFO keeps the hot set, LRU flushes it."""
    capacity, hot = 100, list(range(50))
    survivors = {}
    for name, cls in (("lru", LRUPolicy), ("s3fifo", S3FIFOPolicy)):
        p = cls()
        for _ in range(3):
            for k in hot:
                if k in p:
                    p.hit(k)
                else:
                    p.insert(k)
                    while len(p) > capacity:
                        p.remove(p.victim(lambda k: True), evicted=True)
        for k in range(1000, 1300):
            p.insert(k)
            while len(p) > capacity:
                p.remove(p.victim(lambda k: True), evicted=True)
        survivors[name] = sum(k in p for k in hot)
    assert survivors["lru"] == 0
    assert survivors["s3fifo"] == len(hot)


def test_s3fifo_ghost_hit_goes_straight_to_main():
    p = S3FIFOPolicy()
    for k in range(20):
        p.insert(k)
    first = drain(p, n=1)[0]
    p.insert(first)  # seen recently: admitted to main, survives the next small-queue sweep
    evicted = drain(p, n=10)
    assert first not in evicted


def test_admission_filter():
    assert AdmissionFilter(0).admit(0)
    f = AdmissionFilter(2)
    assert not f.admit(1) and f.admit(2)
