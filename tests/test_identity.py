"""One engine identity for every integration (connectors/identity.py): every setting that
changes the KV an engine computes changes its namespace, and no other setting does; what cannot
be keyed is declined, never raised into the engine. The same table runs against vLLM's own
config objects in tests/vllm_identity_check.py (see test_the_vllm_integrations_with_vllms_configs)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from tierd.connectors import identity
from tierd.connectors.identity import Declined, EngineSettings

from . import vllm_wait
from .test_vllm_connector import ROOT, required_vllm_python

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
          "max_position_embeddings": 2048}


def write_model(d: Path, seed: int = 0, **config) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**CONFIG, **config}))
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal((64, 64)).astype(np.float32)}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity-models")
    base = write_model(root / "base")
    return SimpleNamespace(
        base=base,
        copy=Path(shutil.copytree(base, root / "copy")),                 # the same bytes elsewhere
        other=write_model(root / "other", seed=1),                       # other weights, same config
        draft=write_model(root / "draft", seed=2, num_hidden_layers=1),
        draft2=write_model(root / "draft2", seed=3, num_hidden_layers=1),
        other_config=write_model(root / "other-config", rope_theta=500000.0),
        quantized=write_model(root / "gptq", quantization_config={"quant_method": "gptq", "bits": 4}),
        scales=root / "scales.json")


def base(models, **kw) -> EngineSettings:
    return EngineSettings(model=str(models.base), **kw)


# every setting that changes the KV of the same tokens: each must give another identity
CHANGES_KV = {
    "other weights": lambda m: EngineSettings(model=str(m.other)),
    "an explicit revision": lambda m: base(m, revision="org/model@0123abcd"),
    "load-time quantization (fp8 on a bf16 checkpoint)": lambda m: base(m, quantization="fp8"),
    "load-time quantization settings": lambda m: base(m, quantization_config={"linear": "fp8_per_tensor"}),
    "rope scaling override": lambda m: base(m, overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "rope theta override": lambda m: base(m, overrides={"rope_theta": 20000.0}),
    "a config read from elsewhere": lambda m: base(m, config_path=str(m.other_config)),
    "kv cache dtype fp8": lambda m: base(m, kv_cache_dtype="fp8"),
    "kv cache dtype fp8_e5m2": lambda m: base(m, kv_cache_dtype="fp8_e5m2"),
    "kv cache dtype float16": lambda m: base(m, kv_cache_dtype="float16"),
    "compute dtype float32 under an fp8 cache": lambda m: base(m, dtype="float32", kv_cache_dtype="fp8"),
    "compute dtype float16 (its KV dtype too)": lambda m: base(m, dtype="float16"),
    "compute dtype float32 under a float16 cache": lambda m: base(m, dtype="float32", kv_cache_dtype="float16"),
    "random (dummy) weights": lambda m: base(m, load_format="dummy"),
    "a draft model in the pool": lambda m: base(m, draft=EngineSettings(model=str(m.draft))),
    "fp8 scales from a file": lambda m: base(m, kv_cache_dtype="fp8", kv_scales_file=str(m.scales)),
}

# settings that leave the KV as it is: each must give the base identity
KEEPS_KV = {
    "the same weights copied elsewhere": lambda m: EngineSettings(model=str(m.copy)),
    "the checkpoint's own dtype named": lambda m: base(m, dtype="bfloat16"),
    "the compute dtype's KV dtype named": lambda m: base(m, kv_cache_dtype="bf16"),
    "empty overrides": lambda m: base(m, overrides={}),
    "an override equal to the checkpoint's value": lambda m: base(m, overrides={"rope_theta": 10000.0}),
    "no quantization settings": lambda m: base(m, quantization="", quantization_config={}),
    "another load format of the same weights": lambda m: base(m, load_format="safetensors"),
    "the config path that is the model's own": lambda m: base(m, config_path=str(m.base)),
}


def test_every_setting_that_changes_kv_changes_the_namespace_and_no_other_does(models):
    models.scales.write_text('{"k_scale": 0.5}')
    ref = identity.identify(base(models))
    assert ref.model == identity.weights_identity(base(models))   # nothing set at load: the plain fingerprint
    seen = {"base": ref}
    for what, make in CHANGES_KV.items():
        ident = identity.identify(make(models))
        clash = [w for w, other in seen.items() if other == ident]
        assert not clash, f"{what!r} keys like {clash}"
        assert ident.namespace(num_layers=2, num_kv_heads=2, head_dim=16).id != \
            ref.namespace(num_layers=2, num_kv_heads=2, head_dim=16).id, what
        seen[what] = ident
    for what, make in KEEPS_KV.items():
        assert identity.identify(make(models)) == ref, what


def test_the_checkpoints_own_quantization_named_explicitly_changes_nothing(models):
    plain = identity.identify(EngineSettings(model=str(models.quantized)))
    for method in ("gptq", "gptq_marlin"):       # vLLM's kernel variant of the checkpoint's method
        assert identity.identify(EngineSettings(model=str(models.quantized), quantization=method)) == plain
    assert identity.identify(EngineSettings(model=str(models.quantized), quantization="awq")) != plain


def test_another_draft_model_or_none_keys_apart(models):
    a = identity.identify(base(models, draft=EngineSettings(model=str(models.draft))))
    b = identity.identify(base(models, draft=EngineSettings(model=str(models.draft2))))
    assert a != b and identity.identify(base(models)) not in (a, b)


def test_a_cache_with_fp8_scales_in_the_checkpoint_says_so(tmp_path):
    d = write_model(tmp_path / "m")
    save_file({"model.layers.0.self_attn.k_scale": np.ones(1, np.float32)}, str(d / "scales.safetensors"))
    assert identity.identify(EngineSettings(model=str(d), kv_cache_dtype="fp8")).kv_scales == "checkpoint"
    assert identity.identify(EngineSettings(model=str(d))).kv_scales == ""


@pytest.mark.parametrize("cache_dtype", ["fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4",
                                         "turboquant_4bit_nc", "int8_per_token_head", "nvfp4", "mxfp8",
                                         "fp4_mx_block16", "no-such-dtype"])
def test_kv_cache_dtypes_tierd_does_not_know_are_declined(models, cache_dtype):
    with pytest.raises(Declined, match="KV cache dtype"):
        identity.identify(base(models, kv_cache_dtype=cache_dtype))


def test_a_cache_tensor_of_another_dtype_than_the_settings_name_is_declined(models):
    assert identity.identify(base(models, kv_cache_dtype="auto"), kv_dtype="torch.float32").kv_dtype == "float32"
    with pytest.raises(Declined, match="holds float16 where the engine's settings say float8_e4m3fn"):
        identity.identify(base(models, kv_cache_dtype="fp8_e4m3"), kv_dtype="torch.float16")
    with pytest.raises(Declined, match="does not key"):
        identity.identify(base(models), kv_dtype="torch.uint8")        # a packed fp4 pool


@pytest.mark.parametrize("settings,reason", [
    (lambda m: EngineSettings(model="org/hub-model"), "not a local directory"),
    (lambda m: EngineSettings(model="org/hub-model", revision="abc", kv_cache_dtype="fp8"), "KV scales"),
    (lambda m: base(m, overrides=lambda cfg: cfg), "overridden by a function"),
    (lambda m: base(m, overrides={"rope_scaling": object()}), "cannot be keyed"),
    (lambda m: base(m, config_path="org/other-config"), "not a local directory"),
    (lambda m: base(m, draft=EngineSettings(model="org/hub-draft")), "not a local directory"),
    (lambda m: base(m, dtype="float64"), "dtype tierd does not know"),
])
def test_what_cannot_be_keyed_is_declined(models, settings, reason):
    with pytest.raises(Declined, match=reason):
        identity.identify(settings(models))


def test_a_rank_the_engine_cannot_tell_is_declined_never_guessed():
    def broken():
        raise AssertionError("tensor model parallel group is not initialized")
    with pytest.raises(Declined, match="tensor-parallel rank .of 2. is unknown"):
        identity.engine_rank("tensor-parallel rank", broken, 2)
    with pytest.raises(Declined, match="outside"):
        identity.engine_rank("pipeline stage", lambda: 3, 2)
    with pytest.raises(Declined):
        identity.engine_rank("pipeline stage", lambda: None, 2)
    assert identity.engine_rank("tensor-parallel rank", broken, 1) == 0    # one rank: nothing to ask
    assert identity.engine_rank("tensor-parallel rank", lambda: 1, 2) == 1


def test_an_adapter_whose_files_vanish_while_hashed_is_declined_not_raised(tmp_path):
    """An adapter directory being replaced: its weight file is a link to a file already gone
    (review C4: on 792e2b3 the OSError escaped from the scheduler into vLLM's EngineCore)."""
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"r": 8}')
    os.symlink(tmp_path / "gone.safetensors", d / "adapter_model.safetensors")
    lora = SimpleNamespace(lora_name="a", lora_path=str(d), lora_int_id=7)
    with pytest.raises(Declined, match="content cannot be read"):
        identity.adapter_identity(lora)
    with pytest.raises(Declined, match="not a local directory"):
        identity.adapter_identity(SimpleNamespace(lora_name="b", lora_path="org/hub-adapter", lora_int_id=8))


def test_sglang_settings_are_read_as_vllms_are(models):
    """The same choices through SGLang's server arguments: quantization, JSON overrides, an
    explicit dtype, the draft model the pool holds; a LoRA engine is declined."""
    def args(**kw):
        return SimpleNamespace(**{"model_path": str(models.base), "dtype": "auto", "kv_cache_dtype": "auto",
                                  "quantization": None, "json_model_override_args": "{}", "load_format": "auto",
                                  "enable_lora": None, "lora_paths": None, "modelopt_quant": None,
                                  "quantization_param_path": None, "speculative_algorithm": None,
                                  "speculative_draft_model_path": None, **kw})

    def ident(sa, **kw):
        return identity.identify(identity.from_sglang(sa, "served-name", **kw), kv_dtype="torch.bfloat16")
    ref = ident(args())
    assert ref == identity.identify(EngineSettings(model=str(models.base)), kv_dtype="torch.bfloat16")
    # without server arguments (no SGLang): the storage config's model name alone
    assert identity.identify(identity.from_sglang(None, str(models.base)), kv_dtype="torch.bfloat16") == ref
    for change in ({"quantization": "fp8"}, {"json_model_override_args": '{"rope_theta": 20000.0}'},
                   {"modelopt_quant": "fp8"}, {"load_format": "dummy"}, {"dtype": "float32"}):
        assert ident(args(**change)) != ref, change
    assert ident(args(json_model_override_args='{"rope_theta": 10000.0}')) == ref
    with_draft = ident(args(speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.draft)),
                       draft_layers=1)
    assert with_draft != ref
    assert ident(args(speculative_algorithm="EAGLE", speculative_draft_model_path=str(models.draft))) == ref
    for bad, reason in (({"enable_lora": True}, "LoRA"), ({"lora_paths": ["a=/x"]}, "LoRA"),
                        ({"json_model_override_args": "{nope"}, "not JSON"), ({"kv_cache_dtype": "mxfp8"}, "dtype")):
        with pytest.raises(Declined, match=reason):
            ident(args(**bad))
    with pytest.raises(Declined, match="no draft model is named"):
        ident(args(speculative_algorithm="EAGLE"), draft_layers=1)
    with pytest.raises(Declined, match="draft-model layers"):
        ident(None, draft_layers=1)


@pytest.mark.slow
@pytest.mark.timeout(vllm_wait.SCRIPT_S + 120)
def test_the_vllm_integrations_with_vllms_configs(tmp_path):
    """With vLLM's own ModelConfig, CacheConfig and VllmConfig: the table above, the connector and
    the secondary tier declining unknown KV cache dtypes with one line each, and a worker whose
    tensor-parallel rank vLLM cannot tell declining (tests/vllm_identity_check.py)."""
    py = required_vllm_python("cpu-build")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", TMPDIR=str(tmp_path))
    r = vllm_wait.run_script([py, "-m", "tests.vllm_identity_check"], "tests/vllm_identity_check.py in the vLLM "
                             "environment", cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "vLLM identity check: OK" in r.stdout
