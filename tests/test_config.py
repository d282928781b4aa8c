"""Sizes and settings."""

import pytest

from tierd.config import StoreConfig, format_size, parse_size
from tierd.errors import ConfigError


@pytest.mark.parametrize("text,expected", [
    ("64GiB", 64 << 30), ("512MiB", 512 << 20), ("4096", 4096), ("1.5KiB", 1536), ("2G", 2 * 10**9),
    ("10 mb", 10**7), (123, 123)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_percentages_need_a_total():
    assert parse_size("10%", total=1000) == 100
    with pytest.raises(ConfigError, match="percentage"):
        parse_size("10%")
    with pytest.raises(ConfigError, match="more than 100%"):
        parse_size("150%", total=10)


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-5", True, -1])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_format_size():
    assert format_size(1536) == "1.5KiB" and format_size(64 << 30) == "64GiB" and format_size(10) == "10B"


@pytest.mark.parametrize("kw", [dict(host_high_watermark=0.5, host_low_watermark=0.7),
                                dict(disk_codec="lz4"), dict(eviction_policy="mru"),
                                dict(host_slab_bytes="5000"), dict(disk_io_threads=0)])
def test_inconsistent_settings_are_refused(kw):
    with pytest.raises(ConfigError):
        StoreConfig(**kw).resolved()
