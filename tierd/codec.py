"""Payload codecs of the disk and remote tiers.

Exact: none, and zstd with an optional byte-plane shuffle. Shuffling a 16-bit array into two
byte planes (all low bytes, then all high bytes) puts the sign/exponent bytes of fp16/bf16 values
side by side, which is where KV data compresses.

Lossy, for namespaces that opt in (`Namespace.tier_codec`; the codec then is part of the
namespace's identity, so a lossy block can never answer for an exact namespace):
- fp8: float8 e4m3 with one float32 scale per group of elements (absmax / 448): 0.53x of fp16
  with groups of 64.
  Error per element <= |x| / 16 + scale / 1024 (3 mantissa bits, subnormals below 2^-6).
- int4: 4-bit asymmetric (KIVI-style), a float32 minimum and step per group, two values a
  byte: 0.375x of fp16 with groups of 32. Error per element <= step / 2.
(Each plus the rounding back into the block's dtype.) Groups run along the contiguous last axis
of the block (head_dim: per token and head). A lossy payload describes itself (dtype, group,
count), so decoding needs nothing else; a block with NaN or infinity, or whose size no group
divides, is stored exactly instead.

Codecs are pure functions of their input; they never see files or keys.
"""

from __future__ import annotations

import struct
import threading

import numpy as np

try:  # a declared dependency; imported softly so tools that never touch zstd import without it
    import zstandard
except ImportError:  # pragma: no cover - exercised only where the package is missing
    zstandard = None

CODEC_NONE = 0
CODEC_ZSTD = 1
CODEC_ZSTD_SHUFFLE2 = 2
CODEC_FP8 = 3
CODEC_INT4 = 4
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_SHUFFLE2: "zstd+shuffle2",
               CODEC_FP8: "fp8", CODEC_INT4: "int4"}
LOSSY = frozenset((CODEC_FP8, CODEC_INT4))
LOSSY_DEFAULT_GROUP = {"fp8": 64, "int4": 32}
_LOSSY_DTYPES = {"float16": 1, "bfloat16": 2, "float32": 3}
_LOSSY_HDR = struct.Struct("<4sBBHQ")     # magic, source dtype, codec, group, elements
_LOSSY_MAGIC = b"TLQ1"
FP8_MAX = 448.0

_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _ctx(level: int):
    if zstandard is None:
        raise RuntimeError("the zstd codec needs the 'zstandard' package (pip install zstandard)")
    ctxs = getattr(_local, "ctxs", None)
    if ctxs is None:
        ctxs = _local.ctxs = {}
    if level not in ctxs:
        ctxs[level] = (zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor())
    return ctxs[level]


def shuffle2(data: np.ndarray) -> np.ndarray:
    """(2n,) uint8 -> (2n,) uint8: bytes 0,2,4,... then 1,3,5,..."""
    return np.ascontiguousarray(data.reshape(-1, 2).T).reshape(-1)


def unshuffle2(planes: np.ndarray, out: np.ndarray) -> None:
    """Inverse of shuffle2, written into `out` (2n,) uint8.
    As 16-bit arithmetic (high << 8 | low): ten times faster than a transposed copy."""
    n = planes.size // 2
    out16 = out.view("<u2")
    np.left_shift(planes[n:], 8, out=out16, dtype="<u2")
    np.bitwise_or(out16, planes[:n], out=out16)


def parse_lossy(spec: str) -> tuple[str, int]:
    """A namespace's `tier_codec` ("fp8", "int4", "int4:64"): (kind, group). Raises ValueError."""
    kind, _, group = spec.partition(":")
    if kind not in LOSSY_DEFAULT_GROUP:
        raise ValueError(f"tier codec {spec!r}: use fp8, int4 or KIND:GROUP (e.g. int4:64)")
    try:
        g = int(group) if group else LOSSY_DEFAULT_GROUP[kind]
    except ValueError:
        raise ValueError(f"tier codec {spec!r}: the group must be an integer") from None
    if g not in (16, 32, 64, 128, 256):
        raise ValueError(f"tier codec {spec!r}: group {g} is not one of 16, 32, 64, 128, 256")
    return kind, g


def choose_codec(name: str, dtype_bytes: int, block_bytes: int, lossy: str = "") -> int:
    """The codec for a block: the namespace's lossy one where it asked for it, else the
    tier's exact one (`name`: none or zstd)."""
    if lossy:
        return CODEC_FP8 if parse_lossy(lossy)[0] == "fp8" else CODEC_INT4
    if name == "none":
        return CODEC_NONE
    return CODEC_ZSTD_SHUFFLE2 if dtype_bytes == 2 and block_bytes % 2 == 0 else CODEC_ZSTD


def encode(codec: int, data: np.ndarray, level: int = 1, *, kv_dtype: str = "", lossy: str = "") -> bytes | np.ndarray:
    """Encode (n,) uint8 `data`. CODEC_NONE returns `data` itself (no copy). Lossy codecs need
    the block's `kv_dtype` and the namespace's `lossy` spec, and raise ValueError where the block
    cannot take them (the caller then stores it exactly)."""
    if codec == CODEC_NONE:
        return data
    if codec in LOSSY:
        return encode_lossy(codec, data, kv_dtype, parse_lossy(lossy)[1])
    if codec == CODEC_ZSTD_SHUFFLE2:
        data = shuffle2(data)
    return _ctx(level)[0].compress(data)


def decode(codec: int, payload, out: np.ndarray) -> None:
    """Decode `payload` into `out` (raw_len,) uint8; raises ValueError if it does not fit."""
    if codec == CODEC_NONE:
        out[:] = np.frombuffer(payload, dtype=np.uint8)
        return
    if codec in LOSSY:
        decode_lossy(codec, payload, out)
        return
    raw = _ctx(1)[1].decompress(payload, max_output_size=out.size)
    if len(raw) != out.size:
        raise ValueError(f"decoded {len(raw)} bytes, expected {out.size}")
    arr = np.frombuffer(raw, dtype=np.uint8)
    if codec == CODEC_ZSTD_SHUFFLE2:
        unshuffle2(arr, out)
    else:
        out[:] = arr


# -- lossy codecs -------------------------------------------------------------------------------
def _np_dtype(kv_dtype: str):
    if kv_dtype == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(kv_dtype)


def encode_lossy(codec: int, data: np.ndarray, kv_dtype: str, group: int) -> bytes:
    if kv_dtype not in _LOSSY_DTYPES:
        raise ValueError(f"lossy tier codecs take float16, bfloat16 or float32 blocks, not {kv_dtype}")
    src = np.frombuffer(data, dtype=_np_dtype(kv_dtype))
    if src.size % group:
        raise ValueError(f"{src.size} elements do not split into groups of {group}")
    x = src.astype(np.float32).reshape(-1, group)
    if not np.isfinite(x).all():
        raise ValueError("the block holds NaN or infinity")
    hdr = _LOSSY_HDR.pack(_LOSSY_MAGIC, _LOSSY_DTYPES[kv_dtype], codec, group, src.size)
    if codec == CODEC_FP8:
        import ml_dtypes
        amax = np.abs(x).max(axis=1)
        scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
        q = np.clip(x / scale[:, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return b"".join((hdr, scale.tobytes(), q.view(np.uint8).tobytes()))
    lo = x.min(axis=1)
    step = (x.max(axis=1) - lo) / 15.0
    step = np.where(step > 0, step, 1.0).astype(np.float32)
    q = np.clip(np.rint((x - lo[:, None]) / step[:, None]), 0, 15).astype(np.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return b"".join((hdr, lo.astype(np.float32).tobytes(), step.tobytes(), packed.tobytes()))


def decode_lossy(codec: int, payload, out: np.ndarray) -> None:
    buf = memoryview(payload).cast("B")
    if len(buf) < _LOSSY_HDR.size:
        raise ValueError("lossy payload too short")
    magic, dt, c, group, n = _LOSSY_HDR.unpack_from(buf)
    names = {v: k for k, v in _LOSSY_DTYPES.items()}
    if magic != _LOSSY_MAGIC or c != codec or dt not in names or not group or n % group:
        raise ValueError("lossy payload header is damaged")
    dtype = _np_dtype(names[dt])
    if n * dtype.itemsize != out.size:
        raise ValueError(f"lossy payload holds {n * dtype.itemsize} bytes, expected {out.size}")
    g = n // group
    body = np.frombuffer(buf, dtype=np.uint8, offset=_LOSSY_HDR.size)
    if codec == CODEC_FP8:
        import ml_dtypes
        if body.size != 4 * g + n:
            raise ValueError("lossy payload truncated")
        scale = body[:4 * g].view(np.float32)
        q = body[4 * g:].view(ml_dtypes.float8_e4m3fn).reshape(g, group)
        x = q.astype(np.float32) * scale[:, None]
    else:
        if body.size != 8 * g + n // 2:
            raise ValueError("lossy payload truncated")
        lo = body[:4 * g].view(np.float32)
        step = body[4 * g:8 * g].view(np.float32)
        packed = body[8 * g:].reshape(g, group // 2)
        q = np.empty((g, group), dtype=np.float32)
        q[:, 0::2] = packed & 0x0F
        q[:, 1::2] = packed >> 4
        x = q * step[:, None] + lo[:, None]
    out.view(dtype)[:] = x.reshape(-1).astype(dtype)
