"""Tiers: where a block's bytes live, each behind the interface of `base.Tier`: `host`
(shared-memory RAM), `disk` (NVMe slab files), `gpu` (an HBM arena; imports torch)."""

from .base import BlockMeta, Tier
from .disk import DiskTier
from .host import HostTier

__all__ = ["BlockMeta", "DiskTier", "HostTier", "Tier"]
