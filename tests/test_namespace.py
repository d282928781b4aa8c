"""Namespaces: layout identity, block size, and model fingerprints from real directories."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from tierd import Namespace
from tierd.errors import NamespaceError
import hashlib
import os

from tierd.namespace import content_digests, model_fingerprint

from .helpers import make_ns

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "torch_dtype": "bfloat16",
          "transformers_version": "4.46.0", "_name_or_path": "/somewhere"}


def write_model(d, *, seed=0, config=CONFIG, n_files=2, scale=1.0):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    for i in range(n_files):
        tensors = {f"layer{i}.w": (rng.standard_normal((512, 1024)) * scale).astype(np.float32)}
        save_file(tensors, str(d / f"model-{i:05d}-of-{n_files:05d}.safetensors"))
    return d


def test_block_bytes_follows_the_layout():
    ns = make_ns(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=256, kv_dtype="bf16")
    assert ns.block_shape == (32, 2, 256, 8, 128)
    assert ns.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert ns.block_bytes == ns.bytes_per_token * 256
    assert make_ns(kv_dtype="fp8").dtype_bytes == 1


def test_namespace_round_trips_through_dict_and_keeps_its_id():
    ns = make_ns(cache_salt="tenant-a", tp_rank=1, tp_size=4)
    again = Namespace.from_dict(ns.to_dict())
    assert again == ns and again.id == ns.id and again.name == ns.name


@pytest.mark.parametrize("kw", [dict(num_layers=0), dict(head_dim=-1), dict(kv_dtype="int4"),
                                dict(tp_rank=2, tp_size=2), dict(block_tokens=1.5), dict(model=""),
                                dict(num_layers=10**6, num_kv_heads=10**4, head_dim=10**4)])
def test_invalid_namespaces_are_refused(kw):
    with pytest.raises(NamespaceError):
        make_ns(**kw)


def test_from_model_dir_reads_the_layout(tmp_path):
    d = write_model(tmp_path / "m")
    ns = Namespace.from_model_dir(d, block_tokens=64)
    assert (ns.num_layers, ns.num_kv_heads, ns.head_dim, ns.kv_dtype) == (4, 2, 32, "bfloat16")
    tp = Namespace.from_model_dir(d, tp_size=2, tp_rank=1)
    assert tp.num_kv_heads == 1 and tp.id != ns.id


def test_transformers_5_config_layout_with_dtype_and_head_dim(tmp_path):
    cfg = {k: v for k, v in CONFIG.items() if k != "torch_dtype"} | {"dtype": "float16", "head_dim": 48}
    ns = Namespace.from_model_dir(write_model(tmp_path / "m", config=cfg))
    assert ns.kv_dtype == "float16" and ns.head_dim == 48


def test_fingerprint_is_stable_and_ignores_volatile_config_keys(tmp_path):
    a = write_model(tmp_path / "a")
    b = write_model(tmp_path / "b", config={**CONFIG, "transformers_version": "5.0.0", "_name_or_path": "x"})
    assert model_fingerprint(a) == model_fingerprint(a) == model_fingerprint(b)


def test_fine_tune_with_identical_shapes_changes_the_fingerprint(tmp_path):
    base = write_model(tmp_path / "base", seed=0)
    tuned = write_model(tmp_path / "tuned", seed=0, scale=1.001)
    assert model_fingerprint(base) != model_fingerprint(tuned)
    assert Namespace.from_model_dir(base).id != Namespace.from_model_dir(tuned).id


def _flip_one_byte_in_the_middle(path):
    """A change that sampling misses: one byte between two sampled regions."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        off = size // 2 + 12345
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


def test_every_weight_byte_is_in_the_fingerprint_and_sampling_is_an_opt_in(tmp_path):
    base = write_model(tmp_path / "base", n_files=1)
    tuned = write_model(tmp_path / "tuned", n_files=1)
    _flip_one_byte_in_the_middle(next(tuned.glob("*.safetensors")))
    assert model_fingerprint(base) != model_fingerprint(tuned)
    assert Namespace.from_model_dir(base).id != Namespace.from_model_dir(tuned).id
    # sampling (opt-in) cannot see it: that is why it is not the default
    assert model_fingerprint(base, mode="sampled") == model_fingerprint(tuned, mode="sampled")
    assert model_fingerprint(base, mode="sampled") != model_fingerprint(base)
    with pytest.raises(NamespaceError, match="fingerprint mode"):
        model_fingerprint(base, mode="quick")


def test_digests_are_remembered_by_file_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERD_DIGEST_CACHE", str(tmp_path / "cache" / "digests.json"))
    d = write_model(tmp_path / "m", n_files=1)
    (w,) = d.glob("*.safetensors")
    real = hashlib.sha256(w.read_bytes()).hexdigest()
    assert content_digests([w]) == {w: real}
    cached = json.loads((tmp_path / "cache" / "digests.json").read_text())
    st = w.stat()
    assert cached == {f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}": real}
    # a remembered digest is used as it is (the file is not read again) ...
    from tierd import namespace as nsmod
    nsmod._memo.clear()
    fake = "ab" * 32
    (tmp_path / "cache" / "digests.json").write_text(json.dumps({next(iter(cached)): fake}))
    assert content_digests([w]) == {w: fake}
    # ... until the file changes: another mtime is another identity, hashed again
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert content_digests([w]) == {w: real}


def test_a_hugging_face_snapshot_is_fingerprinted_by_its_blob_names(tmp_path):
    """A snapshot's weight files link to blobs named by their SHA-256: the same fingerprint as a
    plain copy of the same files, without reading them."""
    plain = write_model(tmp_path / "plain", n_files=2)
    repo = tmp_path / "hub" / "models--org--m"
    snap = repo / "snapshots" / ("c0ffee" * 6 + "abcd")
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(plain.iterdir()):
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        else:
            (snap / f.name).write_bytes(data)
    assert model_fingerprint(snap) == model_fingerprint(plain)
    # the name is trusted (that is the point: no reading): a blob under another name is another model
    w = sorted(snap.glob("*.safetensors"))[0]
    blob = w.resolve()
    other = blob.with_name("0" * 64)
    blob.rename(other)
    w.unlink()
    w.symlink_to(os.path.relpath(other, snap))
    assert model_fingerprint(snap) != model_fingerprint(plain)


def test_layout_and_kv_scales_are_identity_but_leave_canonical_ids_alone():
    ns = make_ns()
    assert "layout" not in ns.to_dict() and "kv_scales" not in ns.to_dict()
    cpu = make_ns(layout="vllm-cpu-vec")
    scaled = make_ns(kv_dtype="fp8", kv_scales="ckpt:1234")
    assert len({ns.id, cpu.id, scaled.id, make_ns(kv_dtype="fp8").id}) == 4
    assert Namespace.from_dict(cpu.to_dict()).id == cpu.id
    assert Namespace.from_dict(scaled.to_dict()) == scaled


def test_config_change_changes_the_fingerprint(tmp_path):
    a = write_model(tmp_path / "a")
    b = write_model(tmp_path / "b", config={**CONFIG, "rope_theta": 1e6})
    assert model_fingerprint(a) != model_fingerprint(b)


def test_explicit_revision_replaces_weight_sampling(tmp_path):
    a = write_model(tmp_path / "a", seed=0)
    b = write_model(tmp_path / "b", seed=1)
    assert model_fingerprint(a, revision="v1") == model_fingerprint(b, revision="v1")
    assert model_fingerprint(a, revision="v1") != model_fingerprint(a, revision="v2")


def test_model_dir_errors_are_clear(tmp_path):
    with pytest.raises(NamespaceError, match="does not exist"):
        model_fingerprint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NamespaceError, match="config.json"):
        Namespace.from_model_dir(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(NamespaceError, match="no weight files"):
        model_fingerprint(tmp_path / "noweights")
    assert model_fingerprint(tmp_path / "noweights", revision="r1")
    (tmp_path / "noweights" / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(NamespaceError, match="not a safetensors"):
        model_fingerprint(tmp_path / "noweights")


def test_no_cache_salt_can_alias_another_namespace():
    """S10: v1 joined the identity's fields with \\x1f, so a crafted salt could spell another
    namespace's optional fields and share its blocks."""
    base = dict(model="m", kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64)
    target = Namespace(**base, cache_salt="tenant", layout="vllm-nhd")
    forged = Namespace(**base, cache_salt="tenant\x1flayout=vllm-nhd")
    assert forged.id != target.id
    assert Namespace(**base, cache_salt="a\x1fb").id != Namespace(**base, cache_salt="a", layout="b").id
    assert Namespace(**base, cache_salt="").id != Namespace(**base, cache_salt="\x00").id


def test_the_fields_of_hybrid_latent_and_staged_models_are_identity_and_leave_other_ids_alone():
    """`attention` (KV cache groups), `planes` (MLA's latent rows) and `layers` (a pipeline
    stage's): each makes another namespace, none can be spelled by another, each survives the
    wire (to_dict / from_dict), and a namespace without them keeps the id it had before they
    existed (the v2 identity over the other fields alone)."""
    base = dict(model="m", kv_dtype="float16", num_layers=4, num_kv_heads=1, head_dim=576)
    plain = Namespace(**base)
    v2 = b"".join(len(v).to_bytes(4, "little") + v for v in (str(x).encode() for x in (
        "tierd-ns-v2", "m", "float16", 4, 1, 576, 256, 0, 1, "", "", "", "")))
    assert plain.id == hashlib.blake2b(v2, digest_size=16).digest()      # ids of before are kept
    variants = [plain, Namespace(**base, attention="vllm-groups-v1/full:0,1;sliding128:2,3"),
                Namespace(**base, planes=1), Namespace(**base, attention="planes=1"),
                Namespace(**dict(base, num_layers=2), layers="0-2/4"), Namespace(**dict(base, num_layers=2), layers="2-4/4"),
                Namespace(**dict(base, num_layers=2)), Namespace(**base, planes=1, attention="x")]
    assert len({ns.id for ns in variants}) == len(variants)
    for ns in variants:
        assert Namespace.from_dict(ns.to_dict()) == ns and Namespace.from_dict(ns.to_dict()).id == ns.id
    latent = Namespace(**base, planes=1)
    assert latent.block_shape == (4, 1, 256, 1, 576) and latent.block_bytes == 4 * 256 * 576 * 2
    assert plain.block_bytes == 2 * latent.block_bytes
    for bad in (dict(base, planes=3), dict(base, num_kv_heads=2, planes=1), dict(base, layers="0-2/4"),
                dict(base, num_layers=2, layers="2-1/4"), dict(base, num_layers=2, layers="3-5/4"),
                dict(base, layers="all")):
        with pytest.raises(NamespaceError):
            Namespace(**bad)


def test_a_state_namespace_is_its_own_identity_and_block_size():
    """Recurrent state (Mamba, linear attention): a block is a page of `state_bytes` per state
    layer, whatever `block_tokens`; its layout description and size are identity; it survives
    the wire; it takes no lossy codec; a KV namespace of the same fields is another."""
    base = dict(model="m", kv_dtype="bfloat16", num_layers=3, num_kv_heads=1, head_dim=1, block_tokens=256)
    st = Namespace(**base, state="GDN:bfloat16[3, 512],float32[4, 64, 64];3 layers;conv SD", state_bytes=68608)
    assert st.block_bytes == 3 * 68608
    variants = [st, Namespace(**base), Namespace(**base, state=st.state, state_bytes=68600),
                Namespace(**base, state=st.state + "x", state_bytes=68608),
                Namespace(**dict(base, block_tokens=128), state=st.state, state_bytes=68608)]
    assert len({ns.id for ns in variants}) == len(variants)
    assert Namespace.from_dict(st.to_dict()) == st and Namespace.from_dict(st.to_dict()).id == st.id
    assert "state" not in Namespace(**base).to_dict()
    for bad in (dict(base, state="x"), dict(base, state_bytes=8), dict(base, state="x", state_bytes=-1),
                dict(base, state="x", state_bytes=8, tier_codec="fp8")):
        with pytest.raises(NamespaceError):
            Namespace(**bad)
