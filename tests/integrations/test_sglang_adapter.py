"""tiered-kv as SGLang's HiCache L3 storage, against stand-ins with SGLang's fields (no SGLang
install needed; ``tools/check_sglang.sh`` drives SGLang's own controller and radix cache).

Pages go out of a host pool through the backend and come back bit-exact into another host pool,
in a new backend over the same LMDB directory (a restart), under every host layout, both storage
interfaces, bf16 and fp16, MHA and MLA; what SGLang relies on beyond that: leading runs, stops at
the first bad page, re-sets that succeed, answers instead of exceptions, several threads."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from tests.integrations.sglang_standins import MHAPool, MLAPool, StorageConfig
from tests.store.helpers import rewrite_stored_blocks
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.sglang import TieredKVHiCacheStorage
from tiered_kv.integrations.sglang_pages import page_key

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
MLA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def sglang_keys(n: int, seed: str = "prompt") -> list[str]:
    """Chained page hashes the way SGLang spells them (64 hex digits)."""
    keys, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def backend(tmp_path, pool, *, config: StorageConfig | None = None, **extra) -> TieredKVHiCacheStorage:
    config = config or StorageConfig(is_mla_model=isinstance(pool, MLAPool))
    config.extra_config = {"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
                           "class_name": "TieredKVHiCacheStorage",
                           "disk": {"url": f"lmdb://{tmp_path}/l3", "capacity": "64MiB"}, **extra}
    storage = TieredKVHiCacheStorage(config, {})
    storage.register_mem_pool_host(pool)
    return storage


def pages_of(pool, first_page: int, n: int) -> list[torch.Tensor]:
    return [pool.get_data_page((first_page + i) * pool.page_size, flat=True).clone() for i in range(n)]


def make_pool(kind: str, layout: str, dtype, seed: int):
    cls = MHAPool if kind == "mha" else MLAPool
    return cls(layout, dtype=dtype, seed=seed)


CASES = ([("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind,layout", CASES)
@pytest.mark.parametrize("interface", ["v0", "v1"])
def test_pages_backed_up_come_back_bit_exact_after_a_restart(tmp_path, kind, layout, dtype, interface):
    keys = sglang_keys(6)
    source = make_pool(kind, layout, dtype, seed=1)
    writer = backend(tmp_path, source)
    if interface == "v1":
        assert writer.batch_set_v1(keys, source.page_indices(2, 6)) == [True] * 6
    else:
        assert writer.batch_set(keys, pages_of(source, 2, 6)) is True
    writer.close()

    target = make_pool(kind, layout, dtype, seed=2)  # other bytes everywhere
    reader = backend(tmp_path, target)
    assert reader.batch_exists(keys) == 6
    if interface == "v1":
        assert reader.batch_get_v1(keys, target.page_indices(9, 6)) == [True] * 6
    else:
        got = reader.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
        for i, page in enumerate(got):
            target.set_from_flat_data_page((9 + i) * target.page_size, page)
    for want, got in zip(pages_of(source, 2, 6), pages_of(target, 9, 6)):
        assert torch.equal(want, got)
    reader.close()


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_the_zero_copy_and_the_flat_interfaces_store_the_same_bytes(tmp_path, layout):
    keys = sglang_keys(3)
    source = MHAPool(layout, seed=1)
    storage = backend(tmp_path, source)
    assert storage.batch_set_v1(keys, source.page_indices(0, 3)) == [True] * 3
    flat = storage.batch_get(keys, [source.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(a, b) for a, b in zip(flat, pages_of(source, 0, 3)))
    storage.close()


def test_a_page_written_under_one_host_layout_is_never_served_to_another(tmp_path):
    keys = sglang_keys(2)
    first = MHAPool("page_first", seed=1)
    storage = backend(tmp_path, first)
    assert storage.batch_set_v1(keys, first.page_indices(0, 2)) == [True, True]
    storage.close()
    other = backend(tmp_path, MHAPool("layer_first", seed=2))
    assert other.batch_exists(keys) == 0
    assert other.batch_get_v1(keys, torch.arange(8)) == [False, False]
    other.close()


def test_mha_ranks_keep_their_own_pages_and_mla_ranks_share_one_copy(tmp_path):
    keys = sglang_keys(2)
    for kind, cls in (("mha", MHAPool), ("mla", MLAPool)):
        rank0 = backend(tmp_path, cls("page_first", seed=1),
                        config=StorageConfig(tp_rank=0, tp_size=2, is_mla_model=kind == "mla"))
        assert rank0.batch_set_v1(keys, torch.arange(8)) == [True, True]
        rank0.close()
        rank1 = backend(tmp_path, cls("page_first", seed=2),
                        config=StorageConfig(tp_rank=1, tp_size=2, is_mla_model=kind == "mla"))
        assert rank1.batch_exists(keys) == (2 if kind == "mla" else 0), kind
        rank1.close()


@pytest.mark.parametrize("cls", [MHAPool, MLAPool], ids=["mha", "mla"])
def test_regression_a_pipeline_stage_was_served_the_layers_another_partition_gave_that_stage(tmp_path, cls):
    # one 32-layer checkpoint at --pp-size 3: SGLang's default partition (10, 11, 11) gives stage 1
    # layers 10-20, SGLANG_PP_LAYER_PARTITION=11,11,10 gives it layers 11-21; both were named
    # "pp=1/3" with 11 layers, and the second server read the first one's layers 10-20 as 11-21
    keys = sglang_keys(2)

    def stage_1(pool):
        return backend(tmp_path, pool, config=StorageConfig(pp_rank=1, pp_size=3, is_mla_model=cls is MLAPool))

    default = cls("page_first", layer_num=11, start_layer=10, seed=1)
    writer = stage_1(default)
    assert writer.batch_set_v1(keys, default.page_indices(0, 2)) == [True, True]
    writer.close()
    other = cls("page_first", layer_num=11, start_layer=11, seed=2)
    reader = stage_1(other)
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, other.page_indices(4, 2)) == [False, False]
    reader.close()
    same = stage_1(cls("page_first", layer_num=11, start_layer=10, seed=2))
    assert same.batch_exists(keys) == 2  # the same partition still shares its pages
    same.close()


def test_an_mla_rank_that_is_not_the_writer_stores_nothing_and_reports_success(tmp_path):
    keys = sglang_keys(2)
    pool = MLAPool("page_first", seed=1)
    rank1 = backend(tmp_path, pool, config=StorageConfig(tp_rank=1, tp_size=2, is_mla_model=True))
    assert rank1.batch_set_v1(keys, pool.page_indices(0, 2)) == [True, True]
    assert rank1.batch_exists(keys) == 0
    rank1.close()


def test_regression_every_mla_rank_that_never_writes_held_a_writers_staging_area(tmp_path):
    # DeepSeek-V3 at page size 64: 4.3 MiB pages, 2.1 GiB of staging zeroed on each of 7 readers of TP8
    keys = sglang_keys(128)  # one SGLang storage batch
    source = MLAPool("page_first", pages=130, seed=1)
    writer = backend(tmp_path, source, config=StorageConfig(tp_rank=0, tp_size=2, is_mla_model=True))
    page_bytes = writer.geometry.page_bytes
    assert writer.store.host.capacity == 4 * 128 * page_bytes
    assert writer.batch_set_v1(keys, source.page_indices(0, 128)) == [True] * 128
    writer.close()

    target = MLAPool("page_first", pages=130, seed=2)
    reader = backend(tmp_path, target, config=StorageConfig(tp_rank=1, tp_size=2, is_mla_model=True))
    assert reader.store.host.capacity == 2 * 128 * page_bytes
    assert reader.batch_get_v1(keys, target.page_indices(1, 128)) == [True] * 128
    assert all(torch.equal(a, b) for a, b in zip(pages_of(target, 1, 128), pages_of(source, 0, 128)))
    assert not list(reader.store.host.scan())  # reads into SGLang's host pool take no staging
    reader.close()
    sized = backend(tmp_path, target, config=StorageConfig(tp_rank=1, tp_size=2, is_mla_model=True),
                    host={"capacity": 600 * page_bytes})
    assert sized.store.host.capacity == 600 * page_bytes  # the operator's size stands
    sized.close()


def test_a_corrupt_page_is_a_counted_miss_where_sglang_cuts_the_prefix(tmp_path):
    keys = sglang_keys(4)
    source = MHAPool("page_first", seed=1)
    storage = backend(tmp_path, source)
    assert storage.batch_set_v1(keys, source.page_indices(0, 4)) == [True] * 4
    digest, bad = storage.namespace.digest(), page_key(storage.namespace, keys[2])
    storage.close()

    def flip(storage_key: bytes, value: bytes) -> bytes | None:
        if storage_key != digest + bad:
            return None
        return value[:-9] + bytes([value[-9] ^ 0x40]) + value[-8:]

    assert rewrite_stored_blocks(tmp_path / "l3", flip) == 1
    target = MHAPool("page_first", seed=2)
    before = pages_of(target, 6, 4)
    reader = backend(tmp_path, target)
    assert reader.batch_get_v1(keys, target.page_indices(4, 4)) == [True, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(target, 4, 2), pages_of(source, 0, 2)))
    assert torch.equal(pages_of(target, 6, 2)[0], before[0])  # nothing of the bad page landed
    assert reader.store.stats()["tiers"]["disk"]["misses"].get("corrupt", 0) == 1
    reader.close()


def test_batch_exists_is_the_leading_run_and_reads_stop_at_the_first_missing_page(tmp_path):
    keys = sglang_keys(5)
    pool = MHAPool("layer_first", seed=1)
    storage = backend(tmp_path, pool)
    assert storage.batch_set_v1(keys[:2] + keys[3:], torch.cat([pool.page_indices(0, 2), pool.page_indices(3, 2)]))
    assert storage.batch_exists(keys) == 2
    assert storage.exists(keys[4]) and not storage.exists(keys[2])
    assert storage.batch_get_v1(keys, pool.page_indices(8, 5)) == [True, True, False, False, False]
    storage.close()


def test_setting_a_page_that_is_already_stored_is_success(tmp_path):
    keys = sglang_keys(3)
    pool = MHAPool("page_head", seed=1)
    storage = backend(tmp_path, pool)
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    assert storage.set(keys[0], pool.get_data_page(0)) is True
    storage.close()


def test_failures_are_answered_as_misses_never_raised_into_sglang_threads(tmp_path):
    keys = sglang_keys(2)
    unregistered = TieredKVHiCacheStorage(StorageConfig(extra_config={}), {})
    assert unregistered.batch_exists(keys) == 0
    assert unregistered.batch_get_v1(keys, torch.arange(8)) == [False, False]
    assert unregistered.batch_get(keys) == [None, None]
    assert unregistered.get(keys[0]) is None
    assert unregistered.batch_set(keys, [torch.zeros(4)] * 2) is False
    pool = MHAPool("page_first")
    storage = backend(tmp_path, pool)
    assert storage.batch_set_v1(keys, torch.arange(3)) == [False, False]  # too few host indices
    assert storage.batch_set(keys, [torch.zeros(5), torch.zeros(5)]) is False  # not a page
    storage.close()
    assert storage.batch_get_v1(keys, pool.page_indices(0, 2)) == [False, False]  # after close
    assert unregistered._failures == 5 and storage._failures == 3


def test_prefetch_io_and_backup_threads_share_one_backend(tmp_path):
    pool = MHAPool("page_first", pages=64, seed=3)  # pages 0-31 are backed up, 32-63 prefetched into
    storage = backend(tmp_path, pool)
    sources = {p: pages_of(pool, p, 1)[0] for p in range(32)}
    errors: list[BaseException] = []

    def backup_and_prefetch(t: int) -> None:
        try:
            for i in range(4):
                first = t * 8 + 2 * i
                keys = sglang_keys(2, seed=f"t{t}-{i}")
                assert storage.batch_set_v1(keys, pool.page_indices(first, 2)) == [True, True]
                assert storage.batch_get_v1(keys, pool.page_indices(32 + first, 2)) == [True, True]
                assert storage.batch_exists(keys) == 2
                for j, page in enumerate(pages_of(pool, 32 + first, 2)):
                    assert torch.equal(page, sources[first + j])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=backup_and_prefetch, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    storage.close()


def test_settings_come_from_the_extra_config_next_to_sglangs_own_keys(tmp_path):
    config = StorageConfig(extra_config={"backend_name": "tiered_kv", "interface_v1": 1,
                                         "tiered_kv": {"workers": 3, "disk": {"url": f"lmdb://{tmp_path}/x"}},
                                         "model_id": "org/named-here"})
    storage = TieredKVHiCacheStorage(config, {})
    storage.register_mem_pool_host(MHAPool("page_first"))
    assert storage.store.config.workers == 3 and storage.namespace.model_id == "org/named-here"
    assert [t.name for t in storage.store.tiers] == ["disk"]
    storage.close()
    with pytest.raises(ConfigError):
        TieredKVHiCacheStorage(StorageConfig(extra_config={"workers": 0}), {})


def test_clear_removes_every_page_of_the_namespace(tmp_path):
    keys = sglang_keys(3)
    pool = MHAPool("page_first", seed=1)
    storage = backend(tmp_path, pool)
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    storage.clear()
    assert storage.batch_exists(keys) == 0
    storage.close()
    assert backend(tmp_path, pool).batch_exists(keys) == 0


def test_stats_report_pages_per_call_and_the_stores_metrics(tmp_path):
    keys = sglang_keys(2)
    pool = MHAPool("page_first", seed=1)
    storage = backend(tmp_path, pool)
    storage.batch_set_v1(keys, pool.page_indices(0, 2))
    storage.batch_get_v1(keys, pool.page_indices(4, 2))
    stats = storage.get_stats()
    backup = stats["backup_pgs"] if isinstance(stats, dict) else stats.backup_pgs
    prefetch = stats["prefetch_pgs"] if isinstance(stats, dict) else stats.prefetch_pgs
    assert backup == [2] and prefetch == [2]
    storage.close()


def test_pools_whose_pages_cannot_be_stored_are_refused_when_sglang_attaches_them(tmp_path):
    class UnifiedPool(MHAPool):
        def get_data_page(self, index, flat=True):
            raise ValueError("Unsupported layout: page_unified")

    pool = UnifiedPool("page_first")
    pool.layout = "page_unified"
    storage = TieredKVHiCacheStorage(StorageConfig(extra_config={}), {})
    with pytest.raises(ConfigError, match="page_unified"):
        storage.register_mem_pool_host(pool)
    storage.register_mem_host_pool_v2(MHAPool("page_first"), "kv")  # the KV pool again: fine
    with pytest.raises(ConfigError, match="mamba"):
        storage.register_mem_host_pool_v2(object(), "mamba")


def test_regression_a_host_pool_without_kv_of_its_own_crashed_the_attach_with_a_zero_division(tmp_path):
    # DeepSeek-V4's KV anchor is SGLang's LogicalHostPool: no layers, empty pages (its KV lives in
    # the extra pools); attaching raised ZeroDivisionError out of the namespace, not a refusal
    class LogicalPool(MHAPool):
        def get_data_page(self, index, flat=True):
            return torch.empty(0, dtype=torch.uint8)

        def get_dummy_flat_data_page(self):
            return torch.empty(0, dtype=torch.uint8)

    pool = LogicalPool("layer_first", layer_num=0, dtype=torch.uint8)
    storage = TieredKVHiCacheStorage(StorageConfig(extra_config={}, is_mla_model=True), {})
    with pytest.raises(ConfigError, match="no KV pages of its own"):
        storage.register_mem_pool_host(pool)



def test_a_pipeline_stage_whose_pool_does_not_name_its_first_layer_is_refused(tmp_path):
    # without start_layer two servers splitting the layers otherwise would name one stage alike
    pool = MHAPool("page_first", layer_num=11, seed=1)
    del pool.start_layer
    storage = TieredKVHiCacheStorage(StorageConfig(extra_config={}, pp_rank=1, pp_size=3), {})
    with pytest.raises(ConfigError, match="start_layer"):
        storage.register_mem_pool_host(pool)


def test_the_cli_shows_and_verifies_sglang_pages_offline(tmp_path):
    from tests.cli.conftest import cli

    keys = sglang_keys(3)
    pool = MLAPool("page_first", seed=1)
    storage = backend(tmp_path, pool)
    assert storage.batch_set_v1(keys, pool.page_indices(0, 3)) == [True] * 3
    storage.close()
    report = cli("inspect", "--json", tmp_path / "l3").json()
    (ns,) = report["tiers"][0]["namespaces"].values()
    assert ns["blocks"] == 3 and ns["layout"].startswith("sglang:mla:page_first:") and ns["tp"] == "0/1"
    assert "(sglang" in cli("inspect", tmp_path / "l3").out  # the table names the page layout too
    verified = cli("verify", tmp_path / "l3")
    assert verified.code == 0 and "3 valid blocks" in verified.out
