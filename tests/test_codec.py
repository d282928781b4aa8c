"""Disk payload codecs round-trip bit-exact."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tierd import codec


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=4096).filter(lambda b: len(b) % 2 == 0),
       st.sampled_from([codec.CODEC_ZSTD, codec.CODEC_ZSTD_SHUFFLE2]))
def test_codec_round_trip(data, c):
    raw = np.frombuffer(data, dtype=np.uint8)
    out = np.empty_like(raw)
    codec.decode(c, codec.encode(c, raw), out)
    assert out.tobytes() == data


def test_shuffle_compresses_fp16_kv_like_data_better():
    rng = np.random.default_rng(0)
    kv = (rng.standard_normal(1 << 16) * 0.5).astype(np.float16).view(np.uint8)
    plain = len(codec.encode(codec.CODEC_ZSTD, kv))
    shuffled = len(codec.encode(codec.CODEC_ZSTD_SHUFFLE2, kv))
    assert shuffled < plain < kv.nbytes


def test_choose_codec():
    assert codec.choose_codec("none", 2, 4096) == codec.CODEC_NONE
    assert codec.choose_codec("zstd", 2, 4096) == codec.CODEC_ZSTD_SHUFFLE2
    assert codec.choose_codec("zstd", 4, 4096) == codec.CODEC_ZSTD
