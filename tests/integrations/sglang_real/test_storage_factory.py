"""SGLang's storage factory (``StorageBackendFactory``) building L3 backends from the
``--hicache-storage-backend dynamic`` extra config, as its cache controller does."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def _storage_config(extra: dict, *, mla: bool = False):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="tiny-test-model",
                                extra_config=extra)


def _close(backend) -> None:
    close = getattr(backend, "close", None)
    if close is not None:
        close()


def test_dynamic_backend_is_built_from_module_path_and_class_name(backend_spec, tmp_path):
    import importlib

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", _storage_config(backend_spec.extra_config(tmp_path)), None)
    try:
        cls = getattr(importlib.import_module(backend_spec.module_path), backend_spec.class_name)
        assert type(backend) is cls
        assert isinstance(backend, HiCacheStorage)
    finally:
        _close(backend)


def test_dynamic_config_without_a_module_path_is_refused(tmp_path):
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = {"backend_name": "x", "class_name": "HiCacheFile"}
    with pytest.raises(ValueError, match="module_path"):
        StorageBackendFactory.create_backend("dynamic", _storage_config(extra), None)


def test_a_class_that_is_not_a_hicache_storage_is_refused():
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = {"backend_name": "x", "module_path": "sglang.srt.mem_cache.hicache_storage",
             "class_name": "HiCacheStorageConfig"}
    with pytest.raises(TypeError, match="HiCacheStorage"):
        StorageBackendFactory.create_backend("dynamic", _storage_config(extra), None)


def test_an_unknown_backend_name_without_dynamic_is_refused():
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    with pytest.raises(ValueError, match="Unknown storage backend"):
        StorageBackendFactory.create_backend("tiered_kv", _storage_config({}), None)
