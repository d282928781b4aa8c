"""Tier payload codecs: the exact ones round-trip bit-exact; the lossy ones (fp8, int4) stay
within their stated error bounds, refuse what they cannot hold, and never let a lossy block answer
for a namespace that asked for exact bytes."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tierd import TieredStore, codec
from tierd.errors import NamespaceError

from .helpers import chain, make_ns


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
    assert codec.choose_codec("none", 2, 4096, "fp8") == codec.CODEC_FP8
    assert codec.choose_codec("zstd", 2, 4096, "int4:64") == codec.CODEC_INT4


ULP_HALF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24}   # relative rounding


def lossy_round_trip(x: np.ndarray, kv_dtype: str, spec: str):
    raw = x.view(np.uint8).reshape(-1)
    c = codec.choose_codec("none", x.dtype.itemsize, raw.size, spec)
    payload = codec.encode(c, raw, kv_dtype=kv_dtype, lossy=spec)
    out = np.empty_like(raw)
    codec.decode(c, payload, out)
    return out.view(x.dtype).astype(np.float32), len(payload)


@settings(max_examples=60, deadline=None)
@given(kv_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       spec=st.sampled_from(["fp8", "fp8:128", "int4", "int4:64", "int4:16"]),
       seed=st.integers(0, 2 ** 32 - 1), spread=st.floats(1e-3, 200.0), offset=st.floats(-50.0, 50.0))
@example(kv_dtype="float16", spec="int4:64", seed=498071296, spread=0.001, offset=0.0)   # tiny fp16 values
def test_lossy_codecs_stay_within_their_stated_bounds(kv_dtype, spec, seed, spread, offset):
    kind, group = codec.parse_lossy(spec)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(16 * group) * spread + offset).astype(np.float32).astype(codec._np_dtype(kv_dtype))
    xf = x.astype(np.float32).reshape(-1, group)
    y, size = lossy_round_trip(x, kv_dtype, spec)
    y = y.reshape(-1, group)
    err = np.abs(y - xf)
    # rounding back into the block's dtype: half an ulp of the decoded value (fp16: 2^-25 at the
    # least, its subnormal spacing being 2^-24)
    cast = (np.abs(xf) + np.abs(y.reshape(xf.shape))) * ULP_HALF[kv_dtype] + 2.0 ** -25
    if kind == "fp8":
        scale = np.abs(xf).max(axis=1, keepdims=True) / codec.FP8_MAX
        assert (err <= np.abs(xf) / 16 + scale / 1024 + cast).all()
        assert size == 16 + 16 * 4 + x.size                    # header, a scale per group, a byte each
    else:
        step = (xf.max(axis=1, keepdims=True) - xf.min(axis=1, keepdims=True)) / 15
        assert (err <= step / 2 * (1 + 1e-5) + cast + 1e-6 * np.abs(xf).max()).all()
        assert size == 16 + 16 * 8 + x.size // 2


def test_lossy_codecs_are_2_to_4x_smaller_than_fp16_and_not_exact():
    x = (np.random.default_rng(1).standard_normal(1 << 16)).astype(np.float16)
    for spec, ratio in (("fp8", 0.54), ("fp8:256", 0.51), ("int4", 0.376), ("int4:64", 0.32)):
        y, size = lossy_round_trip(x, "float16", spec)
        assert size / x.nbytes < ratio
        assert not np.array_equal(y, x.astype(np.float32))


def test_lossy_codecs_refuse_what_they_cannot_hold():
    raw = np.zeros(256, np.float16)
    raw[3] = np.inf
    with pytest.raises(ValueError, match="NaN or infinity"):
        codec.encode(codec.CODEC_INT4, raw.view(np.uint8), kv_dtype="float16", lossy="int4")
    with pytest.raises(ValueError, match="groups of 64"):
        codec.encode(codec.CODEC_FP8, np.zeros(96, np.float16).view(np.uint8), kv_dtype="float16", lossy="fp8")
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        codec.encode(codec.CODEC_FP8, np.zeros(128, np.uint8), kv_dtype="float8_e4m3fn", lossy="fp8")
    for bad in ("fp4", "int4:7", "int4:x"):
        with pytest.raises(ValueError):
            codec.parse_lossy(bad)
    good = codec.encode(codec.CODEC_INT4, np.ones(64, np.float16).view(np.uint8), kv_dtype="float16", lossy="int4")
    out = np.empty(128, np.uint8)
    for damaged in (good[:-1], b"XXXX" + good[4:], good + b"\0"):
        with pytest.raises(ValueError):
            codec.decode(codec.CODEC_INT4, damaged, out)
    with pytest.raises(ValueError):
        codec.decode(codec.CODEC_FP8, good, out)            # another codec's payload


def test_a_lossy_namespace_is_another_namespace():
    exact = make_ns()
    lossy = make_ns(tier_codec="int4")
    assert lossy.id != exact.id and make_ns(tier_codec="fp8").id not in (lossy.id, exact.id)
    assert exact.to_dict().get("tier_codec") is None and lossy.to_dict()["tier_codec"] == "int4"
    assert type(lossy).from_dict(lossy.to_dict()) == lossy
    with pytest.raises(NamespaceError, match="use fp8, int4"):
        make_ns(tier_codec="zstd")
    with pytest.raises(NamespaceError, match="needs a float16"):
        make_ns(kv_dtype="fp8", tier_codec="int4")


def test_a_lossy_namespace_is_compressed_on_disk_and_exact_ones_stay_bit_exact(tmp_path):
    """Both namespaces demote to disk; the lossy one comes back close (and smaller on disk), the
    exact one bit-exact; host RAM always holds what was put."""
    ns_exact, ns_lossy = make_ns(), make_ns(tier_codec="int4")
    rng = np.random.default_rng(3)
    with TieredStore(host_bytes="4MiB", host_slab_bytes="1MiB", disk_path=str(tmp_path / "d"),
                     disk_bytes="16MiB", disk_slab_bytes="1MiB", disk_file_bytes="4MiB") as s:
        blocks = {}
        for ns in (ns_exact, ns_lossy):
            keys = chain(ns, 7, 4)
            data = [(rng.standard_normal(ns.block_bytes // 2) * 2).astype(np.float16).view(np.uint8)
                    for _ in keys]
            s.put(ns, keys, data)
            blocks[ns.id] = (keys, data)
        assert all(np.array_equal(a, b) for a, b in zip(s.get(ns_lossy, blocks[ns_lossy.id][0]),
                                                        blocks[ns_lossy.id][1]))   # from host RAM
        s.sync()
        s.flush("host")
        for ns in (ns_exact, ns_lossy):
            keys, data = blocks[ns.id]
            assert s.where(ns, keys) == ["disk"] * 4
            got = s.get(ns, keys)
            assert len(got) == 4
            for g, d in zip(got, data):
                if ns is ns_exact:
                    assert np.array_equal(g, d)
                else:
                    gf, df = g.view(np.float16).astype(np.float32), d.view(np.float16).astype(np.float32)
                    step = np.ptp(df.reshape(-1, 32), axis=1).max() / 15
                    assert 0 < np.abs(gf - df).max() <= step / 2 + 0.01
        on_disk = {}   # the disk copies' payload sizes (the store's index of its slots)
        for b in s._blocks.values():
            if b.disk is not None:
                on_disk.setdefault(b.st.ns_id, []).append(b.disk.payload_len)
        assert max(on_disk[ns_lossy.id]) < 0.4 * ns_lossy.block_bytes
        assert min(on_disk[ns_exact.id]) > 0.8 * ns_exact.block_bytes


@pytest.mark.parametrize("spec,kv_dtype", [("int4", "float32"), ("int4", "float16"), ("fp8", "bfloat16")])
def test_a_block_promoted_from_a_lossy_copy_is_never_quantised_twice(tmp_path, spec, kv_dtype):
    """S11: a block read back from its lossy disk copy and written down again (its disk copy
    evicted or flushed meanwhile) keeps exactly the bytes the first decode gave; on b90e890 it
    was quantised a second time (which drifts for float32 KV: re-quantising is idempotent for
    16-bit KV only)."""
    import ml_dtypes
    ns = make_ns(tier_codec=spec, kv_dtype=kv_dtype)
    keys = chain(ns, 11, 4)
    rng = np.random.default_rng(5)
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[kv_dtype]
    data = [(rng.standard_normal(ns.block_bytes // dt(0).nbytes) * 3e3).astype(dt).view(np.uint8)
            for _ in keys]
    with TieredStore(host_bytes="4MiB", host_slab_bytes="1MiB", disk_path=str(tmp_path / "d"),
                     disk_bytes="16MiB", disk_slab_bytes="1MiB", disk_file_bytes="4MiB") as s:
        s.put(ns, keys, data)
        s.sync()
        s.flush("host")
        first = s.get(ns, keys)             # promoted: decoded from the lossy copy
        assert s.where(ns, keys) == ["host+disk"] * 4
        s.flush("disk")                     # only the promoted host copies are left
        s.sync()                            # ... and are written down again
        s.flush("host")
        again = s.get(ns, keys)
        assert len(again) == 4
        for a, b in zip(first, again):
            assert np.array_equal(a, b), "the block was quantised a second time"
