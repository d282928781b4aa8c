"""Settings of a store and the parsing of human sizes ("64GiB", "512MiB", "10%").

Owns defaults and validation only; it never touches memory or files.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
ALIGN = 4096

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_size(value: str | int | float, *, total: int | None = None, what: str = "size") -> int:
    """Bytes from `64GiB`, `512MiB`, `1.5G`, `4096`, or `10%` (of `total`)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like 64GiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{what}: size must not be negative, got {value}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"{what}: cannot parse {value!r}; use e.g. 64GiB, 512MiB, 4096 or 10%")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if total is None:
            raise ConfigError(f"{what}: a percentage ({value}) is not allowed here; give bytes")
        if number > 100:
            raise ConfigError(f"{what}: {value} is more than 100%")
        return int(total * number / 100)
    if unit not in _UNITS:
        raise ConfigError(f"{what}: unknown unit {m.group(2)!r} in {value!r}; use B, KiB, MiB, GiB, TiB or %")
    return int(number * _UNITS[unit])


def format_size(n: int | float) -> str:
    """`1536` -> `1.5KiB`; exact powers print without decimals."""
    n = float(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(slots=True)
class StoreConfig:
    """Everything a `TieredStore` needs; sizes in bytes after `resolved()`."""

    host_bytes: int | str = "1GiB"
    host_slab_bytes: int | str = "64MiB"
    host_high_watermark: float = 0.90
    host_low_watermark: float = 0.80
    disk_path: str | None = None
    disk_bytes: int | str = "16GiB"
    disk_slab_bytes: int | str = "256MiB"
    disk_file_bytes: int | str = "4GiB"
    disk_high_watermark: float = 0.95
    disk_low_watermark: float = 0.90
    disk_codec: str = "none"            # "none" or "zstd" (byte-plane shuffled for 16-bit dtypes)
    disk_zstd_level: int = 1
    disk_direct_io: bool = True          # O_DIRECT where the filesystem allows it
    disk_admit_min_hits: int = 0         # SSD admission: demote to disk only blocks hit >= N times
    disk_io_threads: int = 4
    eviction_policy: str = "lru"         # "lru" or "s3fifo"
    demotion_interval_s: float = 0.5     # background pass period (also woken on high watermark)
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> "StoreConfig":
        """A copy with sizes in bytes, checked for consistency."""
        c = StoreConfig(**{f.name: getattr(self, f.name) for f in fields(self)})
        c.host_bytes = parse_size(c.host_bytes, total=total_ram_bytes(), what="host_bytes")
        c.host_slab_bytes = parse_size(c.host_slab_bytes, what="host_slab_bytes")
        if c.disk_path is not None:
            c.disk_path = os.fspath(c.disk_path)
            disk_total = None
            try:
                st = os.statvfs(c.disk_path if os.path.isdir(c.disk_path) else os.path.dirname(os.path.abspath(c.disk_path)) or ".")
                disk_total = st.f_frsize * st.f_blocks
            except OSError:
                pass
            c.disk_bytes = parse_size(c.disk_bytes, total=disk_total, what="disk_bytes")
        else:
            c.disk_bytes = 0
        c.disk_slab_bytes = parse_size(c.disk_slab_bytes, what="disk_slab_bytes")
        c.disk_file_bytes = parse_size(c.disk_file_bytes, what="disk_file_bytes")
        for name in ("host_slab_bytes", "disk_slab_bytes"):
            v = getattr(c, name)
            if v < 2 * ALIGN or v % ALIGN:
                raise ConfigError(f"{name}: {v} must be a multiple of 4096 and at least 8192")
        for tier in ("host", "disk"):
            hi, lo = getattr(c, f"{tier}_high_watermark"), getattr(c, f"{tier}_low_watermark")
            if not (0.0 < lo <= hi <= 1.0):
                raise ConfigError(
                    f"{tier} watermarks: need 0 < low ({lo}) <= high ({hi}) <= 1")
        if c.disk_codec not in ("none", "zstd"):
            raise ConfigError(f"disk_codec: {c.disk_codec!r} is not one of 'none', 'zstd'")
        if c.eviction_policy not in ("lru", "s3fifo"):
            raise ConfigError(f"eviction_policy: {c.eviction_policy!r} is not one of 'lru', 's3fifo'")
        if c.disk_admit_min_hits < 0:
            raise ConfigError("disk_admit_min_hits must be >= 0")
        if c.disk_io_threads < 1:
            raise ConfigError("disk_io_threads must be >= 1")
        return c
