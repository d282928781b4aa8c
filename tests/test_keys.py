"""Block keys: deterministic, chained, pinned by golden values."""

import hashlib
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from tierd.errors import KeyFormatError
from tierd.keys import block_keys, next_key, root_key

from .helpers import make_ns

ROOT = root_key(b"tierd-golden")


def test_golden_values_pin_the_key_format():
    assert ROOT.hex() == "c75b370f2835d671fde472c685c3f23d"
    keys = block_keys(ROOT, list(range(8)), 4)
    assert [k.hex() for k in keys] == ["8fcfeb10a89c49f234e7cf9f0b0bfc7b",
                                       "409022ea1dfe0cdd19b2f556c1a2f5c1"]
    assert block_keys(ROOT, list(range(8)), 4, extra=b"lora:7")[0].hex() == \
        "6e7b8660d033a4bf067d8b167c7ec5d5"
    ns = make_ns()
    # namespace identity v2 (length-prefixed fields; v1's ids were 169ec65b...)
    assert ns.id.hex() == "223aa4dd21a0792e426098deed64e97c"
    assert ns.block_keys(list(range(16)))[0].hex() == "4a76c7f84e03b86d346787f708866791"
    fields = ["tierd-ns-v2", ns.model, "float16", 2, 2, 64, 16, 0, 1, "", "", "", ""]
    ident = b"".join(len(v).to_bytes(4, "little") + v for v in (str(f).encode() for f in fields))
    assert ns.id == hashlib.blake2b(ident, digest_size=16).digest()   # the documented formula


def test_key_is_blake2b_of_parent_tokens_le32_and_extra():
    """The documented formula, recomputed independently of the implementation."""
    h = lambda b: hashlib.blake2b(b, digest_size=16).digest()  # noqa: E731
    assert ROOT == h(b"tierd/key-root/v1\x00" + b"tierd-golden")
    k0 = h(ROOT + struct.pack("<4i", 0, 1, 2, 3))
    k1 = h(k0 + struct.pack("<4i", 4, 5, 6, 7) + b"x")
    assert block_keys(ROOT, range(8), 4, extra=[None, b"x"]) == [k0, k1]


def test_same_keys_in_another_process_with_another_hash_seed():
    ns = make_ns()
    toks = list(range(100, 100 + 64))
    code = ("from tests.helpers import make_ns; import sys;"
            f"sys.stdout.write(''.join(k.hex() for k in make_ns().block_keys({toks!r})))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    assert out == "".join(k.hex() for k in ns.block_keys(toks))


def test_only_full_blocks_get_keys():
    assert len(block_keys(ROOT, range(15), 4)) == 3
    assert block_keys(ROOT, range(3), 4) == []


def test_prefix_property_shared_prefix_shares_keys():
    a = list(range(40))
    b = a[:24] + [999] * 16
    ka, kb = block_keys(ROOT, a, 8), block_keys(ROOT, b, 8)
    assert ka[:3] == kb[:3]
    assert ka[3] != kb[3] and ka[4] != kb[4]  # a change poisons every later block


def test_changing_any_token_changes_that_block_and_all_later_ones():
    base = list(range(32))
    kb = block_keys(ROOT, base, 8)
    for pos in (0, 9, 31):
        t = list(base)
        t[pos] += 1
        k = block_keys(ROOT, t, 8)
        first = pos // 8
        assert k[:first] == kb[:first]
        assert all(x != y for x, y in zip(k[first:], kb[first:]))


def test_namespace_changes_keys():
    toks = list(range(64))
    ref = make_ns().block_keys(toks)
    for other in (make_ns(model="other"), make_ns(kv_dtype="bfloat16"), make_ns(cache_salt="tenant-b"),
                  make_ns(tp_size=2, tp_rank=1), make_ns(num_layers=3)):
        assert set(other.block_keys(toks)).isdisjoint(ref)


def test_chain_continues_from_parent():
    toks = list(range(48))
    full = block_keys(ROOT, toks, 16)
    tail = block_keys(ROOT, toks[16:], 16, parent=full[0])
    assert tail == full[1:]
    assert next_key(full[1], toks[32:48]) == full[2]


def test_numpy_and_list_inputs_agree():
    toks = np.arange(32, dtype=np.int64)
    assert block_keys(ROOT, toks, 8) == block_keys(ROOT, toks.tolist(), 8)


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**31, 0, 0, 0], [[1, 2], [3, 4]], [0.5, 1.0, 2.0, 3.0]])
def test_bad_token_ids_are_refused(bad):
    with pytest.raises(KeyFormatError):
        block_keys(ROOT, bad, 2)


def test_bad_root_parent_or_block_size_are_refused():
    with pytest.raises(KeyFormatError):
        block_keys(b"short", range(8), 4)
    with pytest.raises(KeyFormatError):
        block_keys(ROOT, range(8), 0)
    with pytest.raises(KeyFormatError):
        block_keys(ROOT, range(8), 4, parent=b"x" * 15)
    with pytest.raises(KeyFormatError):
        block_keys(ROOT, range(8), 4, extra=[b"only-one"])


def test_extend_keys_continues_a_chain_incrementally():
    from tierd.keys import extend_keys
    toks = list(range(100))
    keys = extend_keys([], ROOT, toks, 8, 3)
    assert keys == block_keys(ROOT, toks, 8)[:3]
    assert extend_keys(keys, ROOT, toks, 8, 12) is keys and keys == block_keys(ROOT, toks, 8)
    assert extend_keys(keys, ROOT, toks, 8, 5) == block_keys(ROOT, toks, 8)  # never shrinks
