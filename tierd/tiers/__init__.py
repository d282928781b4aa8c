"""Tiers: where a block's bytes live. `host` (shared-memory RAM) and `disk` (NVMe slab files)."""

from .disk import DiskTier
from .host import HostTier

__all__ = ["DiskTier", "HostTier"]
