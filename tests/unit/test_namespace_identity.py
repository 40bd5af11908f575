"""Two vLLM engines whose KV differs for the same tokens never get one namespace: settings the
namespace named by a name only (a callable ``hf_overrides``, an ``hf_config_path``), settings it
did not name (``model_class_overrides``, a KV cache dtype other than the activations', a
speculative decoder's own checkpoint), and the ones that must keep sharing.

Engines are the stand-ins of ``tests.integrations.vllm_engine``; the checkpoints are real files
under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

from tests.integrations.test_identity import local_model, rewrite_same_size, vllm_ns_with
from tests.integrations.vllm_engine import BS, FullAttentionSpec, kv_cache_config, vllm_config
from tiered_kv.integrations.common import parse_settings
from tiered_kv.integrations.vllm import vllm_namespace

ROPE_THETA = 1e6  # read by ``global_theta`` below


def theta_override(theta: float):
    def overrides(config):
        config.rope_theta = theta
        return config
    return overrides


def global_theta(config):
    config.rope_theta = ROPE_THETA
    return config


def kinds(config):  # a set literal compiles to a frozenset constant (its repr follows the hash seed)
    return config if config.model_type in {"llama", "mistral", "qwen2"} else config


def test_regression_two_closures_overriding_rope_theta_shared_one_namespace(tmp_path):
    # hf_overrides=theta_override(1e4) and theta_override(1e6): one qualified name, other K
    model = local_model(tmp_path)
    low, high = (vllm_ns_with(model, hf_overrides=theta_override(t)) for t in (1e4, 1e6))
    assert low.digest() != high.digest()
    assert vllm_ns_with(model, hf_overrides=theta_override(1e4)) == low  # the same setting: shared


def test_regression_two_lambdas_as_hf_overrides_shared_one_namespace(tmp_path):
    model = local_model(tmp_path)
    a = vllm_ns_with(model, hf_overrides=lambda c: setattr(c, "rope_theta", 1e4) or c)
    b = vllm_ns_with(model, hf_overrides=lambda c: setattr(c, "rope_theta", 1e6) or c)
    assert a.digest() != b.digest()


def test_a_callable_override_names_the_module_constants_it_reads(tmp_path, monkeypatch):
    model = local_model(tmp_path)
    before = vllm_ns_with(model, hf_overrides=global_theta)
    monkeypatch.setattr(sys.modules[__name__], "ROPE_THETA", 5e5)
    assert vllm_ns_with(model, hf_overrides=global_theta).digest() != before.digest()


SNIPPET = """
import sys
from pathlib import Path
from tests.unit.test_namespace_identity import kinds, theta_override, vllm_ns_with
model = Path(sys.argv[1])
print(vllm_ns_with(model, hf_overrides=theta_override(1e4)).digest().hex(),
      vllm_ns_with(model, hf_overrides=kinds).digest().hex())
"""


def test_a_callable_override_names_the_same_namespace_in_every_process(tmp_path):
    model = local_model(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", SNIPPET, str(model)], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        runs.add(out.stdout.strip())
    assert len(runs) == 1


def test_regression_an_hf_config_path_edited_in_place_kept_its_namespace(tmp_path):
    model, configs = local_model(tmp_path), tmp_path / "configs"
    configs.mkdir()
    (configs / "config.json").write_text(json.dumps({"rope_theta": 10000.0}))
    before = vllm_ns_with(model, hf_config_path=str(configs))
    assert vllm_ns_with(model, hf_config_path=str(configs)) == before
    (configs / "config.json").write_text(json.dumps({"rope_theta": 1000000.0}))
    assert vllm_ns_with(model, hf_config_path=str(configs)).digest() != before.digest()


def test_regression_model_class_overrides_ran_other_code_under_the_same_namespace(tmp_path):
    model = local_model(tmp_path)
    plain = vllm_ns_with(model, model_class_overrides={})
    other = vllm_ns_with(model, model_class_overrides={"LlamaForCausalLM": "my_models:PatchedLlama"})
    assert other.digest() != plain.digest()
    assert plain == vllm_ns_with(model)  # unset: the namespace it always had


def kv_ns(model, *, dtype: str, cache_dtype: str):
    cfg = vllm_config({}, model=str(model))
    cfg.load_config = SimpleNamespace(load_format="safetensors")
    cfg.model_config = SimpleNamespace(model=str(model), revision=None, dtype=dtype)
    cfg.cache_config = SimpleNamespace(block_size=BS, cache_dtype=cache_dtype)
    import torch

    kv = torch.bfloat16 if "bfloat16" in (cache_dtype, dtype) and cache_dtype != "float16" else torch.float16
    return vllm_namespace(cfg, kv_cache_config(FullAttentionSpec(dtype=kv)), parse_settings({}, source="x").config)


def test_regression_a_bfloat16_cache_of_float32_activations_shared_native_bfloat16_kv(tmp_path):
    # --dtype float32 --kv-cache-dtype bfloat16 caches rounded float32 K/V; --dtype bfloat16
    # caches bfloat16-computed K/V: both blocks say "bfloat16" and were one namespace
    model = local_model(tmp_path)
    native = kv_ns(model, dtype="bfloat16", cache_dtype="auto")
    assert native.dtype == "bfloat16"
    assert kv_ns(model, dtype="float32", cache_dtype="bfloat16").digest() != native.digest()
    assert kv_ns(model, dtype="float16", cache_dtype="bfloat16").digest() != native.digest()
    assert kv_ns(model, dtype="bfloat16", cache_dtype="bfloat16") == native  # the same bytes: shared


def with_draft(model, draft, *, method: str = "eagle3"):
    cfg = vllm_config({}, model=str(model))
    cfg.load_config = SimpleNamespace(load_format="safetensors")
    cfg.model_config = SimpleNamespace(model=str(model), revision=None)
    if draft is not None:
        cfg.speculative_config = SimpleNamespace(
            method=method, draft_model_config=SimpleNamespace(model=str(draft), revision=None, quantization=None))
    return vllm_namespace(cfg, kv_cache_config(FullAttentionSpec()), parse_settings({}, source="x").config)


def test_regression_a_draft_models_weights_replaced_in_place_kept_the_namespace(tmp_path):
    # EAGLE heads page their KV in the target's group: a block holds the draft layers' KV too
    model = local_model(tmp_path)
    draft = local_model(tmp_path / "eagle")
    before = with_draft(model, draft)
    assert with_draft(model, draft) == before
    rewrite_same_size(draft / "model-00001-of-00002.safetensors")
    assert with_draft(model, draft).digest() != before.digest()
    assert with_draft(model, None) == vllm_ns_with(model)  # no drafter: as before
    assert with_draft(model, model, method="mtp") == vllm_ns_with(model)  # MTP: the target's own files


def test_what_does_not_change_kv_keeps_the_namespace(tmp_path):
    model = local_model(tmp_path)
    base = vllm_ns_with(model)
    assert vllm_ns_with(model, served_model_name=["alias"], max_model_len=4096, gpu_memory_utilization=0.5,
                        hf_token="hf_secret", tokenizer="/elsewhere/tokenizer", seed=7) == base


def recursive_theta(theta: float):
    def overrides(config, depth: int = 0):  # (its closure holds itself)
        return overrides(config, depth + 1) if depth < 0 else setattr(config, "rope_theta", theta) or config
    return overrides


class Scaled:
    def __init__(self, theta: float) -> None:
        self.theta, self.me = theta, self  # (an object that refers to itself)

    def overrides(self, config):
        config.rope_theta = self.theta
        return config


def test_regression_callable_overrides_holding_cycles_or_tuple_keys_failed_the_engines_start(tmp_path):
    """Their captured values were dumped as JSON: a closure over itself or a self-referring object
    raised ValueError, a dict with tuple keys TypeError, out of the connector's start."""
    model = local_model(tmp_path)
    by_model = {("llama", 1): 1e6}
    digests = {vllm_ns_with(model, hf_overrides=recursive_theta(t)).digest() for t in (1e4, 1e6)}
    digests |= {vllm_ns_with(model, hf_overrides=Scaled(t).overrides).digest() for t in (1e4, 1e6)}
    digests.add(vllm_ns_with(model, hf_overrides=lambda c: setattr(c, "rope_theta", by_model[("llama", 1)]) or c).digest())
    assert len(digests) == 5, "each a namespace of its own"


def test_a_closure_over_a_tensor_is_named_by_all_of_its_values(tmp_path):
    import torch

    model = local_model(tmp_path)
    factors = torch.ones(10_000)
    other = factors.clone()
    other[5_000] = 2.0  # (str() of either elides the middle)

    def scaled(values):
        return lambda c: setattr(c, "rope_factors", values) or c

    assert vllm_ns_with(model, hf_overrides=scaled(factors)) != vllm_ns_with(model, hf_overrides=scaled(other))
    assert vllm_ns_with(model, hf_overrides=scaled(factors)) == vllm_ns_with(model, hf_overrides=scaled(factors.clone()))
