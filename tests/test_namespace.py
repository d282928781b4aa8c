"""Namespaces: layout identity, block size, and model fingerprints from real directories."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from tierd import Namespace
from tierd.errors import NamespaceError
from tierd.namespace import model_fingerprint

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
