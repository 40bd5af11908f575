"""What names an SGLang server's pages beyond the host pool: the checkpoint (``--model-path``,
not the served name) and the server args that change the K/V a checkpoint computes for the same
tokens (``--quantization fp8`` of a bf16 checkpoint, ``--kv-cache-dtype``,
``--json-model-override-args``, ...), folded into the namespace when set; a server that sets none
keeps the namespace it had."""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

import pytest
import torch

from tests.integrations.sglang_standins import MHAPool, ServerArgs, StorageConfig
from tests.integrations.test_sglang_adapter import pages_of, sglang_keys
from tiered_kv.integrations.sglang import TieredKVHiCacheStorage
from tiered_kv.integrations.sglang_pages import geometry_of, page_namespace


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("TIERED_KV_")]:
        monkeypatch.delenv(name)


def server(tmp_path, server_args: ServerArgs | None, *, pool=None, served_name: str | None = None,
           **extra) -> TieredKVHiCacheStorage:
    """The backend SGLang builds for a server started with ``server_args`` (None: SGLang gave none)
    and ``--served-model-name served_name`` (SGLang's storage model name; else the model path)."""
    config = StorageConfig() if served_name is None else StorageConfig(model_name=served_name)
    config.extra_config = {"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
                           "class_name": "TieredKVHiCacheStorage",
                           "disk": {"url": f"lmdb://{tmp_path}/l3", "capacity": "64MiB"}, **extra}
    storage = TieredKVHiCacheStorage(config, {} if server_args is None else {"server_args": server_args})
    storage.register_mem_pool_host(pool if pool is not None else MHAPool("page_first"))
    return storage


def namespace_of(tmp_path, server_args: ServerArgs | None, **kw):
    storage = server(tmp_path, server_args, **kw)
    try:
        return storage.namespace
    finally:
        storage.close()


def plain_namespace(pool=None):
    """The namespace the adapter gave a page_first pool before server args named pages."""
    pool = pool if pool is not None else MHAPool("page_first")
    return page_namespace(geometry_of(pool, mla=False), StorageConfig(), revision="")


@pytest.mark.parametrize("setting", [
    {"quantization": "fp8"},  # a bf16 checkpoint's weights quantized as they load
    {"modelopt_quant": "fp8"},
    {"modelopt_checkpoint_restore_path": "/ckpt/modelopt-fp8"},
    {"rl_quant_profile": "/profiles/flash_rl.json"},
    {"json_model_override_args": '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}'},  # RoPE: K
    {"kv_cache_dtype": "fp8_e4m3"},
    {"quantization_param_path": "/scales/kv.json"},
    {"revision": "refs/pr/7"},  # another revision of the same hub model
    {"load_format": "dummy"},  # random weights
    {"load_format": "bitsandbytes"},  # weights quantized as they load
])
def test_regression_a_quantized_server_on_the_same_checkpoint_got_the_plain_servers_namespace(tmp_path, setting):
    # two SGLang servers on one checkpoint, one with --quantization fp8 (or a RoPE override, an
    # fp8 KV cache, ...), got one namespace and read each other's pages: their K/V differ
    plain = namespace_of(tmp_path, ServerArgs())
    assert namespace_of(tmp_path, ServerArgs(**setting)).digest() != plain.digest()
    assert namespace_of(tmp_path, ServerArgs(**setting)) == namespace_of(tmp_path, ServerArgs(**setting))


def test_regression_two_servers_with_one_served_name_read_each_others_pages(tmp_path):
    # --served-model-name llm on an Instruct checkpoint and on its base model (same geometry):
    # SGLang names the storage model by the served name, and nothing of a hub checkpoint reached
    # the namespace: the base model was served the Instruct model's K/V
    keys, pool = sglang_keys(3), MHAPool("page_first", seed=1)
    instruct = server(tmp_path, ServerArgs(model_path="meta-llama/Llama-3.1-8B-Instruct"), pool=pool,
                      served_name="llm")
    assert instruct.batch_set(keys, pages_of(pool, 0, 3)) is True
    instruct.close()
    target = MHAPool("page_first", seed=2)
    base = server(tmp_path, ServerArgs(model_path="meta-llama/Llama-3.1-8B"), pool=target, served_name="llm")
    try:
        assert base.batch_exists(keys) == 0
        assert base.batch_get_v1(keys, target.page_indices(4, 3)) == [False] * 3
        assert base.namespace.model_id == "meta-llama/Llama-3.1-8B"  # the checkpoint, not "llm"
    finally:
        base.close()


def test_one_checkpoint_served_under_other_names_shares_its_pages(tmp_path):
    keys, pool = sglang_keys(3), MHAPool("page_first", seed=1)
    checkpoint = ServerArgs(model_path="meta-llama/Llama-3.1-8B-Instruct")
    blue = server(tmp_path, checkpoint, pool=pool, served_name="chat-blue")
    assert blue.batch_set(keys, pages_of(pool, 0, 3)) is True
    blue.close()
    green = server(tmp_path, checkpoint, pool=MHAPool("page_first", seed=2), served_name="chat-green")
    try:
        assert green.batch_exists(keys) == 3
    finally:
        green.close()
    # a hub revision names other weights of the same id
    pinned = namespace_of(tmp_path, ServerArgs(model_path=checkpoint.model_path, revision="0e9e39f"))
    assert pinned.digest() != namespace_of(tmp_path, checkpoint).digest()


def test_with_nothing_set_the_namespace_is_the_one_it_was(tmp_path):
    assert namespace_of(tmp_path, ServerArgs()) == plain_namespace()
    assert namespace_of(tmp_path, None) == plain_namespace()  # SGLang handed no server args
    loader = ServerArgs(load_format="safetensors", model_loader_extra_config='{"enable_multithread_load": true}')
    assert namespace_of(tmp_path, loader) == plain_namespace()  # how weights load is not what they are


def test_an_operators_revision_still_names_the_weights_and_the_quantization_is_added(tmp_path):
    pinned = namespace_of(tmp_path, ServerArgs(revision="main"), revision="v7")
    assert pinned.revision == "v7"
    quantized = namespace_of(tmp_path, ServerArgs(revision="main", quantization="fp8"), revision="v7")
    assert quantized.revision.startswith("v7+numerics-")


def test_fp8_kv_formats_held_in_uint8_host_pools_get_their_own_namespaces(tmp_path):
    # SGLang keeps fp8 KV in uint8 buffers: the pool's dtype is uint8 for e4m3 and e5m2 alike
    pool = MHAPool("page_first", dtype=torch.uint8)
    e4m3 = namespace_of(tmp_path, ServerArgs(kv_cache_dtype="fp8_e4m3"), pool=pool)
    e5m2 = namespace_of(tmp_path, ServerArgs(kv_cache_dtype="fp8_e5m2"), pool=pool)
    assert e4m3.digest() != e5m2.digest()
    # and the activation dtype the fp8 values were quantized from, which the pool does not name
    bf16 = namespace_of(tmp_path, ServerArgs(kv_cache_dtype="fp8_e4m3", dtype="bfloat16"), pool=pool)
    fp16 = namespace_of(tmp_path, ServerArgs(kv_cache_dtype="fp8_e4m3", dtype="float16"), pool=pool)
    assert bf16.digest() != fp16.digest()


def test_the_activation_dtype_is_not_folded_where_the_pool_dtype_names_the_kv(tmp_path):
    assert namespace_of(tmp_path, ServerArgs(dtype="bfloat16")) == plain_namespace()


def test_config_overrides_are_named_by_content_not_spelling(tmp_path):
    spaced = ServerArgs(json_model_override_args='{"rope_theta": 1e6, "max_position_embeddings": 8192}')
    packed = ServerArgs(json_model_override_args='{"max_position_embeddings":8192,"rope_theta":1000000.0}')
    assert namespace_of(tmp_path, spaced) == namespace_of(tmp_path, packed)
    assert namespace_of(tmp_path, ServerArgs(json_model_override_args=" {} ")) == plain_namespace()


def test_a_quantized_servers_pages_are_not_served_to_the_plain_server(tmp_path):
    keys, pool = sglang_keys(4), MHAPool("page_first", seed=1)
    quantized = server(tmp_path, ServerArgs(quantization="fp8"), pool=pool)
    assert quantized.batch_set(keys, pages_of(pool, 0, 4)) is True
    quantized.close()
    plain = server(tmp_path, ServerArgs(), pool=MHAPool("page_first", seed=2))
    try:
        assert plain.batch_exists(keys) == 0  # a cold miss, not the fp8 server's K/V
    finally:
        plain.close()
    again = server(tmp_path, ServerArgs(quantization="fp8"), pool=MHAPool("page_first", seed=3))
    try:
        assert again.batch_exists(keys) == 4  # a restart of the fp8 server finds its own pages
    finally:
        again.close()


def published(monkeypatch, getter) -> None:
    """SGLang 0.5.23's scheduler process: its server args published to ``runtime_context``."""
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    module = ModuleType("sglang.srt.runtime_context")
    module.get_server_args = getter
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", module)


def test_the_server_args_sglang_published_in_the_process_name_the_pages(tmp_path, monkeypatch):
    published(monkeypatch, lambda: ServerArgs(quantization="fp8"))
    from_process = namespace_of(tmp_path, None)
    assert from_process == namespace_of(tmp_path, ServerArgs(quantization="fp8"))
    assert from_process.digest() != plain_namespace().digest()


def test_server_args_sglang_has_not_published_are_said_and_leave_the_namespace_as_it_was(
        tmp_path, monkeypatch, caplog):
    def unset():
        raise ValueError("Global server args is not set yet!")

    published(monkeypatch, unset)
    with caplog.at_level(logging.WARNING, logger="tiered_kv.integrations.sglang_pages"):
        assert namespace_of(tmp_path, None) == plain_namespace()
    assert "--quantization" in caplog.text


def local_model(tmp_path, name: str = "llama-like"):
    """A checkpoint directory as SGLang's ``--model-path`` names it."""
    model = tmp_path / "models" / name
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"num_hidden_layers": 2}')
    (model / "model.safetensors").write_bytes(b"weights-1")
    return model


def test_regression_weights_replaced_in_place_under_a_local_model_path_kept_their_namespace(tmp_path):
    # a fine-tune written over /models/llama-like (same path, new weights): the restarted server
    # used to read the old weights' pages, K/V of another model
    model = local_model(tmp_path)
    before = namespace_of(tmp_path, ServerArgs(model_path=str(model)))
    assert namespace_of(tmp_path, ServerArgs(model_path=str(model))) == before
    (model / "model.safetensors").write_bytes(b"weights-2, longer")
    after = namespace_of(tmp_path, ServerArgs(model_path=str(model)))
    assert after.digest() != before.digest()
    assert after.revision.startswith("files-")


def test_a_local_model_named_only_by_sglangs_storage_model_name_is_fingerprinted_too(tmp_path):
    model = local_model(tmp_path)
    config = StorageConfig(model_name=str(model))
    config.extra_config = {"disk": {"url": f"lmdb://{tmp_path}/l3", "capacity": "64MiB"}}
    storage = TieredKVHiCacheStorage(config, {})  # SGLang handed no server args
    try:
        assert storage.revision.startswith("files-")
    finally:
        storage.close()


def test_replicas_with_their_own_copies_share_pages_when_the_operator_names_the_revision(tmp_path):
    # copies of one checkpoint at other paths differ in mtimes: the operator's revision names them
    a, b = local_model(tmp_path / "a"), local_model(tmp_path / "b")
    os.utime(b / "model.safetensors", ns=(1, 1))
    on_a = namespace_of(tmp_path, ServerArgs(model_path=str(a)), revision="ft-2026-11")
    on_b = namespace_of(tmp_path, ServerArgs(model_path=str(b)), revision="ft-2026-11")
    assert on_a == on_b and on_a.revision == "ft-2026-11"
    assert namespace_of(tmp_path, ServerArgs(model_path=str(a))) != namespace_of(tmp_path, ServerArgs(model_path=str(b)))
