"""What names a TensorRT-LLM engine's KV beyond its checkpoint files: the quantization it applies
(``quant_config``: weights quantized as the engine is built, an FP8 or INT8 KV cache) and, under
a quantized KV cache, the activation dtype the pages were quantized from. A plain engine keeps
the namespace it had; an FP8 KV cache is stored as FP8 pages instead of being refused."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from tests.integrations.trtllm_executor import KvCacheConfig, LlmArgs, QuantConfig, write_model_config
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.common import parse_settings
from tiered_kv.integrations.trtllm import TieredKVWorker, trtllm_namespace


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "llama-like"
    write_model_config(path)
    (path / "model.safetensors").write_bytes(b"bf16 weights")
    return path


def namespace(model, **llm):
    kv = llm.pop("kv", KvCacheConfig())
    settings = parse_settings(None, source="t", environ={})  # (no TIERED_KV_* of the test's environment)
    return trtllm_namespace(LlmArgs(model=str(model), kv_cache_config=kv, **llm), settings.config)


def test_a_plain_engine_keeps_its_namespace_with_or_without_a_default_quant_config(model):
    assert namespace(model, quant_config=QuantConfig()) == namespace(model)
    assert namespace(model).dtype == "float32" and "+numerics-" not in namespace(model).revision


@pytest.mark.parametrize("quant", [
    QuantConfig(quant_algo="FP8"),  # a bf16 checkpoint's weights quantized as the engine is built
    QuantConfig(quant_algo="W4A16_AWQ", group_size=64),
    QuantConfig(quant_algo="W8A8_SQ_PER_CHANNEL", smoothquant_val=0.8),
])
def test_regression_an_engine_built_with_quant_config_got_the_plain_engines_namespace(model, quant):
    # same checkpoint files, so the same fingerprint: the quantized engine read the plain one's KV
    quantized = namespace(model, quant_config=quant)
    assert quantized.digest() != namespace(model).digest()
    assert quantized == namespace(model, quant_config=QuantConfig(**vars(quant)))
    assert quantized.digest() != namespace(model, quant_config=QuantConfig(quant_algo="NVFP4")).digest()


def test_a_cached_property_read_on_one_half_does_not_split_the_halves_namespaces(model):
    # TensorRT-LLM's QuantConfig caches quant_mode in its __dict__ once read
    read, unread = QuantConfig(quant_algo="FP8"), QuantConfig(quant_algo="FP8")
    read.quant_mode  # noqa: B018
    assert namespace(model, quant_config=read) == namespace(model, quant_config=unread)


def test_an_fp8_kv_cache_set_by_kv_cache_config_names_fp8_pages_and_their_activation_dtype(model):
    fp8 = namespace(model, kv=KvCacheConfig(dtype="fp8"), dtype="bfloat16")
    assert fp8.dtype == "float8_e4m3fn"
    assert fp8.digest() != namespace(model, kv=KvCacheConfig(dtype="fp8"), dtype="float16").digest()


def test_a_kv_quantization_set_by_hand_on_a_plain_checkpoint_is_ignored_as_the_pytorch_backend_does(model):
    # TensorRT-LLM's PyTorch backend ignores a hand-set quant_config: the pool stays bf16, and a
    # namespace that said fp8 refused the pool at registration
    by_hand = namespace(model, quant_config=QuantConfig(kv_cache_quant_algo="FP8"), dtype="bfloat16")
    assert by_hand.dtype == "bfloat16"
    assert by_hand.digest() != namespace(model, dtype="bfloat16").digest()  # kept apart all the same


def test_a_quantized_checkpoints_kv_quantization_as_tensorrt_llm_read_it_names_the_pages(model):
    # a checkpoint layout not read here: TensorRT-LLM copies its reading into quant_config
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    read = QuantConfig(quant_algo="FP8", kv_cache_quant_algo="FP8")
    assert namespace(model, quant_config=read).dtype == "float8_e4m3fn"
    assert namespace(model, quant_config=QuantConfig(quant_algo="FP8")).dtype == "float32"


def test_a_checkpoints_own_fp8_kv_cache_is_read_from_its_quantization_files(model):
    (model / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    assert namespace(model).dtype == "float8_e4m3fn"
    # kv_cache_config.dtype set by the operator wins, as in TensorRT-LLM
    assert namespace(model, kv=KvCacheConfig(dtype="bfloat16")).dtype == "bfloat16"


def test_an_llm_compressor_fp8_kv_scheme_in_config_json_names_fp8_pages(model):
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    (model / "config.json").write_text(json.dumps(config))
    assert namespace(model).dtype == "float8_e4m3fn"


def test_switching_a_checkpoints_kv_quantization_file_changes_the_namespace(model):
    quant = model / "hf_quant_config.json"
    quant.write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}))
    bf16_kv = namespace(model, kv=KvCacheConfig(dtype="bfloat16"))
    quant.write_text(json.dumps({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    assert namespace(model, kv=KvCacheConfig(dtype="bfloat16")).digest() != bf16_kv.digest()


def test_a_kv_cache_quantized_with_block_scales_is_refused_in_one_line(model):
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "NVFP4"}}))
    with pytest.raises(ConfigError, match="NVFP4 keeps scales") as refused:
        namespace(model)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="NVFP4 keeps scales"):
        namespace(model, kv=KvCacheConfig(dtype="nvfp4"))


class _LoadFormat:
    """TensorRT-LLM's ``LoadFormat`` enum member ``DUMMY``."""

    name, value = "DUMMY", 1


@pytest.mark.parametrize("setting", [
    {"load_format": "dummy"}, {"load_format": _LoadFormat()},  # random weights: a profiling run
    {"model_kwargs": {"rope_scaling": {"type": "yarn", "factor": 4.0}}},  # RoPE is applied to K
    {"force_dynamic_quantization": True},
])
def test_regression_what_changes_the_kv_of_the_same_files_shared_the_plain_engines_namespace(model, setting):
    assert namespace(model, **setting).digest() != namespace(model).digest()
    assert namespace(model, model_kwargs={}, force_dynamic_quantization=False, load_format="auto") == namespace(model)


class _PydanticQuantConfig:
    """Current TensorRT-LLM's ``QuantConfig``: a pydantic model (its fields in the class's
    ``model_fields``) with a cached property that lands in ``__dict__`` once read."""

    model_fields = {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": None}

    def __init__(self, quant_algo=None, kv_cache_quant_algo=None, group_size=128) -> None:
        self.quant_algo, self.kv_cache_quant_algo, self.group_size = quant_algo, kv_cache_quant_algo, group_size

    @functools.cached_property
    def quant_mode(self) -> object:
        return object()


def test_a_pydantic_quant_config_is_named_by_its_declared_fields_whatever_was_read_of_it(model):
    read, unread = _PydanticQuantConfig(quant_algo="FP8"), _PydanticQuantConfig(quant_algo="FP8")
    read.quant_mode  # noqa: B018
    assert namespace(model, quant_config=read) == namespace(model, quant_config=unread)
    assert namespace(model, quant_config=read).digest() != namespace(
        model, quant_config=_PydanticQuantConfig(quant_algo="FP8", group_size=64)).digest()


def test_regression_an_fp8_kv_pool_of_a_prequantized_checkpoint_was_refused_at_registration(model, tmp_path, monkeypatch):
    # the namespace said the model dtype, the pool held fp8: every FP8-KV checkpoint was refused
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIERED_KV_DISK_URL", f"lmdb://{tmp_path}/db")
    worker = TieredKVWorker(LlmArgs(model=str(model), kv_cache_config=KvCacheConfig(), dtype="bfloat16"))
    try:
        pool = torch.zeros(8, 2, 2, 4 * 2 * 4, dtype=torch.float8_e4m3fn)  # [blocks, layers, K|V, block]
        worker.register_kv_caches(pool)
        assert worker.namespace.dtype == "float8_e4m3fn"
    finally:
        worker.close()
